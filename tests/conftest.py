"""Shared fixtures: the Penn Treebank as files, PTB tokenizers and shards, a fabricated One Billion Word layout;
and the test tiers (docs/architecture.md, Tests).

Session-scoped and built through the real command-line entry points; treat their directories as read-only
(copy one before damaging it).

Tiers: ``make test-quick`` runs ``-m "not launcher and not cluster and not hf"``. A slow test says its tier where
it lies: its file's ``pytestmark`` (every file under tests/cluster/ is ``cluster``) or its own decorator. A test
that starts a launcher, a cluster command or the current-transformers interpreter without its marker fails
(`_starts_without_marker`), so that a new slow test cannot slip into the quick tier.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import treebank

from data_tools import build_shards, train_tokenizer
from data_tools.corpora import published

TIER_MARKERS = ("launcher", "cluster", "hf")
"""The markers that keep a test out of the quick tier: it starts a launcher (deepspeed, torchrun, mpirun, srun),
uses the two-node cluster, or needs an interpreter or extra that `make test` installs and the quick tier does not:
the current-transformers interpreter (.venv-hf), TensorFlow (the tf extra)."""

LAUNCH_PROGRAMS = ("deepspeed", "torchrun", "mpirun", "srun", "sbatch", "salloc", "ip", "unshare", "nsenter")
"""Programs whose start marks a test as slow: the launchers, Slurm's commands and the cluster's namespace tools."""

_REPO = Path(__file__).resolve().parents[1]
_current: dict[str, object] = {"item": None, "unmarked": []}


def _hf_python() -> str:
    return os.path.abspath(os.environ.get("TXL_HF_PYTHON", _REPO / ".venv-hf" / "bin" / "python"))


def _slow_start(argv: list[str]) -> str | None:
    """What in ARGV (a process about to start) needs a tier marker, or None."""
    if not argv:
        return None
    program = os.path.basename(str(argv[0]))
    if program in LAUNCH_PROGRAMS:
        return "cluster" if program in ("srun", "sbatch", "salloc", "ip", "unshare", "nsenter") else "launcher"
    if os.path.abspath(str(argv[0])) == _hf_python():
        return "hf"
    if any(str(arg).endswith(("/deepspeed", "torch.distributed.run", "torch/distributed/run.py")) for arg in argv):
        return "launcher"
    return None


def _starts_without_marker(event: str, args: tuple) -> None:
    """Audit hook: records a slow start (subprocess.Popen) by a test that lacks its tier marker."""
    item = _current["item"]
    if event != "subprocess.Popen" or item is None:
        return
    argv = args[1]
    if isinstance(argv, (str, bytes)) or argv is None:
        argv = [args[0]] if args[0] else []
    needed = _slow_start([os.fsdecode(a) if isinstance(a, bytes) else str(a) for a in argv])
    if needed and not any(item.get_closest_marker(name) for name in TIER_MARKERS):
        _current["unmarked"].append(f"{needed}: {' '.join(map(str, argv))[:200]}")


sys.addaudithook(_starts_without_marker)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Fixtures count as the test's own: one that starts a launcher needs the marker as much."""
    _current["item"], _current["unmarked"] = item, []
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _current["item"] = item
    outcome = yield
    _current["item"] = None
    if _current["unmarked"] and outcome.excinfo is None:
        first = _current["unmarked"][0]
        pytest.fail(
            f"{item.nodeid} started a slow process without a tier marker ({first}): mark it "
            f"@pytest.mark.{first.split(':')[0]} (or its file: pytestmark = pytest.mark.{first.split(':')[0]})",
            pytrace=False,
        )


# Small blocks and shards so that the PTB splits span several of each (train: ~227 blocks, 8 shards).
PTB_TOKENS_PER_BLOCK = 4096
PTB_TOKENS_PER_SHARD = 131072


def ptb_sentences(split: str) -> list[str]:
    """The sentences (non-blank lines) of a PTB split, as in the treebank package."""
    return [line for line in treebank.penn[split].split("\n") if line.strip()]


@pytest.fixture(scope="session")
def reference(ptb_word_shards, tmp_path_factory) -> Path:
    """The uninterrupted run that launcher tests compare theirs with, step by step: `tests.launcher.tiny_args` for
    40 steps through the real `deepspeed` launcher on 2 CPU ranks, a checkpoint every 10 steps, all kept. Read-only:
    copy it (`tests.launcher.copy_at_step`) to resume from it."""
    from tests.launcher import REFERENCE_COMMAND, STEPS, TRAIN, launcher_command, run, tiny_args

    output = tmp_path_factory.mktemp("reference")
    REFERENCE_COMMAND[:] = launcher_command(TRAIN, tiny_args(ptb_word_shards, output, f"train.max_steps={STEPS}"))
    run(REFERENCE_COMMAND)
    return output


@pytest.fixture(scope="session")
def ptb_text_dir(tmp_path_factory) -> Path:
    """``ptb.{train,valid,test}.txt`` written from the treebank package."""
    directory = tmp_path_factory.mktemp("ptb_text")
    for split, name in published.PTB_FILES.items():
        (directory / name).write_text(treebank.penn[split], encoding="utf-8")
    return directory


