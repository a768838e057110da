"""A memory snapshot's folder in a node's memory, and what may be trusted of it: its manifest, its file names, the
run it belongs to. Nothing here needs a process group; `txl_dist.checkpoints.snapshots` takes, copies and restores
them.

A snapshot lies in ``{checkpoint.memory_dir}/txl_dist-{run id}/rank{r}/step{S}/`` with ``SNAPSHOT.json`` written
last (`write_snapshot`). ``/dev/shm`` is writable by every user of a node and the run id is readable in the run
folder, so nothing in a snapshot's folder is trusted before it is checked (`read_snapshot`):

- the manifest, against its whole schema (`MANIFEST_FIELDS`): a manifest that is not a JSON object, lacks a field
  or gives one of another type or range is one warning naming the folder and the field, and the snapshot is
  skipped;
- every file name (`name_problem`): relative, without '.' or '..' parts, with no back slash or NUL, so that a
  restore writes only inside its checkpoint folder; and every file is read without following a symbolic link
  (`read_inside`), in a folder that is no symbolic link either;
- the run: the manifest's run id and run folder must be this run's, so that a copy of a run folder is a run of its
  own and never takes (or frees) the original's snapshots.

The run's id (`read_run_id`, `RUN_ID` in the run folder) records the folder it was made for: a folder copied or
moved gets a new id. A ``run_id`` file that cannot be read is said in one line, and the snapshots that name this
run folder are adopted (`snapshot_ids_of`) rather than left in memory for good.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import shutil
import stat
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from txl_dist.checkpoint_paths import step_of_tag, tag_for_step
from txl_dist.checkpoints.background import FileJob
from txl_dist.checkpoints.verify import health_problem, whole_number
from txl_dist.fileio import describe_os_error, make_temporary_directory

log = logging.getLogger("txl_dist.training")

SNAPSHOT = "SNAPSHOT.json"
"""A snapshot's manifest, written last: a folder without one is not a snapshot."""
RUN_ID = "run_id"
"""The file in the run folder that names the run, for the snapshots it owns."""
ROOT_PREFIX = "txl_dist-"
"""The folder of a run's snapshots in checkpoint.memory_dir: ``txl_dist-{run id}``."""
KEEP = 2
"""Snapshots kept per rank on each node: the newest, and the one before while the newest is being written."""
RUN_ID_RE = re.compile(r"[0-9a-f]{32}")
_RANK_RE = re.compile(r"rank(\d{5})")
_STEP_RE = re.compile(r"step(\d{8})")


MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
"""File systems that hold their files in memory."""


class SnapshotError(ValueError):
    """A snapshot folder that cannot be trusted; the message names the folder and what is wrong."""


def crc32(data: bytes | memoryview) -> str:
    return f"{zlib.crc32(data):08x}"


def serialise(job: FileJob) -> bytes:
    """The bytes a job writes, in memory."""
    buffer = io.BytesIO()
    job.write(buffer)
    return buffer.getvalue()


# ---- the manifest --------------------------------------------------------------------------------------------------


def _whole(least: int, most: int | None = None):
    return lambda value: whole_number(value, least, most)


MANIFEST_FIELDS: dict[str, tuple[Any, str]] = {
    "run_id": (lambda v: isinstance(v, str) and RUN_ID_RE.fullmatch(v) is not None, "a run id (32 hex digits)"),
    "output_dir": (lambda v: isinstance(v, str) and os.path.isabs(v), "the run folder's absolute path"),
    "rank": (_whole(0), "a rank (a whole number >= 0)"),
    "world_size": (_whole(1), "a number of ranks (>= 1)"),
    "step": (_whole(0), "a step (a whole number >= 0)"),
    "host": (lambda v: isinstance(v, str), "a host name"),
    "streams_per_rank": (_whole(1), "a number of streams (>= 1)"),
    "architecture": (lambda v: isinstance(v, dict), "a mapping of the model's architecture"),
    "zero_stage": (_whole(0, 3), "a ZeRO stage (0-3)"),
    "files": (lambda v: isinstance(v, dict) and len(v) > 0, "a mapping of file names to sizes and checksums"),
}
"""Every field a snapshot's manifest must hold, with its check and what it must be. ``health`` (the step's loss and
gradient norm, as COMPLETE.json records it) may be there too, a mapping or null."""
OPTIONAL_FIELDS = {"health": (lambda v: v is None or isinstance(v, dict), "a mapping of the step's loss and norm")}
CRC_RE = re.compile(r"[0-9a-f]{8}")


