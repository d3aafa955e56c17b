"""The `tbjax` console command (tbjax/cli.py): declared in pyproject, dispatches to the same programs as the
`python -m tbjax.<command>` modules, and a wrong command is one clear line with a non-zero exit."""
import os
import subprocess
import sys
import tomllib

import pytest

from tbjax import cli, plan

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "tests", "data", "configs", "llama-3.1-8b.json")


def test_console_script_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    mod, _, fn = scripts["tbjax"].partition(":")
    assert (mod, fn) == ("tbjax.cli", "main") and callable(cli.main)


def test_plan_through_the_command_equals_the_module(capsys):
    args = [CONFIG, "--mesh", "dp=2", "--json"]
    assert plan.main(args) == 0
    direct = capsys.readouterr().out
    assert cli.main(["plan", *args]) == 0
    assert capsys.readouterr().out == direct and '"kv_bytes_per_token"' in direct


@pytest.mark.parametrize("argv,rc", [(["nonsense"], 2), ([], 2), (["--help"], 0)])
def test_usage_and_unknown_commands(argv, rc, capsys):
    assert cli.main(argv) == rc
    out, err = capsys.readouterr()
    if argv == ["nonsense"]:
        assert out == "" and err.count("\n") == 1 and "unknown command 'nonsense'" in err
    else:
        assert all(c in out for c in cli.COMMANDS)


def test_python_dash_m_tbjax_serve_help():
    p = subprocess.run([sys.executable, "-m", "tbjax", "serve", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--http-port" in p.stdout and "--max-num-seqs" in p.stdout
    assert p.stdout.startswith("usage: tbjax serve "), p.stdout[:200]     # the name it was run by


def test_help_names_the_program_as_it_was_run(capsys):
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert capsys.readouterr().out.startswith("usage: tbjax plan ")
    with pytest.raises(SystemExit):
        plan.main(["--help"])
    assert capsys.readouterr().out.startswith("usage: python -m tbjax.plan ")