@pytest.fixture(scope="session")
def ptb_word_tokenizer(tmp_path_factory) -> Path:
    """The standard 10,000-word PTB vocabulary (``<eos>`` first, ``<unk>`` a word of the text)."""
    directory = tmp_path_factory.mktemp("ptb_word_tokenizer")
    assert (
        train_tokenizer.main(
            ["--kind", "word", "--format", "ptb", "--output", str(directory), "--overwrite", "--no-progress"]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="session")
def ptb_sentencepiece_tokenizer(tmp_path_factory) -> Path:
    """A 2,000-piece BPE model of PTB train covering all its characters, with an end-of-document symbol
    ``<eod>`` (eod_id != eos_id). SentencePiece reads the text ``<unk>`` as unknown characters."""
    directory = tmp_path_factory.mktemp("ptb_sentencepiece_tokenizer")
    assert (
        train_tokenizer.main(
            [
                "--kind",
                "sentencepiece",
                "--model-type",
                "bpe",
                "--vocab-size",
                "2000",
                "--character-coverage",
                "1.0",
                "--eod-symbol",
                "<eod>",
                "--format",
                "ptb",
                "--output",
                str(directory),
                "--overwrite",
                "--no-progress",
            ]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="session")
def ptb_export(ptb_word_tokenizer, tmp_path_factory) -> Path:
    """An export of a tiny untrained model (two cluster cutoffs) with the PTB word tokenizer."""
    import torch

    from txl_dist.export import write_export
    from txl_dist.model import TransformerXLLM, preset
    from txl_dist.tokenizer import load_tokenizer

    torch.manual_seed(0)  # the same weights whichever tests this process ran before (a pytest-xdist worker)
    vocab_size = load_tokenizer(ptb_word_tokenizer).vocab_size
    model = TransformerXLLM(preset("tiny", n_token=vocab_size, cutoffs=[2000, 6000]))
    return write_export(
        model, model.config, tmp_path_factory.mktemp("exports") / "ptb_tiny", tokenizer_dir=ptb_word_tokenizer
    )


@pytest.fixture(scope="session")
def ptb_word_shards(tmp_path_factory, ptb_word_tokenizer) -> Path:
    """PTB train/valid/test shards of the word tokenizer (blocks of 4,096 tokens, shards of 131,072)."""
    directory = tmp_path_factory.mktemp("ptb_word_shards")
    assert (
        build_shards.main(
            [
                "--tokenizer",
                str(ptb_word_tokenizer),
                "--output",
                str(directory),
                "--format",
                "ptb",
                "--tokens-per-block",
                str(PTB_TOKENS_PER_BLOCK),
                "--tokens-per-shard",
                str(PTB_TOKENS_PER_SHARD),
                "--overwrite",
                "--no-progress",
            ]
        )
        == 0
    )
    return directory


@pytest.fixture(scope="session")
def fabricated_lm1b_dir(tmp_path_factory) -> Path:
    """The One Billion Word r13output layout filled with PTB sentences: the 99 training files hold PTB train
    in order, heldout-00000 (test) holds PTB test and heldout-00001 (valid) holds PTB valid."""
    root = tmp_path_factory.mktemp("lm1b") / "1-billion-word-language-modeling-benchmark-r13output"
    (root / published.LM1B_TRAIN_DIR).mkdir(parents=True)
    (root / published.LM1B_HELDOUT_DIR).mkdir()
    train = ptb_sentences("train")
    per_file = -(-len(train) // len(published.LM1B_TRAIN_FILES))
    for i, name in enumerate(published.LM1B_TRAIN_FILES):
        lines = train[i * per_file : (i + 1) * per_file]
        (root / published.LM1B_TRAIN_DIR / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    for split, name in (
        ("test", published.LM1B_TEST_FILE),
        ("valid", published.LM1B_DEFAULT_VALID_FILE),
    ):
        (root / published.LM1B_HELDOUT_DIR / name).write_text(
            "".join(line + "\n" for line in ptb_sentences(split)), encoding="utf-8"
        )
    return root


@pytest.fixture(autouse=True)
def _remove_deepspeed_shm_buffers():
    """A DeepSpeed run on the CPU accelerator creates /dev/shm/deepspeed_allreduce_buffer_* files (66 MiB each,
    named ``..._{master address}_{master port}_{rank}``); the ranks remove theirs once all are mapped
    (process_group.release_shm_buffer), but a run killed during start-up, or a test's own DeepSpeed process group,
    may still leave one: remove this test's after it so they do not pile up in memory. Only the ports this session
    handed out: removing another session's live buffer (a parallel run on a shared machine) makes its ranks wait
    for each other forever in DeepSpeed's start-up."""
    from tests.launcher import remove_shm_buffers

    yield
    remove_shm_buffers()


@pytest.fixture
def deepspeed_op_cache(monkeypatch):
    """The environment every launched rank gives itself (`txl_dist.rendezvous.process_group.prepare_extension_cache`)
    for a test that builds a DeepSpeed engine in its own process, or in a child it starts: the shared-memory op from
    this environment's cache, where `make warm` built it with the environment's own ninja. Without it the op is
    compiled again, into torch's default cache and by the system's ninja, whose log format differs: 30 s on the
    first run of a fresh clone."""
    from txl_dist.rendezvous.process_group import prepare_extension_cache

    environ = dict(os.environ)
    prepare_extension_cache(environ)
    for key in ("TORCH_EXTENSIONS_DIR", "PATH"):
        monkeypatch.setenv(key, environ[key])