def name_problem(name: Any) -> str | None:
    """Why ``name`` may not be a file of a snapshot (it could lead outside the folder it is joined to), or None."""
    if not isinstance(name, str) or not name:
        return "an empty name"
    if "\x00" in name or "\\" in name:
        return "a NUL or a back slash in it"
    if PurePosixPath(name).is_absolute():
        return "an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "an empty, '.' or '..' part"
    if name == SNAPSHOT or any(len(part.encode("utf-8", "surrogateescape")) > 255 for part in parts):
        return "a name no snapshot file has"
    return None


def check_manifest(manifest: Any) -> str | None:
    """What is wrong with a decoded ``SNAPSHOT.json`` (its first problem, naming the field), or None."""
    if not isinstance(manifest, dict):
        return f"{SNAPSHOT} is a JSON {type(manifest).__name__}, not an object"
    for field, (allowed, what) in {**MANIFEST_FIELDS, **OPTIONAL_FIELDS}.items():
        if field not in manifest:
            if field in OPTIONAL_FIELDS:
                continue
            return f"{SNAPSHOT} has no {field!r}"
        if not allowed(manifest[field]):
            return f"{SNAPSHOT}'s {field!r} is {manifest[field]!r:.60}, not {what}"
    if manifest["rank"] >= manifest["world_size"]:
        return f"{SNAPSHOT}'s 'rank' {manifest['rank']} is not a rank of its 'world_size' {manifest['world_size']}"
    for name, entry in manifest["files"].items():
        problem = name_problem(name)
        if problem is not None:
            return f"{SNAPSHOT} lists the file {name!r:.80}: {problem}"
        if not (
            isinstance(entry, dict)
            and whole_number(entry.get("bytes"))
            and isinstance(entry.get("crc32"), str)
            and CRC_RE.fullmatch(entry["crc32"])
        ):
            return f"{SNAPSHOT}'s entry of {name!r:.80} is {entry!r:.60}, not its bytes and crc32"
    return None


# ---- reading and writing a snapshot's folder ----------------------------------------------------------------------


def read_inside(folder: Path, name: str) -> bytes:
    """The bytes of ``folder / name``, where neither the file nor any folder on the way below ``folder`` is a
    symbolic link (OSError otherwise: ELOOP for a link)."""
    path = folder
    for part in name.split("/")[:-1]:
        path = path / part
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise OSError(errno.ENOTDIR, "not a folder (or a symbolic link)", str(path))
    descriptor = os.open(folder / name, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(folder / name))
        return handle.read()


