"""Runs the memory planner: ``python -m txl_dist.plan --help``."""

import sys

from txl_dist.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
