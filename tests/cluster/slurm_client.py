"""The test cluster seen as its users see it: Slurm's commands against its controller, jobs and their ends.

``SlurmClient`` (a layer of ``Cluster``, tests/cluster/harness.py, above ``ClusterFiles``) runs scontrol, sbatch,
sinfo and squeue with the cluster's SLURM_CONF, reads ``scontrol show -o`` records, and waits for a job's state.
There is no accounting daemon: the end of every run of a job is kept in a jobcomp/filetxt log (``job_history``), so
finished jobs stay visible after slurmctld forgets them (MinJobAge=60). It also changes what the controller does
with nodes: resumes a drained or down node, and lets a test run under a longer SlurmdTimeout.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence

from tests.cluster.cluster_files import ClusterFiles
from tests.cluster.host import ClusterError, run_command, wait_until

# Job states after which a job does not run again by itself (a requeued job goes PENDING, not one of these).
FINISHED_STATES = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "TIMEOUT",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "BOOT_FAIL",
        "DEADLINE",
        "PREEMPTED",
        "SPECIAL_EXIT",
        "REVOKED",
    }
)


def parse_scontrol(line: str) -> dict[str, str]:
    """A one-line ``scontrol show -o`` (or jobcomp/filetxt) record as a dict; values may contain spaces."""
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    record = {}
    for index, match in enumerate(matches):
        end = matches[index + 1].start() if index + 1 < len(matches) else len(line)
        record[match.group(1)] = line[match.end() : end].strip()
    return record


class SlurmClient(ClusterFiles):
    """Slurm's commands against the cluster's controller (module docstring)."""

    def scontrol(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Runs ``scontrol ARGS`` against this cluster."""
        return run_command(["scontrol", *args], check=check, timeout=timeout, env=self.env())

    def sbatch(
        self,
        args: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None,
        timeout: float = 30.0,
    ) -> int:
        """Submits a batch job from the root namespace (``sbatch --parsable ARGS``) and returns its job id."""
        command = ["sbatch", "--parsable", *args]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, env=self.env(env), cwd=cwd, timeout=timeout
            )
        except subprocess.TimeoutExpired as error:
            raise ClusterError(
                f"{shlex.join(command)} did not answer within {timeout:.0f} s; log: {self.log_dir / 'slurmctld.log'}"
            ) from error
        if result.returncode != 0:
            raise ClusterError(f"sbatch refused the job: {result.stderr.strip()}")
        return int(result.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str] | None:
        """``scontrol show job JOB_ID`` as a dict, or None when the controller no longer knows the job."""
        result = self.scontrol("show", "job", "-o", str(job_id), check=False)
        if result.returncode != 0:
            if "Invalid job id" in result.stderr:
                return None
            raise ClusterError(f"scontrol show job {job_id} failed: {result.stderr.strip()}")
        return parse_scontrol(result.stdout.splitlines()[0])

    def job_history(self, job_id: int) -> list[dict[str, str]]:
        """Every end of a run of JOB_ID recorded by jobcomp/filetxt, oldest first, as dicts (JobState, ExitCode, ...).

        A requeued job has one record per run: JobState=PENDING for a run ended by ``scontrol requeue``,
        NODE_FAIL for one ended by a lost node, then the final state of the last run.
        """
        try:
            lines = self.jobcomp_log.read_text().splitlines()
        except OSError:
            return []
        records = [parse_scontrol(line) for line in lines]
        return [record for record in records if record.get("JobId") == str(job_id)]

    def job_state(self, job_id: int) -> str:
        """The job's state (RUNNING, PENDING, COMPLETED, ...; a requeued job is PENDING until it runs again).

        Read from ``scontrol show job``; once the controller has purged the finished job (MinJobAge), from its
        last jobcomp record. 'UNKNOWN' when neither knows the job.
        """
        info = self.job_info(job_id)
        if info is not None:
            return info.get("JobState", "UNKNOWN")
        history = self.job_history(job_id)
        return history[-1].get("JobState", "UNKNOWN") if history else "UNKNOWN"

    def wait_job(self, job_id: int, states: Iterable[str] = FINISHED_STATES, timeout: float = 120.0) -> str:
        """Waits until the job is in one of STATES (default: any finished state) and returns that state.

        Raises TimeoutError naming the job, its last state and reason, and the controller's log. A query that the
        controller does not answer in time (a loaded machine starves it: "build_job_queue has run for 2000000
        usec" in its log) is asked again until TIMEOUT.
        """
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        state = "(no answer from slurmctld)"
        while True:
            try:
                state = self.job_state(job_id)
            except ClusterError:
                if time.monotonic() > deadline:
                    raise
            if state in wanted:
                return state
            if time.monotonic() > deadline:
                info = self.job_info(job_id) or {}
                raise TimeoutError(
                    f"job {job_id} not in {sorted(wanted)} after {timeout:.0f} s: state {state}, "
                    f"reason {info.get('Reason', '?')}; log: {self.log_dir / 'slurmctld.log'}"
                )
            time.sleep(0.5)

    def node_info(self, node: str) -> dict[str, str]:
        """``scontrol show node NODE`` as a dict (State, Reason, SlurmdStartTime, ...)."""
        return parse_scontrol(self.scontrol("show", "node", "-o", node).stdout)

    @staticmethod
    def _unusable(state: str) -> bool:
        """Whether a node state (``scontrol show node``'s State=) keeps jobs off the node."""
        return bool(re.search(r"DOWN|DRAIN|FAIL|NOT_RESPONDING|UNKNOWN|FUTURE|\*", state))

    def resume_node(self, node: str, timeout: float = 30.0) -> None:
        """``scontrol update nodename=NODE state=resume`` and waits until the node is usable again.

        Usable: not DOWN, DRAIN(ED) or FAIL, and responding (slurmctld marks a resumed node NOT_RESPONDING until
        its slurmd answers the ping that follows).
        """
        self.scontrol("update", f"nodename={node}", "state=resume", check=False)
        wait_until(
            f"resume of {node}",
            lambda: not self._unusable(self.node_info(node).get("State", "*")),
            self.log_dir / "slurmctld.log",
            timeout,
        )

    @contextlib.contextmanager
    def slurmd_timeout(self, seconds: int):
        """Within the block, slurmctld marks a silent node DOWN only after SECONDS (``SlurmdTimeout``; Slurm's
        default is 300, the cluster's own 20 keeps the other tests quick): slurm.conf rewritten and ``scontrol
        reconfigure``d, and put back after the block."""
        self.slurm_conf.write_text(self._slurm_conf(slurmd_timeout=seconds))
        self.scontrol("reconfigure")
        try:
            yield
        finally:
            self.slurm_conf.write_text(self._slurm_conf())
            self.scontrol("reconfigure", check=False)

    def status(self) -> str:
        """A short, human-readable state of the cluster: sinfo and squeue."""
        sinfo = run_command(["sinfo", "-N", "-o", "%N %T %c %m %E"], check=False, env=self.env())
        squeue = run_command(["squeue", "-o", "%i %j %T %R"], check=False, env=self.env())
        return f"{sinfo.stdout}{sinfo.stderr}{squeue.stdout}{squeue.stderr}"
