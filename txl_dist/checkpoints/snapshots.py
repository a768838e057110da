"""In-memory snapshots (checkpoint.memory_every): the full training state of every rank, every K steps, in the
node's own memory and in the memory of the next node, so that a fault costs at most K steps of work.

**Taking one.** Every K steps each rank collects the files that a checkpoint of this step would hold for it
(DeepSpeed's through the recording engine in deferred mode, as a background save does; its rank state),
serialises them into bytes in memory, checks them with CRC-32, and writes them under
``{checkpoint.memory_dir}/txl_dist-{run id}/rank{r}/step{S}/`` (``/dev/shm`` by default: memory, not a disk),
with ``SNAPSHOT.json`` last: its manifest (the run, the step, the rank, the world, every file with its size and
CRC-32). Training waits for that copy in memory only. A thread then sends the same bytes to one rank of the next
node (a ring: node i's copy lives on node i+1, over a gloo group of its own), which writes them under the same
name in its node's memory. At most two snapshots per rank are kept, on each node; a clean end of the run removes
them (its last checkpoint is newer).

**Restoring.** At start, before the resume is chosen, the first rank of each node lists the snapshots of this run
(the run id in ``run_id`` of the run folder: another run's are never read) that its node's memory holds, own or
copy, and checks every file against its manifest. The newest step for which every rank of the snapshot's world is
present somewhere, and newer than the newest complete checkpoint on disk, is written into the checkpoints folder
by the ranks that hold its parts (each file from memory, checksummed as written) and marked complete; the resume
then takes it as any checkpoint: verified, loaded as saved, or re-dealt to another world size after a shrink.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import socket
import struct
import threading
import time
import uuid
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from txl_dist.checkpoint_paths import complete_tags, step_of_tag, tag_for_step
from txl_dist.checkpoints.background import FileJob
from txl_dist.checkpoints.verify import health_problem
from txl_dist.fileio import FileChecksum, atomic_write_checksummed, atomic_write_text, make_temporary_directory
from txl_dist.rendezvous.ranks import broadcast

log = logging.getLogger("txl_dist.training")

SNAPSHOT = "SNAPSHOT.json"
"""A snapshot's manifest, written last: a folder without one is not a snapshot."""
RUN_ID = "run_id"
"""The file in the run folder that names the run, for the snapshots it owns."""
KEEP = 2
"""Snapshots kept per rank on each node: the newest, and the one before while the newest is being written."""
_STEP_RE = re.compile(r"step(\d{8})")
_RANK_RE = re.compile(r"rank(\d{5})")


def run_id(output_dir: Path, rank: int) -> str:
    """Collective: the run's id, made by rank 0 at the run's first start and kept in the run folder."""
    path = Path(output_dir) / RUN_ID
    identity = None
    if rank == 0:
        try:
            identity = path.read_text().strip()
        except FileNotFoundError:
            identity = ""
        if not re.fullmatch(r"[0-9a-f]{32}", identity):
            identity = uuid.uuid4().hex
            atomic_write_text(path, identity + "\n")
    return broadcast(identity)


def crc32(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data):08x}"


def serialise(job: FileJob) -> bytes:
    """The bytes a job writes, in memory."""
    buffer = io.BytesIO()
    job.write(buffer)
    return buffer.getvalue()


def pack(manifest: dict[str, Any], files: dict[str, bytes]) -> bytes:
    """A snapshot as one buffer for the ring: the manifest's length, the manifest, the files in its order."""
    header = json.dumps(manifest).encode("utf-8")
    return struct.pack("<Q", len(header)) + header + b"".join(files[name] for name in manifest["files"])


def unpack(payload: memoryview) -> tuple[dict[str, Any], dict[str, bytes]]:
    (length,) = struct.unpack("<Q", payload[:8])
    manifest = json.loads(bytes(payload[8 : 8 + length]).decode("utf-8"))
    files, offset = {}, 8 + length
    for name, checksum in manifest["files"].items():
        files[name] = bytes(payload[offset : offset + checksum["bytes"]])
        offset += checksum["bytes"]
    return manifest, files


