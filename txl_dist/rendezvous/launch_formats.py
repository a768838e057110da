"""The text that launchers hand over, read strictly: Slurm's host lists and task counts, DeepSpeed's hostfile and
``.deepspeed_env``. Each is refused in one line (naming the variable, or the file and line) where it is malformed,
rather than read the way its consumer would misread it: a node list without its ``]`` as one host, a hostfile line
``slots=0`` as a world of none, a ``.deepspeed_env`` line that ends DeepSpeed's runner with a traceback.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Mapping

from txl_dist.fileio import with_path

FORWARDED_BY_DEEPSPEED = ("MLFLOW", "PYTHON", "MV2", "UCX", "NCCL")
"""Variable families that ``deepspeed --hostfile`` (pdsh over ssh) forwards to remote ranks by itself."""
COMPARED_VARIABLES = (
    "DS_ACCELERATOR",
    "OMP_NUM_THREADS",
    "TORCH_EXTENSIONS_DIR",
    "CUDA_DEVICE_MAX_CONNECTIONS",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
)
"""The variables every rank of a run must agree on (accelerator, threads, op cache, network interfaces): the ranks
compare them at start-up (`txl_dist.rendezvous.process_group`)."""
RUN_VARIABLES = (*COMPARED_VARIABLES, "DEEPSPEED_TIMEOUT", "HF_HOME", "TMPDIR")
"""What a user sets for a run that must reach every rank (written into .deepspeed_env)."""


class LaunchError(ValueError):
    """A launch whose ranks cannot form one world (printed as one line)."""


def env_int(environ: Mapping[str, str], key: str) -> int:
    """The whole number in variable ``key``; LaunchError naming it when it is unset or not a number."""
    if key not in environ:
        raise LaunchError(f"{key} is not set")
    value = environ[key]
    if re.fullmatch(r"\s*[+-]?\d+\s*", value) is None:
        raise LaunchError(f"the launcher set {key}={value!r}, which is not a whole number")
    return int(value)


MAX_HOSTS = 100_000
"""More names than any cluster has: a host list that expands beyond it is refused rather than held in memory."""


def _split_top_level(hostlist: str, where: str) -> list[str]:
    """The comma-separated parts of a host list, commas inside brackets kept; brackets must pair, unnested."""
    parts, current, depth = [], "", 0
    for char in hostlist:
        if char == "[":
            if depth:
                raise LaunchError(f"cannot read {where}: a '[' inside brackets")
            depth = 1
        elif char == "]":
            if not depth:
                raise LaunchError(f"cannot read {where}: a ']' without its '['")
            depth = 0
        elif char == "," and not depth:
            parts.append(current)
            current = ""
            continue
        current += char
    if depth:
        raise LaunchError(f"cannot read {where}: a '[' is never closed")
    return [*parts, current]


def _range_bounds(item: str, where: str) -> tuple[str, int, int]:
    """(the low end as written, low, high) of a bracket's item ``N`` or ``N-M``; LaunchError for another form or a
    range that runs backwards."""
    match = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
    if match is None:
        raise LaunchError(f"cannot read {where} (range {item!r}: numbers N or N-M)")
    low = int(match.group(1))
    high = low if match.group(2) is None else int(match.group(2))
    if high < low:
        raise LaunchError(f"cannot read {where} (range {item!r} runs backwards)")
    return match.group(1), low, high


_Group = tuple[str, "list[tuple[str, int, int]] | None"]
"""A piece of a host name: its literal text, then its bracket's ranges (written low end, low, high), or None."""


def _bracket_ranges(bracket: str, where: str) -> list[tuple[str, int, int]] | None:
    return [_range_bounds(item, where) for item in bracket[1:-1].split(",")] if bracket else None


def _name_count(groups: list[_Group]) -> int:
    """How many names a part of a host list stands for: the product of its brackets' sizes, counted, not built."""
    count = 1
    for _, ranges in groups:
        count *= sum(high - low + 1 for _, low, high in ranges) if ranges else 1
    return count


def _names(groups: list[_Group]) -> list[str]:
    names = [""]
    for literal, ranges in groups:
        suffixes = [str(n).zfill(len(written)) for written, low, high in ranges or [] for n in range(low, high + 1)]
        names = [prefix + literal + suffix for prefix in names for suffix in suffixes or [""]]
    return names


def expand_hostlist(hostlist: str, name: str = "") -> list[str]:
    """Slurm's compact host list (``node[01-03,7],gpu-a[1-2]-ib``) as names, in order; LaunchError naming the
    variable ``name`` (when given) for an empty or malformed list (an unclosed bracket, a backward range), or one
    of more than `MAX_HOSTS` names, which is counted (the product of each name's brackets, summed over the list)
    before any name is built."""
    where = f"{name}={hostlist!r}" if name else f"the Slurm host list {hostlist!r}"
    if not hostlist.strip():
        raise LaunchError(f"cannot read {where}: no host in it")
    parts = []
    for part in _split_top_level(hostlist.strip(), where):
        if not part or re.search(r"\s", part):
            raise LaunchError(f"cannot read {where}: an empty name, or white space in one")
        groups = [
            (literal, _bracket_ranges(bracket, where))
            for literal, bracket in re.findall(r"([^\[\]]*)(\[[^\]]*\])?", part)
        ]
        parts.append(groups)
    count = sum(_name_count(groups) for groups in parts)
    if count > MAX_HOSTS:
        raise LaunchError(
            f"cannot read {where}: it names {count:,} hosts, more than {MAX_HOSTS} hosts is more than any cluster has"
        )
    return [host for groups in parts for host in _names(groups)]