def read_snapshot(folder: Path, identity: str, output_dir: str) -> dict[str, Any]:
    """The manifest of the snapshot in ``folder`` once it is known to be this run's (``identity``, the run folder
    ``output_dir``), at its rank's and step's place, with every file matching its size and CRC-32; SnapshotError
    (or OSError) naming what is wrong otherwise."""
    for place in (folder, folder.parent):
        if place.is_symlink():
            raise SnapshotError(f"{place} is a symbolic link")
    try:
        manifest = json.loads(read_inside(folder, SNAPSHOT).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise SnapshotError(f"{SNAPSHOT} is not JSON ({error})") from None
    problem = check_manifest(manifest)
    if problem is not None:
        raise SnapshotError(problem)
    if manifest["run_id"] != identity:
        raise SnapshotError("it belongs to another run")
    if manifest["output_dir"] != output_dir:
        raise SnapshotError(f"it belongs to the run folder {manifest['output_dir']} (this run is {output_dir})")
    if f"rank{manifest['rank']:05d}" != folder.parent.name or tag_for_step(manifest["step"]) != folder.name:
        raise SnapshotError("its manifest names another rank or step")
    for name, expected in manifest["files"].items():
        data = read_inside(folder, name)
        if len(data) != expected["bytes"] or crc32(data) != expected["crc32"]:
            raise SnapshotError(f"{name} does not match its checksum")
    return manifest


def verified_snapshots(root: Path, identity: str, output_dir: str) -> dict[tuple[int, int], dict[str, Any]]:
    """The snapshots of the run ``identity`` (run folder ``output_dir``) in ``root``, one node's memory folder of
    it, each checked (`read_snapshot`) and not sick (its recorded loss finite): (rank, step) -> manifest. Each one
    that fails is named in a warning with why, and skipped."""
    found: dict[tuple[int, int], dict[str, Any]] = {}
    if not root.is_dir() or root.is_symlink():
        return found
    for folder in snapshot_folders(root):
        try:
            manifest = read_snapshot(folder, identity, output_dir)
            sick = health_problem(manifest)
            if sick is not None:
                raise SnapshotError(f"its state is sick: {sick}")
        except (OSError, SnapshotError) as error:
            text = describe_os_error(error, folder) if isinstance(error, OSError) else str(error)
            log.warning("memory snapshot %s skipped: %s", folder, text)
            continue
        found[(manifest["rank"], manifest["step"])] = manifest
    return found


def write_snapshot(folder: Path, manifest: dict[str, Any], files: dict[str, bytes]) -> None:
    """FILES and the manifest into FOLDER (staged beside it and renamed when whole); a manifest that is not one
    (`check_manifest`) or files that do not match its checksums are refused (ValueError)."""
    problem = check_manifest(manifest)
    if problem is not None:
        raise ValueError(f"snapshot of rank {manifest.get('rank')}: {problem}")
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


def pack(manifest: dict[str, Any], files: dict[str, bytes]) -> bytes:
    """A snapshot as one buffer for the ring: the manifest's length, the manifest, the files in its order."""
    header = json.dumps(manifest).encode("utf-8")
    return struct.pack("<Q", len(header)) + header + b"".join(files[name] for name in manifest["files"])


def unpack(payload: memoryview) -> tuple[dict[str, Any], dict[str, bytes]]:
    """`pack`'s buffer back; ValueError for a buffer that is not one."""
    if len(payload) < 8:
        raise ValueError("a snapshot buffer shorter than its header")
    (length,) = struct.unpack("<Q", payload[:8])
    try:
        manifest = json.loads(bytes(payload[8 : 8 + length]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"a snapshot buffer whose manifest is not JSON ({error})") from None
    problem = check_manifest(manifest)
    if problem is not None:
        raise ValueError(f"a snapshot buffer: {problem}")
    files, offset = {}, 8 + length
    for name, checksum in manifest["files"].items():
        files[name] = bytes(payload[offset : offset + checksum["bytes"]])
        offset += checksum["bytes"]
    return manifest, files


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


def snapshot_folders(root: Path) -> list[Path]:
    """The folders of ``root`` (a run's snapshots on one node) that hold a snapshot's manifest, by rank and step."""
    found = []
    for rank_dir in sorted(root.iterdir()) if root.is_dir() else []:
        if _RANK_RE.fullmatch(rank_dir.name) and rank_dir.is_dir():
            found += [path for path in sorted(rank_dir.iterdir()) if step_of_tag(path.name) is not None]
    return found


# ---- the run's identity --------------------------------------------------------------------------------------------


def read_run_id(path: Path, output_dir: str) -> tuple[str | None, str]:
    """The run id the ``run_id`` file at ``path`` gives the run folder ``output_dir``, and why not (None): "" when
    the file gives it; "missing"; "copied" (it names another folder: a copy or a move); or what makes it
    unreadable. An id of the first format (32 hex digits alone) is this folder's. OSError for a path that is no
    file (a folder in the way)."""
    try:
        text = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return None, "missing"
    except UnicodeDecodeError:
        return None, "not UTF-8 text"
    if RUN_ID_RE.fullmatch(text):
        return text, ""
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        return None, f"{text[:40]!r} is neither a run id nor a record of one"
    if not (isinstance(record, dict) and RUN_ID_RE.fullmatch(str(record.get("run_id"))) is not None):
        return None, "no run id of 32 lowercase hex digits in it"
    if record.get("output_dir") != output_dir:
        return None, "copied"
    return record["run_id"], ""


def run_id_record(identity: str, output_dir: str) -> str:
    """The text of a ``run_id`` file: the id and the run folder it was made for."""
    return json.dumps({"run_id": identity, "output_dir": output_dir}) + "\n"


def snapshot_ids_of(memory_dir: Path, output_dir: str) -> list[str]:
    """The run ids whose snapshots in ``memory_dir`` name the run folder ``output_dir`` (newest step first)."""
    found: dict[str, int] = {}
    try:
        roots = [path for path in memory_dir.iterdir() if path.name.startswith(ROOT_PREFIX)]
    except OSError:
        return []
    for root in roots:
        for folder in snapshot_folders(root) if not root.is_symlink() else []:
            try:
                manifest = json.loads(read_inside(folder, SNAPSHOT).decode("utf-8"))
            except (OSError, ValueError):
                continue
            if check_manifest(manifest) is None and manifest["output_dir"] == output_dir:
                identity = root.name.removeprefix(ROOT_PREFIX)
                if identity == manifest["run_id"]:
                    found[identity] = max(found.get(identity, -1), manifest["step"])
    return sorted(found, key=lambda identity: -found[identity])


# ---- where snapshots go ----------------------------------------------------------------------------------------


def filesystem_of(path: Path) -> str | None:
    """The type of the file system that holds ``path`` (/proc/self/mounts: the longest mount point above it), None
    where that cannot be read."""
    try:
        mounts = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    resolved, best = str(path.resolve()), (None, -1)
    for line in mounts:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best[1]:
            best = (fields[2], len(point))
    return best[0]


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
