"""Runs the memory planner: ``python -m txl_dist.plan --help``."""

import sys

from txl_dist.exit_status import run_command
from txl_dist.plan.cli import main

if __name__ == "__main__":
    sys.exit(run_command(main, "python -m txl_dist.plan"))
