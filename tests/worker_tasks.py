"""Work for the tests of data_tools.workers, importable by spawned workers without the test modules' imports."""

import os
import time


def slow_pid(task: int) -> tuple[int, int]:
    """(task, the id of the process that ran it), after a pause long enough for tasks to queue up."""
    time.sleep(0.02)
    return task, os.getpid()
