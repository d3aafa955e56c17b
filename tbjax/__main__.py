"""`python -m tbjax COMMAND`: the `tbjax` console command (tbjax/cli.py)."""
import sys

from tbjax.cli import main

sys.exit(main())