def write_snapshot(folder: Path, manifest: dict[str, Any], files: dict[str, bytes]) -> None:
    """FILES and the manifest into FOLDER (staged beside it and renamed when whole); files that do not match the
    manifest's checksums are refused (ValueError)."""
    for name, data in files.items():
        expected = manifest["files"][name]
        if len(data) != expected["bytes"] or crc32(data) != expected["crc32"]:
            raise ValueError(f"snapshot file {name} of rank {manifest['rank']} does not match its checksum")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = make_temporary_directory(folder.parent, f".{folder.name}.")
    try:
        for name, data in files.items():
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        (staging / SNAPSHOT).write_text(json.dumps(manifest, indent=1) + "\n")
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def prune(rank_dir: Path, keep: int = KEEP) -> None:
    """All but the newest KEEP snapshots of one rank, and any staging folder left by a stopped write."""
    if not rank_dir.is_dir():
        return
    steps = sorted(path for path in rank_dir.iterdir() if _STEP_RE.fullmatch(path.name))
    for path in steps[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for path in rank_dir.iterdir():
        if path.name.startswith("."):
            shutil.rmtree(path, ignore_errors=True)


def verified_snapshots(root: Path, identity: str) -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, step) -> manifest of every snapshot under ROOT whose manifest names this run and whose files all
    match it; the others are named in a warning and skipped."""
    found: dict[tuple[int, int], dict[str, Any]] = {}
    for manifest_path in sorted(root.glob(f"rank*/step*/{SNAPSHOT}")):
        folder = manifest_path.parent
        try:
            manifest = json.loads(manifest_path.read_text())
            if manifest.get("run_id") != identity:
                raise ValueError("it belongs to another run")
            for name, expected in manifest["files"].items():
                data = (folder / name).read_bytes()
                if len(data) != expected["bytes"] or crc32(data) != expected["crc32"]:
                    raise ValueError(f"{name} does not match its checksum")
            key = (int(manifest["rank"]), int(manifest["step"]))
            if f"rank{key[0]:05d}" != folder.parent.name or tag_for_step(key[1]) != folder.name:
                raise ValueError("its manifest names another rank or step")
            sick = health_problem(manifest)
            if sick is not None:
                raise ValueError(f"its state is sick: {sick}")
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("memory snapshot %s skipped: %s", folder, error)
            continue
        found[key] = manifest
    return found


@dataclass
class Ring:
    """Where this rank's snapshot copy goes and whose copies it receives: one rank of the next node, in the order
    of the nodes by their first rank (none with a single node)."""

    partner: int | None
    senders: list[int]

    @classmethod
    def of(cls, hosts: list[str], rank: int) -> Ring:
        nodes = list(dict.fromkeys(hosts))
        if len(nodes) < 2:
            return cls(None, [])
        ranks_of = {node: [r for r, host in enumerate(hosts) if host == node] for node in nodes}

        def partner_of(r: int) -> int:
            node = hosts[r]
            following = ranks_of[nodes[(nodes.index(node) + 1) % len(nodes)]]
            return following[ranks_of[node].index(r) % len(following)]

        return cls(partner_of(rank), [r for r in range(len(hosts)) if partner_of(r) == rank])


class Snapshots:
    """The in-memory snapshots of one rank of a run (module docstring). Collective where a method says so."""

    def __init__(self, memory_dir: str | os.PathLike, identity: str, output_dir: Path, rank: int, world_size: int):
        self.root = Path(memory_dir) / f"txl_dist-{identity}"
        self.identity, self.output_dir = identity, str(Path(output_dir).resolve())
        self.rank, self.world_size = rank, world_size
        hosts: list[str] = [""] * world_size
        dist.all_gather_object(hosts, socket.gethostname())
        self.hosts = hosts
        self.ring = Ring.of(hosts, rank)
        self._group = dist.new_group(backend="gloo") if self.ring.partner is not None else None
        self._thread: threading.Thread | None = None
        self.last_copy_error: BaseException | None = None

    @property
    def rank_dir(self) -> Path:
        return self.root / f"rank{self.rank:05d}"

    # ---- taking --------------------------------------------------------------------------------------------

    def take(self, jobs: list[FileJob], tag_dir: Path, meta: dict[str, Any]) -> float:
        """This rank's snapshot of step ``meta["step"]``: JOBS (the files a checkpoint in TAG_DIR would hold for
        it) into memory and the node's memory folder; the copy to the next node goes on in a thread. Returns the
        seconds training waited."""
        began = time.perf_counter()
        self.wait_for_copy()
        files: dict[str, bytes] = {}
        for job in jobs:
            name = Path(job.path).relative_to(tag_dir).as_posix()
            files[name] = serialise(job)
        manifest = {
            **meta,
            "run_id": self.identity,
            "output_dir": self.output_dir,
            "rank": self.rank,
            "world_size": self.world_size,
            "host": socket.gethostname(),
            "files": {name: {"bytes": len(data), "crc32": crc32(data)} for name, data in files.items()},
        }
        write_snapshot(self.rank_dir / tag_for_step(meta["step"]), manifest, files)
        prune(self.rank_dir)
        if self.ring.partner is not None:
            payload = pack(manifest, files)
            self._thread = threading.Thread(target=self._copy, args=(payload,), name="txl_dist-snapshot-ring")
            self._thread.daemon = True
            self._thread.start()
        return time.perf_counter() - began

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
                if manifest.get("run_id") != self.identity or manifest.get("rank") != sender:
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

    def remove(self) -> None:
        """Collective, at the clean end of the run: the snapshots of this run in every node's memory (its last
        checkpoint is newer)."""
        self.wait_for_copy()
        scratch = self.root / f".deepspeed-rank{self.rank:05d}"
        for folder in [self.rank_dir, scratch] + [self.root / f"rank{sender:05d}" for sender in self.ring.senders]:
            shutil.rmtree(folder, ignore_errors=True)
        dist.barrier()
        if self.hosts.index(self.hosts[self.rank]) == self.rank:  # the node's first rank
            try:
                self.root.rmdir()
            except OSError:
                log.warning("%s is not empty after the run's snapshots were removed: left as it is", self.root)

    def restore(self, checkpoints_dir: Path, mark_complete) -> int | None:
        """Collective, before the resume is planned: the newest snapshot of this run that every rank of its world
        left somewhere in the nodes' memory, newer than the newest complete checkpoint, written into CHECKPOINTS_DIR
        as a checkpoint and marked complete (MARK_COMPLETE(tag_dir, files, manifest): rank 0); its step, or None."""
        root, identity, hosts = self.root, self.identity, self.hosts
        rank, world_size = self.rank, self.world_size
        lister = hosts.index(hosts[rank]) == rank
        offers = verified_snapshots(root, identity) if lister and root.is_dir() else {}
        gathered: list[dict] = [{} for _ in range(world_size)]
        dist.all_gather_object(gathered, offers)
        tags = complete_tags(checkpoints_dir)
        on_disk = step_of_tag(tags[-1]) if tags else -1
        holders: dict[tuple[int, int], int] = {}
        manifests: dict[tuple[int, int], dict] = {}
        for holder, offered in enumerate(gathered):
            for key, manifest in offered.items():
                holders.setdefault(key, holder)
                manifests.setdefault(key, manifest)
        chosen = None
        for step in sorted({step for _, step in manifests}, reverse=True):
            if step <= on_disk:
                break
            worlds = {manifests[key]["world_size"] for key in manifests if key[1] == step}
            if len(worlds) == 1 and all((r, step) in manifests for r in range(next(iter(worlds)))):
                chosen = step
                break
        if chosen is None:
            if rank == 0 and manifests:
                newest = max(step for _, step in manifests)
                why = "not newer than the newest checkpoint" if newest <= on_disk else "not every rank's part is left"
                log.info("memory snapshots of this run up to step %d found, none usable (%s)", newest, why)
            return None
        tag_dir = checkpoints_dir / tag_for_step(chosen)
        mine = {}
        snapshot_world = manifests[(0, chosen)]["world_size"]
        if rank == 0:
            tag_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        for origin in range(snapshot_world):
            if holders[(origin, chosen)] != rank:
                continue
            folder = root / f"rank{origin:05d}" / tag_for_step(chosen)
            for name in manifests[(origin, chosen)]["files"]:
                target = tag_dir / name
                target.parent.mkdir(parents=True, exist_ok=True)
                data = (folder / name).read_bytes()
                mine[name] = atomic_write_checksummed(target, lambda handle, data=data: handle.write(data))
        gathered_files: list[dict[str, FileChecksum]] | None = [{} for _ in range(world_size)] if rank == 0 else None
        dist.gather_object(mine, gathered_files, dst=0)
        if rank == 0:
            files: dict[str, FileChecksum] = {}
            for rank_files in gathered_files:
                files.update(rank_files)
            expected = {name for key, manifest in manifests.items() if key[1] == chosen for name in manifest["files"]}
            if set(files) != expected:
                raise RuntimeError(f"{tag_dir}: the memory snapshot's files were not all written back")
            mark_complete(tag_dir, files, manifests[(0, chosen)])
            sources = sorted({hosts[holders[(origin, chosen)]] for origin in range(snapshot_world)})
            log.info(
                "restored step %d from the memory snapshots of %d rank(s) (held on %s) into %s; the newest checkpoint "
                "on disk was %s",
                chosen,
                snapshot_world,
                ", ".join(sources),
                tag_dir,
                f"step {on_disk}" if on_disk >= 0 else "none",
            )
        dist.barrier()
        return chosen