def tasks_per_node(tasks_per_node: str, key: str) -> list[int]:
    """Slurm's ``2(x3),1`` form (``key`` names the variable) as one count per node."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None or int(match.group(2) or 1) < 1 or len(counts) + int(match.group(2) or 1) > MAX_HOSTS:
            raise LaunchError(f"cannot read {key}={tasks_per_node!r} (counts such as 4(x2),2)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


MAX_SLOTS = 1024
"""More ranks than any node runs (8 or 16 GPUs; a rank per core of the largest CPU nodes): a hostfile's slots, or
max_slots, above it are a typing error, refused rather than planned for."""


def _check_slots(where: str, slots: int, max_slots: int | None) -> None:
    """LaunchError (``where``: the file, line and host) for slots outside 1 to `MAX_SLOTS`, or max_slots (Open
    MPI's ceiling on the ranks of the host) below slots or above `MAX_SLOTS`."""
    if slots < 1:
        raise LaunchError(f"{where} has slots={slots}: a host needs at least one slot (1 to {MAX_SLOTS})")
    if slots > MAX_SLOTS:
        raise LaunchError(f"{where} has slots={slots}: more ranks than a node runs (1 to {MAX_SLOTS})")
    if max_slots is not None and not slots <= max_slots <= MAX_SLOTS:
        raise LaunchError(f"{where} has max_slots={max_slots}: from its slots={slots} to {MAX_SLOTS}")


def read_hostfile(path: str) -> dict[str, int]:
    """The hosts of a DeepSpeed hostfile and their slots, in order, checked as `deepspeed --hostfile` needs them:
    one ``HOST slots=N [max_slots=M]`` a line (N from 1 to `MAX_SLOTS`, M from N to `MAX_SLOTS`; ``#`` comments
    and blank lines allowed), each host once, at least one host. LaunchError naming the file and the line otherwise
    (DeepSpeed's runner would start on local resources only without the file, stop with a traceback at a
    duplicate or ``slots=two``, start no rank at ``slots=0``)."""
    try:
        with open(path, encoding="utf-8") as handle:
            lines = handle.read().splitlines()
    except UnicodeDecodeError as error:
        raise LaunchError(f"{path}: not UTF-8 text (byte {error.start}); a hostfile is `HOST slots=N` lines") from None
    except OSError as error:
        raise LaunchError(f"{path}: cannot read the hostfile ({error.strerror or error})") from None
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        # Open MPI's max_slots may follow (DeepSpeed's openmpi launcher hands mpirun the file itself).
        match = re.fullmatch(r"(\S+)\s+slots=(\d+)(?:\s+max_slots=(\d+))?\s*(?:#.*)?", text)
        if match is None:
            raise LaunchError(f"{path}:{number}: {text!r} is not `HOST slots=N` (N a whole number of ranks)")
        host, slots = match.group(1), int(match.group(2))
        _check_slots(f"{path}:{number}: {host}", slots, None if match.group(3) is None else int(match.group(3)))
        if host in hosts:
            raise LaunchError(
                f"{path}:{number}: {host} is listed again (first on line {first_line[host]}): one line per host, "
                "with all its slots"
            )
        hosts[host], first_line[host] = slots, number
        if len(hosts) > MAX_HOSTS:
            raise LaunchError(f"{path}:{number}: more than {MAX_HOSTS} hosts is more than any cluster has")
    if not hosts:
        raise LaunchError(f"{path}: no host in the hostfile (one `HOST slots=N` a line)")
    return hosts


RUNNER_LAUNCHERS = ("pdsh", "openmpi", "mvapich", "mpich", "impi", "slurm")
"""`deepspeed --launcher` values: how the runner hands ``.deepspeed_env`` to the ranks."""
_QUOTED_BY_DEEPSPEED = re.compile(r"[^\w@%+=:,./-]")
"""DeepSpeed's runner puts a value holding any other character in double quotes (``MultiNodeRunner.add_export``)."""
_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def encode_value(key: str, value: str, launcher: str = "pdsh") -> str:
    """What to write after ``KEY=`` in ``.deepspeed_env`` for the ranks of ``launcher`` to get ``value`` unchanged;
    LaunchError for a value it cannot carry.

    DeepSpeed reads the file a line at a time, strips each value and wraps one holding characters other than
    letters, digits and ``@%+=:,./-`` in double quotes. With pdsh the result is part of one command that pdsh
    expands (``%h``, ``%n``, ``%u``, ``%%``) and a remote shell reads, so ``%`` is doubled and ``\\ $ ` "`` are
    escaped for the double quotes. The other launchers pass it as an argument of mpirun or srun, where no shell
    removes those quotes: only the characters left unquoted can be carried (and no comma in srun's --export list)."""
    if not _VARIABLE_NAME.fullmatch(key):
        raise LaunchError(f"{key!r} is not a variable name (letters, digits and _, not starting with a digit)")
    if "\n" in value or "\r" in value:
        raise LaunchError(f"{key} holds a line break, which .deepspeed_env cannot carry (one KEY=VALUE a line)")
    if value != value.strip():
        raise LaunchError(f"{key}={value!r} begins or ends with white space, which DeepSpeed's runner strips")
    if launcher == "pdsh":
        return re.sub(r'([\\$`"])', r"\\\1", value.replace("%", "%%"))
    if launcher not in RUNNER_LAUNCHERS:
        raise LaunchError(f"--launcher {launcher!r}: one of {', '.join(RUNNER_LAUNCHERS)}")
    quoted = _QUOTED_BY_DEEPSPEED.search(value)
    if quoted or (launcher == "slurm" and "," in value):
        character = quoted.group(0) if quoted else ","
        raise LaunchError(
            f"{key}={value!r}: DeepSpeed's {launcher} launcher cannot carry {character!r} to the ranks unchanged "
            "(it passes such values in literal double quotes, srun's --export splits at commas); set it in the "
            "ranks' login environment instead"
        )
    return value


def _kept_lines(path: str, replaced: set[str]) -> list[str]:
    """The lines of an existing ``.deepspeed_env`` for other keys. Blank and comment lines (which DeepSpeed's runner
    cannot read: it splits every line at its first ``=``) are dropped with a warning naming them; a line that is
    no ``KEY=VALUE`` at all is refused, since what it was meant to set would be lost."""
    try:
        with open(path, encoding="utf-8", newline="") as existing:
            text = existing.read()
    except FileNotFoundError:
        return []
    except UnicodeDecodeError as error:
        raise LaunchError(
            f"{path}: not UTF-8 text (byte {error.start}), which DeepSpeed's runner cannot read: fix or remove it"
        ) from None
    kept, dropped = [], []
    for number, line in enumerate(re.split(r"\r\n|\r|\n", text.removesuffix("\n")) if text else [], 1):
        if not line.strip() or line.lstrip().startswith("#"):
            dropped.append(str(number))
            continue
        key = line.split("=", 1)[0]
        if "=" not in line or not _VARIABLE_NAME.fullmatch(key.strip()):
            raise LaunchError(
                f"{path}:{number}: {line!r} is not KEY=VALUE, and DeepSpeed's runner stops at it: fix or remove it"
            )
        if key.strip() not in replaced:
            kept.append(line)
    if dropped:
        print(
            f"txl_dist.rendezvous.launch_env: warning: {path}: dropped line(s) {', '.join(dropped)} (blank or "
            "comment), which DeepSpeed's runner cannot read",
            file=sys.stderr,
        )
    return kept


def write_deepspeed_env(
    path: str, environ: Mapping[str, str] | None = None, extra: tuple[str, ...] = (), launcher: str = "pdsh"
) -> list[str]:
    """Write (or update) DeepSpeed's ``.deepspeed_env``: the run variables set here, one ``KEY=VALUE`` a line,
    encoded for ``launcher`` (`encode_value`), so that ``deepspeed --hostfile`` exports them on every node. Lines for
    other keys are kept; the file is replaced whole, keeping its mode (a link is followed). Returns the keys."""
    environ = os.environ if environ is None else environ
    for key in extra:
        if not _VARIABLE_NAME.fullmatch(key):
            raise LaunchError(f"--also {key!r} is not a variable name (letters, digits and _)")
    unset = [key for key in dict.fromkeys(extra) if not environ.get(key)]
    if unset:
        them = "it" if len(unset) == 1 else "them"
        raise LaunchError(
            f"--also {' '.join(unset)}: not set here (or set empty), so there is nothing to forward; set {them} "
            f"before writing the file, or leave {them} out"
        )
    keys = list(dict.fromkeys(key for key in (*RUN_VARIABLES, *extra) if environ.get(key)))
    encoded = [f"{key}={encode_value(key, environ[key], launcher)}" for key in keys]
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise LaunchError(f"{path}: a directory, not the .deepspeed_env file")
    lines = _kept_lines(target, set(keys)) + encoded
    temporary = f"{target}.tmp-{os.getpid()}"
    try:
        with open(temporary, "w", encoding="utf-8", newline="\n") as out:
            out.write("".join(line + "\n" for line in lines))
        if os.path.exists(target):
            os.chmod(temporary, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(temporary, target)
    except OSError as error:
        # the status follows the cause: a missing folder is the path given (2), a read-only one the surroundings (1)
        raise with_path(error, path, replace=True) from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return keys
