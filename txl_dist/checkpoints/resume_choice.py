"""Which checkpoint a start (or a numerical fault's rollback) takes, the ranks choosing together: the newest
complete one whose recorded state is not sick and whose files verify, the ranks sharing the reading
(`txl_dist.checkpoints.verify`), checked against the run's architecture, and how it loads into this run's ZeRO
stage and ranks (`txl_dist.checkpoints.universal.plan_load`). A part of
`txl_dist.checkpoints.manager.CheckpointManager`, whose state it reads and keeps: ``directory``, ``rank``,
``world_size``, and what it learns: ``damaged``, ``sick``, ``newest_verified``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from txl_dist.checkpoint_paths import COMPLETE, has_optimizer_partitions
from txl_dist.checkpoints.universal import ResumePlan, plan_load
from txl_dist.checkpoints.verify import (
    CheckpointVerificationError,
    check_files,
    check_listing,
    deal_files_to_ranks,
    health_problem,
    listed_files,
    read_marker,
    refuse_to_start,
    saved_zero_stages,
)
from txl_dist.rendezvous.ranks import broadcast

log = logging.getLogger("txl_dist.training")


class ResumeChoice:
    """The choice of the checkpoint to resume from (module docstring); mixed into the checkpoint manager."""

    def newest_good_tag(self, verify: bool) -> str | None:
        """Collective: the newest complete checkpoint that verifies and whose recorded state is not sick, chosen on
        rank 0 and known to every rank; None when there is none. The ranks share the reading of each candidate's
        files; checkpoints that fail are skipped with a warning naming every problem (once) and remembered in
        `damaged` and `sick`. With ``verify`` False the newest complete one that is not sick is taken as it is."""
        candidates = broadcast(self._candidates() if self.rank == 0 else None)
        self._complete_count = len(candidates)
        for tag, why in candidates:
            if why is not None and tag not in self.sick:
                self.sick.add(tag)
                if self.rank == 0:
                    log.warning("skipping checkpoint %s, whose recorded state is sick: %s", self.directory / tag, why)
        candidates = [tag for tag, why in candidates if why is None and tag not in self.damaged]
        if not verify:
            return candidates[0] if candidates else None
        for tag in candidates:
            if tag == self.newest_verified:  # written by this run, or verified since it started: no second read
                return tag
            problems = self._verify_collectively(tag)
            if not problems:
                self.newest_verified = tag
                return tag
            self.damaged.add(tag)
            if self.rank == 0:
                log.warning(
                    "skipping checkpoint %s, which fails verification: %s", self.directory / tag, "; ".join(problems)
                )
        return None

    def choose_resume_tag(self, verify: bool) -> str | None:
        """Collective: the checkpoint a resume takes, `newest_good_tag`; None when the folder holds no complete
        checkpoint. When it holds some but none is good, the run stops rather than start afresh beside them."""
        tag = self.newest_good_tag(verify)
        if tag is not None or not self._complete_count:
            if tag is not None and not verify and self.rank == 0:
                log.warning(
                    "checkpoint.verify=false: resuming from %s without checking its files against %s",
                    self.directory / tag,
                    COMPLETE,
                )
            return tag
        if self.sick and not self.damaged:
            raise CheckpointVerificationError(
                f"every complete checkpoint in {self.directory} was saved from a sick state (see the warnings above): "
                f"there is no healthy state to resume from; move them aside to start afresh"
            )
        raise CheckpointVerificationError(
            f"none of the {self._complete_count} complete checkpoints in {self.directory} verifies, nor has a "
            f"healthy state (see the warnings above): move them aside to start afresh, or resume with "
            f"checkpoint.verify=false to trust one"
        )

    def _candidates(self) -> list[tuple[str, str | None]]:
        """Rank 0: the complete checkpoints, newest first, each with why its recorded state is sick (or None). A
        marker that cannot be read is the verification's to name."""
        candidates = []
        for tag in self.complete_tags()[::-1]:
            try:
                why = health_problem(read_marker(self.directory / tag))
            except CheckpointVerificationError:
                why = None
            candidates.append((tag, why))
        return candidates

    def plan_resume(
        self, *, resume: bool, verify: bool, architecture: dict[str, Any], zero_stage: int
    ) -> ResumePlan | None:
        """Collective: the checkpoint to resume from (`choose_resume_tag`), checked against this run's
        ``architecture``, and how it loads into ZeRO ``zero_stage`` on this run's ranks (`plan_load`), decided
        before anything is built. With ``resume`` False: None, or ValueError where there are checkpoints (a fresh
        start would interleave its checkpoints with the old run's)."""
        if not resume:
            refuse_to_start(self.directory, resume=False, complete=self.complete_tags())
            return None
        tag = self.choose_resume_tag(verify=verify)
        if tag is None:
            return None
        marker = self.marker(tag)
        refuse_to_start(self.directory, resume=True, tag=tag, marker=marker, architecture=architecture)
        saved_stages = saved_zero_stages(self.directory / tag, marker)
        kind = plan_load(
            saved_stages,
            marker["world_size"],
            has_optimizer_partitions(self.directory / tag),
            zero_stage,
            self.world_size,
        )
        return ResumePlan(tag, kind, saved_stages, marker["world_size"], zero_stage, self.world_size)

    def _verify_collectively(self, tag: str) -> list[str]:
        tag_dir = self.directory / tag
        if self.rank == 0:
            try:
                marker = read_marker(tag_dir)
                expected = listed_files(tag_dir, marker)
                failure_or_reading = (None, deal_files_to_ranks(expected, self.world_size))
                problems = check_listing(tag_dir, marker, expected)
            except CheckpointVerificationError as error:
                failure_or_reading, problems = (str(error), None), []
        else:
            failure_or_reading, problems = None, []
        failure, files_per_rank = broadcast(failure_or_reading)
        if failure is not None:
            return [failure]
        problems += check_files(tag_dir, files_per_rank[self.rank])
        gathered: list[list[str]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(gathered, problems)
        return [problem for rank_problems in gathered for problem in rank_problems]
