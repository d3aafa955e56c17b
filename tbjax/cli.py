"""The `tbjax` console command: one entry for the shell tools, `tbjax serve | generate | plan [options]` (the same
programs as `python -m tbjax.serve`, `python -m tbjax.generate`, `python -m tbjax.plan`; `tbjax COMMAND --help`
shows each one's options). Also `python -m tbjax`."""
from __future__ import annotations

import importlib
import sys

# command -> (module whose main(argv) runs it, one line of help)
COMMANDS = {
    "serve": ("tbjax.serve", "serve a model over gRPC and the OpenAI-compatible HTTP API (default: SmolLM2-135M)"),
    "generate": ("tbjax.generate", "generate text for prompts given on the command line"),
    "plan": ("tbjax.plan", "per-device memory and batch of a model on a mesh (config.json files)"),
}


_invoked_as: str | None = None     # "tbjax serve" while a command runs through this dispatcher


def prog(default: str) -> str:
    """The program name a command's --help and errors show: "tbjax COMMAND" when run through `tbjax`, else
    `default` (its `python -m` form)."""
    return _invoked_as or default


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: tbjax COMMAND [options]    (tbjax COMMAND --help for its options)", "", "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"tbjax: unknown command {cmd!r} (commands: {', '.join(COMMANDS)}; tbjax --help)", file=sys.stderr)
        return 2
    global _invoked_as
    _invoked_as = f"tbjax {cmd}"
    try:
        return importlib.import_module(COMMANDS[cmd][0]).main(rest) or 0
    finally:
        _invoked_as = None


if __name__ == "__main__":
    sys.exit(main())
