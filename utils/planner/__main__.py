"""python -m utils.planner: the command line (utils/planner/cli.py)."""

import sys

from utils.planner.cli import main

sys.exit(main())
