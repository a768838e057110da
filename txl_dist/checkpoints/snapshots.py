"""In-memory snapshots (checkpoint.memory_every): the full training state of every rank, every K steps, in the
node's own memory and in the memory of the next node, so that a fault costs at most K steps of work.

**Taking one.** Every K steps each rank collects the files that a checkpoint of this step would hold for it
(DeepSpeed's through the recording engine in deferred mode, as a background save does; its rank state),
serialises them into bytes in memory, checks them with CRC-32, and writes them under
``{checkpoint.memory_dir}/txl_dist-{run id}/rank{r}/step{S}/`` (``/dev/shm`` by default: memory, not a disk),
with ``SNAPSHOT.json`` last: its manifest (the run, its folder, the step, the rank, the world, every file with its
size and CRC-32). Training waits for that copy in memory only. A thread then sends the same bytes to one rank of the
next node (a ring: node i's copy lives on node i+1, over a gloo group of its own), which writes them under the same
name in its node's memory. At most two snapshots per rank are kept, on each node; a clean end of the run removes
them (its last checkpoint is newer). A snapshot that cannot be taken (a full, read-only or blocked memory folder)
costs only its own protection: one warning naming the folder and the cause, and training goes on.

**Restoring.** At start (and at a numerical fault's rollback), the first rank of each node lists the snapshots of
this run (`txl_dist.checkpoints.snapshot_files`: the run id and the run folder must be this run's; the manifest, the
names and the files are checked before anything is trusted) that its node's memory holds, own or copy. The newest
step for which every rank of the snapshot's world is present somewhere, newer than the newest checkpoint that
verifies, is written by the ranks that hold its parts into a staging folder beside the checkpoints, renamed into
place once whole and marked complete; the resume then takes it as any checkpoint. A restore that fails leaves
nothing in the checkpoints folder. Then every snapshot of this run left in the nodes' memory is freed: the resume
reads none of them again, and the run takes its own from here (`free`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from txl_dist.checkpoint_paths import step_of_tag, tag_for_step
from txl_dist.checkpoints.background import FileJob
from txl_dist.checkpoints.manager import CheckpointManager
from txl_dist.checkpoints.record import CheckpointRecord
from txl_dist.checkpoints.snapshot_files import (
    MEMORY_FILESYSTEMS,
    ROOT_PREFIX,
    RUN_ID,
    Ring,
    crc32,
    filesystem_of,
    pack,
    prune,
    read_inside,
    read_run_id,
    run_id_record,
    serialise,
    snapshot_folders,
    snapshot_ids_of,
    unpack,
    verified_snapshots,
    write_snapshot,
)
from txl_dist.fileio import (
    FileChecksum,
    atomic_write_checksummed,
    atomic_write_text,
    describe_os_error,
    make_temporary_directory,
)
from txl_dist.rendezvous.ranks import broadcast

log = logging.getLogger("txl_dist.training")


def run_id(output_dir: Path, rank: int, memory_dir: str | os.PathLike) -> str:
    """Collective: the run's id, kept in the run folder's ``run_id`` with the folder it was made for. Rank 0 makes
    one at the run's first start, and a new one for a folder copied or moved from another (whose snapshots stay
    that run's); a file that cannot be read is said in one line, and the snapshots in ``memory_dir`` that name this
    run folder are adopted (their id kept), or a new id is made when there are none."""
    identity = None
    if rank == 0:
        folder = str(Path(output_dir).resolve())
        path = Path(output_dir) / RUN_ID
        identity, why = read_run_id(path, folder)
        if why == "copied":
            log.info("%s was made for another run folder (this one is a copy or a move of it): a new run id", path)
        elif why not in ("", "missing"):  # unreadable: adopt this folder's snapshots rather than orphan them
            adopted = snapshot_ids_of(Path(memory_dir), folder)
            identity = adopted[0] if adopted else None
            found = f"written anew with the id of this run folder's memory snapshots in {memory_dir}"
            log.warning(
                "%s cannot be read (%s): %s",
                path,
                why,
                found if adopted else f"no memory snapshot of this run folder is in {memory_dir}: a new run id",
            )
        identity = identity or uuid.uuid4().hex
        record = run_id_record(identity, folder)
        try:
            current = path.read_text(encoding="utf-8")
        except (FileNotFoundError, UnicodeDecodeError):
            current = None
        if current != record:
            atomic_write_text(path, record)
    return broadcast(identity)


class Snapshots:
    """The in-memory snapshots of one rank of a run (module docstring). Collective where a method says so.
    ``taking``: checkpoint.memory_every is set (False: the run only restores nothing and frees what an earlier
    start left)."""

    def __init__(
        self,
        memory_dir: str | os.PathLike,
        identity: str,
        output_dir: Path,
        rank: int,
        world_size: int,
        hosts: list[str],
        taking: bool = True,
    ):
        self.memory_dir = Path(memory_dir)
        self.root = self.memory_dir / f"{ROOT_PREFIX}{identity}"
        self.identity, self.output_dir = identity, str(Path(output_dir).resolve())
        self.rank, self.world_size, self.hosts = rank, world_size, hosts
        self.lister = hosts.index(hosts[rank]) == rank
        """This rank is its node's first: it lists, frees and removes the node's snapshots of the run."""
        usable = taking and self._usable_root()
        verdicts: list[bool] = [False] * world_size
        dist.all_gather_object(verdicts, usable)  # snapshots are collective: on for every rank, or for none
        self.taking = taking and all(verdicts)
        if taking and not self.taking and usable and rank == 0:
            unusable = [r for r, verdict in enumerate(verdicts) if not verdict]
            log.warning("no memory snapshots in this start: rank(s) %s cannot take them (see above)", unusable)
        self.ring = Ring.of(hosts, rank) if self.taking else Ring(None, [])
        self._group = dist.new_group(backend="gloo") if self.ring.partner is not None else None
        self._thread: threading.Thread | None = None
        self.last_copy_error: BaseException | None = None
        self._failing = False
        """The last snapshot could not be written (said once, until one is written again)."""

    @property
    def rank_dir(self) -> Path:
        return self.root / f"rank{self.rank:05d}"

    def _usable_root(self) -> bool:
        """Whether this node's memory folder of the run can take snapshots: made if missing (mode 0700), no
        symbolic link, this account's. A warning names the folder otherwise, and the run trains without
        snapshots; one that is no memory file system is said once (its snapshots go to a disk)."""
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            status = os.lstat(self.root)
            if os.path.islink(self.root) or not os.path.isdir(self.root):
                raise OSError(f"{self.root}: a symbolic link or no folder")
            if status.st_uid != os.geteuid():
                raise OSError(f"{self.root}: owned by another account (uid {status.st_uid})")
        except OSError as error:
            where = describe_os_error(error, self.root) if error.errno is not None else str(error)
            log.warning("rank %d: no memory snapshots in this start (%s); checkpoints are unaffected", self.rank, where)
            return False
        kind = filesystem_of(self.memory_dir)
        if self.lister and kind is not None and kind not in MEMORY_FILESYSTEMS:
            log.warning(
                "checkpoint.memory_dir=%s is on a %s file system, not in memory: each snapshot is a write to it "
                "(a node-local tmpfs such as /dev/shm keeps them in memory)",
                self.memory_dir,
                kind,
            )
        return True

    # ---- taking --------------------------------------------------------------------------------------------

    def scratch(self) -> Path:
        """A folder local to this process for what DeepSpeed writes around a snapshot's files (empty folders, its
        recovery script): not in the memory folder, so that a full one fails only the snapshot's own write."""
        return Path(tempfile.gettempdir()) / f"txl_dist-{self.identity}-rank{self.rank:05d}"

    def take(self, jobs: list[FileJob], tag_dir: Path, record: CheckpointRecord) -> float | None:
        """This rank's snapshot of the state ``record`` describes: JOBS (the files a checkpoint in TAG_DIR would
        hold for it) into memory and the node's memory folder; the copy to the next node goes on in a thread.
        Returns the seconds training waited, or None when the snapshot could not be written (said once, with the
        folder and the cause: training goes on, the checkpoints as they were)."""
        began = time.perf_counter()
        self.wait_for_copy()
        files: dict[str, bytes] = {}
        for job in jobs:
            name = Path(job.path).relative_to(tag_dir).as_posix()
            files[name] = serialise(job)
        shutil.rmtree(self.scratch(), ignore_errors=True)
        manifest = {
            **record.fields(),
            "run_id": self.identity,
            "output_dir": self.output_dir,
            "rank": self.rank,
            "host": self.hosts[self.rank],
            "files": {name: {"bytes": len(data), "crc32": crc32(data)} for name, data in files.items()},
        }
        folder = self.rank_dir / tag_for_step(record.step)
        written = True
        try:
            write_snapshot(folder, manifest, files)
            prune(self.rank_dir)
        except OSError as error:
            written = False
            if not self._failing:
                log.warning(
                    "rank %d: the memory snapshot of step %d is not taken in this node's memory (%s); training "
                    "goes on without it, and until one is taken again a fault goes back to the newest checkpoint "
                    "or the copy on the next node",
                    self.rank,
                    record.step,
                    describe_os_error(error, folder),
                )
            self._failing = True
        if written and self._failing:
            log.warning("rank %d: memory snapshots are taken again (step %d)", self.rank, record.step)
            self._failing = False
        if self.ring.partner is not None:  # the exchange is the ring's, every rank's alike: it happens either way
            payload = pack(manifest, files)
            self._thread = threading.Thread(target=self._copy, args=(payload,), name="txl_dist-snapshot-ring")
            self._thread.daemon = True
            self._thread.start()
        return time.perf_counter() - began if written else None

    def _copy(self, payload: bytes) -> None:
        """Thread: send this rank's snapshot to its partner, receive the senders' and keep them."""
        try:
            size = torch.tensor([len(payload)], dtype=torch.int64)
            requests = [dist.isend(size, self.ring.partner, group=self._group)]
            sizes = {sender: torch.zeros(1, dtype=torch.int64) for sender in self.ring.senders}
            requests += [dist.irecv(sizes[sender], sender, group=self._group) for sender in self.ring.senders]
            for request in requests:
                request.wait()
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            requests = [dist.isend(data, self.ring.partner, group=self._group)]
            received = {sender: torch.empty(int(sizes[sender].item()), dtype=torch.uint8) for sender in sizes}
            requests += [dist.irecv(received[sender], sender, group=self._group) for sender in self.ring.senders]
            for request in requests:
                request.wait()
            for sender, tensor in received.items():
                manifest, files = unpack(memoryview(tensor.numpy()))
                if manifest["run_id"] != self.identity or manifest["rank"] != sender:
                    raise ValueError(f"the snapshot received from rank {sender} is not that rank's of this run")
                rank_dir = self.root / f"rank{sender:05d}"
                write_snapshot(rank_dir / tag_for_step(manifest["step"]), manifest, files)
                prune(rank_dir)
        except BaseException as error:  # noqa: BLE001 -- a lost copy costs only the protection it gave
            self.last_copy_error = error
            log.warning("rank %d: the copy of the memory snapshot to the next node failed: %s", self.rank, error)

    def wait_for_copy(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # ---- freeing -------------------------------------------------------------------------------------------

    def free(self, why: str) -> None:
        """Collective: every snapshot of this run in the nodes' memory removed (each node's first rank its node's),
        and the log names what went: ``why`` says why no rank reads them."""
        self.wait_for_copy()
        removed: list[str] = []
        if self.lister and self.root.is_dir() and not self.root.is_symlink():
            removed = [f"{folder.parent.name}/{folder.name}" for folder in snapshot_folders(self.root)]
            for path in self.root.iterdir():
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
        if removed:
            log.warning(
                "rank %d: removed the memory snapshots %s from %s on %s: %s",
                self.rank,
                ", ".join(removed),
                self.root,
                self.hosts[self.rank],
                why,
            )
        dist.barrier()

    def remove(self) -> None:
        """Collective, at the clean end of the run: the snapshots of this run in every node's memory (its last
        checkpoint is newer)."""
        self.wait_for_copy()
        shutil.rmtree(self.scratch(), ignore_errors=True)
        for folder in [self.rank_dir] + [self.root / f"rank{sender:05d}" for sender in self.ring.senders]:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        if self.lister:
            try:
                self.root.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                log.warning("%s is not empty after the run's snapshots were removed: left as it is", self.root)

    # ---- restoring -----------------------------------------------------------------------------------------

    def restore_into(self, checkpoints: CheckpointManager, verify: bool) -> int | None:
        """Collective: `restore` into ``checkpoints``'s folder of the newest snapshot newer than its newest good
        checkpoint (`CheckpointManager.newest_good_tag`), which then counts as verified (written back with the
        checksums of its bytes); its step, or None."""
        newest = checkpoints.newest_good_tag(verify)
        newer_than = -1 if newest is None else step_of_tag(newest)
        restored = self.restore(checkpoints.directory, checkpoints.mark_complete, newer_than)
        if restored is not None:
            checkpoints.newest_verified = tag_for_step(restored)
        return restored

    def restore(self, checkpoints_dir: Path, mark_complete, newer_than: int) -> int | None:
        """Collective: the newest snapshot of this run that every rank of its world left somewhere in the nodes'
        memory, newer than step ``newer_than`` (the newest checkpoint that verifies; -1 for none), written into
        CHECKPOINTS_DIR as a checkpoint and marked complete (rank 0: MARK_COMPLETE(tag_dir, files, record), the
        snapshot's `CheckpointRecord`); its step, or None."""
        offers = verified_snapshots(self.root, self.identity, self.output_dir) if self.lister else {}
        gathered: list[dict] = [{} for _ in range(self.world_size)]
        dist.all_gather_object(gathered, offers)
        holders: dict[tuple[int, int], int] = {}
        manifests: dict[tuple[int, int], dict] = {}
        for holder, offered in enumerate(gathered):
            for key, manifest in offered.items():
                holders.setdefault(key, holder)
                manifests.setdefault(key, manifest)
        chosen, why = self._choose(manifests, checkpoints_dir, newer_than)
        if chosen is None:
            if self.rank == 0 and manifests:
                newest = max(step for _, step in manifests)
                log.info("memory snapshots of this run up to step %d found, none usable (%s)", newest, why)
            return None
        world = manifests[(0, chosen)]["world_size"]
        parts = {origin: holders[(origin, chosen)] for origin in range(world)}
        if not self._write_back(chosen, parts, manifests, checkpoints_dir, mark_complete):
            return None
        if self.rank == 0:
            sources = sorted({self.hosts[holder] for holder in parts.values()})
            log.info(
                "restored step %d from the memory snapshots of %d rank(s) (held on %s) into %s; the newest checkpoint "
                "that verifies was %s",
                chosen,
                world,
                ", ".join(sources),
                checkpoints_dir / tag_for_step(chosen),
                f"step {newer_than}" if newer_than >= 0 else "none",
            )
        return chosen

    @staticmethod
    def _choose(manifests: dict, checkpoints_dir: Path, newer_than: int) -> tuple[int | None, str]:
        """The newest step whose every rank's part is there, with one world, ZeRO stage, architecture and streams
        across its manifests, and no folder of its tag in the checkpoints folder; or None and why not."""
        why = "not newer than the newest checkpoint that verifies"
        for step in sorted({step for _, step in manifests}, reverse=True):
            if step <= newer_than:
                break
            of_step = [manifest for (_, at), manifest in manifests.items() if at == step]
            facts = {
                (m["world_size"], m["zero_stage"], m["streams_per_rank"], repr(sorted(m["architecture"].items())))
                for m in of_step
            }
            if len(facts) != 1:
                why = f"the ranks' manifests of step {step} disagree on the world, stage or model"
                continue
            world = of_step[0]["world_size"]
            if not all((rank, step) in manifests for rank in range(world)):
                why = "not every rank's part is left"
                continue
            if (checkpoints_dir / tag_for_step(step)).exists():
                why = f"{checkpoints_dir / tag_for_step(step)} exists (a damaged checkpoint): not written over"
                continue
            return step, ""
        return None, why

    def _write_back(self, step: int, parts: dict[int, int], manifests: dict, checkpoints_dir: Path, mark) -> bool:
        """Collective: the snapshot of ``step`` (``parts``: origin rank -> the rank that holds its part) written
        into a staging folder beside the checkpoints by the ranks that hold it, renamed into place and marked
        complete once whole; False (a warning, the staging folder gone) when any rank could not."""
        tag_dir = checkpoints_dir / tag_for_step(step)
        made = str(make_temporary_directory(checkpoints_dir, f".{tag_dir.name}.")) if self.rank == 0 else None
        staging = Path(broadcast(made))
        mine: dict[str, FileChecksum] = {}
        problem = None
        try:
            for origin, holder in parts.items():
                if holder != self.rank:
                    continue
                folder = self.root / f"rank{origin:05d}" / tag_dir.name
                for name in manifests[(origin, step)]["files"]:
                    target = staging / name
                    target.parent.mkdir(parents=True, exist_ok=True)
                    data = read_inside(folder, name)
                    mine[name] = atomic_write_checksummed(target, lambda handle, data=data: handle.write(data))
        except OSError as error:
            problem = f"rank {self.rank}: {describe_os_error(error)}"
        gathered: list | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object((problem, mine), gathered, dst=0)
        done = False
        if self.rank == 0:
            files: dict[str, FileChecksum] = {}
            problems = [p for p, _ in gathered if p]
            for _, rank_files in gathered:
                files.update(rank_files)
            expected = {name for (_, at), m in manifests.items() if at == step for name in m["files"]}
            if not problems and set(files) != expected:
                problems.append("the snapshot's files were not all written back")
            if problems:
                log.warning("the memory snapshot of step %d is not restored: %s", step, "; ".join(problems))
            else:
                try:
                    os.replace(staging, tag_dir)
                    mark(tag_dir, files, CheckpointRecord.of(manifests[(0, step)]))
                    done = True
                except OSError as error:
                    log.warning("the memory snapshot of step %d is not restored: %s", step, describe_os_error(error))
                    shutil.rmtree(tag_dir, ignore_errors=True)
            shutil.rmtree(staging, ignore_errors=True)
        return bool(broadcast(done if self.rank == 0 else None))
