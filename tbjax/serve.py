"""`python -m tbjax.serve`: the command that serves a model over gRPC. Only an entry point: the server is
`serving` (the layer above tbjax), see `serving/cli.py` for the options (`python -m tbjax.serve --help`)."""
import sys


def main(argv=None) -> int:
    from serving.cli import main as serving_main
    return serving_main(argv)


if __name__ == "__main__":
    sys.exit(main())
