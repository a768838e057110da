"""The ``slurm_cluster`` fixture: one real two-node Slurm cluster (tests/cluster/harness.py) for the whole session.

It skips, with one line saying why, where the cluster cannot run (not root, no namespaces, a missing package:
``make cluster-packages``), except on CI (``CI=true``), where these tests must run and the same line fails them.
The state directory is ``$TXL_CLUSTER_STATE_DIR`` or /tmp/txl_cluster (fixed, so that a later session finds and
stops the daemons of a crashed one). A failing test that used the cluster gets the tails of its logs in its report.
"""

from __future__ import annotations

import os

import pytest

from tests.cluster.harness import DEFAULT_STATE_DIR, Cluster, ClusterUnavailable, check_machine


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Adds the tails of the cluster's logs to the report of a failing test that used the cluster."""
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("slurm_cluster")
    if report.failed and isinstance(cluster, Cluster):
        report.sections.append(("test cluster logs", cluster.dump_logs()))
