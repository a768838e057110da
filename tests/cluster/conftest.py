"""The ``slurm_cluster`` fixture: one real two-node Slurm cluster (tests/cluster/harness.py) for the whole session;
``shared`` (a folder the nodes share, with the PTB shards) and ``reference_run`` (the uninterrupted 2-rank run that
every launch path is held to, made once per session: tests/cluster/runs.py).

It skips, with one line saying why, where the cluster cannot run (not root, no namespaces, a missing package:
``make cluster-packages``), except on CI (``CI=true``), where these tests must run and the same line fails them.
The state directory is ``$TXL_CLUSTER_STATE_DIR`` or /tmp/txl_cluster (fixed, so that a later session finds and
stops the daemons of a crashed one). A failing test that used the cluster gets the tails of its logs in its report.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import pytest

from tests.cluster.harness import DEFAULT_STATE_DIR, Cluster
from tests.cluster.host import ClusterUnavailable, check_machine
from tests.cluster.runs import REFERENCE_STEPS, losses, train_args
from tests.launcher import run, torchrun_command


def _unavailable(reason: str) -> None:
    """Skips (fails on CI) the tests that need the cluster, with REASON as the one line."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"test cluster unavailable on CI (CI=true): {reason}", pytrace=False)
    pytest.skip(f"test cluster unavailable: {reason}")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running cluster (``harness.Cluster``), torn down at the end of the session."""
    reason = None
    try:
        check_machine()
        cluster = Cluster.start(os.environ.get("TXL_CLUSTER_STATE_DIR", str(DEFAULT_STATE_DIR)))
    except ClusterUnavailable as error:
        reason = str(error)  # skipped (or failed) outside the handler: one line, no chained traceback
    if reason is not None:
        _unavailable(reason)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def shared(slurm_cluster, ptb_word_shards) -> Path:
    """A folder on the filesystem the nodes share, with the PTB shards in it."""
    directory = slurm_cluster.shared_dir / f"launch-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    shutil.copytree(ptb_word_shards, directory / "shards")
    return directory


@pytest.fixture(scope="session")
def reference_run(shared) -> Path:
    """The uninterrupted run on one host: 2 ranks under torchrun (its output directory)."""
    output = shared / "reference"
    run(torchrun_command("launchers/train.py", train_args(shared / "shards", output, REFERENCE_STEPS)), timeout=400)
    return output


@pytest.fixture(scope="session")
def reference(reference_run) -> dict[int, float]:
    """Per-step losses of the uninterrupted run."""
    return losses(reference_run)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds the tails of the cluster's logs to the report of a failing test that used the cluster."""
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("slurm_cluster")
    if report.failed and isinstance(cluster, Cluster):
        report.sections.append(("test cluster logs", cluster.dump_logs()))
