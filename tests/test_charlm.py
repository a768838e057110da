"""The paper's other benchmarks: byte and character tokenizers, the enwik8 / text8 / WikiText importers at the
authors' offsets, the configs of their run scripts, bits per character from training logs to exports."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.corpora import synthetic_charlm
from data_tools import build_shards, train_tokenizer
from data_tools.corpora import published
from data_tools.errors import InputError
from tests.launcher import in_process, records, run, torchrun_command
from tests.test_build_shards import read_split
from txl_dist.config import load_config
from txl_dist.data.format import read_manifest
from txl_dist.model import ModelConfig, TransformerXLLM, preset
from txl_dist.tokenizer import ByteTokenizer, CharTokenizer, load_tokenizer

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = 20_000  # a scaled-down copy: 200,000 bytes, the last 2 x 20,000 held out
EVERY_UTF8_LENGTH = "a é € 𝄞\n日本語 text\twith tabs  and\r\nline ends\n\n"


def _train(*args: str | Path) -> None:
    assert train_tokenizer.main([str(a) for a in args] + ["--no-progress"]) == 0


def _build(*args: str | Path) -> None:
    assert build_shards.main([str(a) for a in args] + ["--no-progress"]) == 0


@pytest.fixture(scope="module")
def enwik8(tmp_path_factory) -> dict[str, Path]:
    """A synthetic enwik8 of 200,000 bytes (and its zip), its byte tokenizer and its shards (small blocks)."""
    root = tmp_path_factory.mktemp("enwik8")
    path = synthetic_charlm.write_character_corpus("enwik8", root / "enwik8", 200_000, make_zip=True)
    _train(
        "--preset",
        "enwik8",
        "--format",
        "enwik8",
        "--input",
        root / "enwik8.zip",
        "--output",
        root / "tok",
        "--held-out-bytes",
        HELD_OUT,
    )
    _build(
        "--tokenizer",
        root / "tok",
        "--output",
        root / "shards",
        "--format",
        "enwik8",
        "--input",
        path,
        "--held-out-bytes",
        HELD_OUT,
        "--tokens-per-block",
        4096,
        "--tokens-per-shard",
        65536,
    )
    return {"file": path, "zip": root / "enwik8.zip", "tokenizer": root / "tok", "shards": root / "shards"}


# ---- tokenizers ---------------------------------------------------------------------------------------------


def test_byte_tokenizer_round_trips_random_bytes_and_every_utf8_length(enwik8):
    tokenizer = load_tokenizer(enwik8["tokenizer"])
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.vocab_size == 256
    assert (tokenizer.eos_id, tokenizer.eod_id, tokenizer.unk_id) == (10, 10, None)
    data = np.random.default_rng(0).integers(0, 256, size=100_000, dtype=np.uint8).tobytes()
    ids = tokenizer.encode_bytes(data)
    assert ids.tolist() == list(data) and tokenizer.decode_bytes(ids) == data
    as_text = data.decode("utf-8", "surrogateescape")  # what str-based callers hold: the same bytes
    assert tokenizer.decode(tokenizer.encode(as_text)) == as_text
    encoded = tokenizer.encode(EVERY_UTF8_LENGTH)
    assert bytes(encoded) == EVERY_UTF8_LENGTH.encode("utf-8")
    assert sorted({len(c.encode("utf-8")) for c in EVERY_UTF8_LENGTH}) == [1, 2, 3, 4]
    assert tokenizer.decode(encoded) == EVERY_UTF8_LENGTH
    # A document's lines each end with the newline byte: the stream is the text's bytes and a closing newline.
    tokens, per_document = tokenizer.encode_documents([EVERY_UTF8_LENGTH.split("\n")[:3], ["x"]])
    assert bytes(tokens.tolist()) == ("\n".join(EVERY_UTF8_LENGTH.split("\n")[:3]) + "\nx\n").encode("utf-8")
    assert per_document.sum() == len(tokens)


def test_char_tokenizer_round_trips_text_with_every_utf8_length(tmp_path):
    corpus_file = tmp_path / "text.txt"
    corpus_file.write_text(EVERY_UTF8_LENGTH * 3, encoding="utf-8", newline="")
    _train("--kind", "char", "--input", corpus_file, "--output", tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.id_to_piece(0) == "\n" and tokenizer.eos_id == 0
    assert tokenizer.vocab_size == len(set(EVERY_UTF8_LENGTH))
    ids = tokenizer.encode(EVERY_UTF8_LENGTH)
    assert len(ids) == len(EVERY_UTF8_LENGTH) and tokenizer.decode(ids) == EVERY_UTF8_LENGTH
    with pytest.raises(ValueError, match="'Z'.*not in the alphabet"):
        tokenizer.encode("aZ")
    # The text8 preset: 27 characters and the newline; a character outside the alphabet stops training.
    (tmp_path / "upper").write_text(" abc Abc", encoding="utf-8")
    assert (
        train_tokenizer.main(
            [
                "--preset",
                "text8",
                "--input",
                str(tmp_path / "upper"),
                "--output",
                str(tmp_path / "tok8"),
                "--no-progress",
            ]
        )
        == 2
    )


# ---- importers ----------------------------------------------------------------------------------------------


def test_split_offsets_are_the_authors_for_the_full_100m_bytes():
    # prep_enwik8.py / prep_text8.py: data[:-2n], data[-2n:-n], data[-n:] with n = 5,000,000.
    assert published.held_out_tail_ranges(100_000_000) == {
        "train": (0, 90_000_000),
        "valid": (90_000_000, 95_000_000),
        "test": (95_000_000, 100_000_000),
    }
    ranges = published.held_out_tail_ranges(123_456, 1_000)
    assert ranges == {"train": (0, 121_456), "valid": (121_456, 122_456), "test": (122_456, 123_456)}
    with pytest.raises(InputError, match="nothing left for train"):
        published.held_out_tail_ranges(10_000_000)


def test_enwik8_shards_are_the_files_bytes_in_order_at_the_authors_offsets(enwik8, tmp_path):
    data = enwik8["file"].read_bytes()
    assert b"\xff" in data  # bytes that are not UTF-8 are part of the test
    authors = {"train": data[: -2 * HELD_OUT], "valid": data[-2 * HELD_OUT : -HELD_OUT], "test": data[-HELD_OUT:]}
    for split, expected in authors.items():
        tokens = read_split(enwik8["shards"], split)[0]
        # Every byte, in order; a split that ends inside a line gets the newline that closes it (the authors'
        # final <eos>).
        assert bytes(tokens.astype(np.uint8)) == expected + (b"" if expected.endswith(b"\n") else b"\n"), split
    # The zip as downloaded, and the file read by 2 workers (which read their chunks again by offset), give the
    # same shards.
    for name, source in (("from_zip", enwik8["zip"]), ("two_workers", enwik8["file"])):
        _build(
            "--tokenizer",
            enwik8["tokenizer"],
            "--output",
            tmp_path / name,
            "--format",
            "enwik8",
            "--input",
            source,
            "--held-out-bytes",
            HELD_OUT,
            "--tokens-per-block",
            4096,
            "--tokens-per-shard",
            65536,
            "--workers",
            2,
            "--chunk-bytes",
            4096,
        )
        for split in authors:
            for ours, theirs in zip(
                read_manifest(tmp_path / name).splits[split].shards,
                read_manifest(enwik8["shards"]).splits[split].shards,
            ):
                assert ours.sha256 == theirs.sha256, (name, split)


def test_text8_splits_strip_each_part_as_prep_text8(tmp_path):
    path = synthetic_charlm.write_character_corpus("text8", tmp_path / "text8", 100_000)
    data = path.read_text(encoding="ascii")
    assert data.startswith(" ") and "\n" not in data
    _train(
        "--preset",
        "text8",
        "--format",
        "text8",
        "--input",
        tmp_path,
        "--output",
        tmp_path / "tok",
        "--held-out-bytes",
        10_000,
    )
    tokenizer = load_tokenizer(tmp_path / "tok")
    assert tokenizer.vocab_size == 28 and "".join(sorted(tokenizer.characters[1:])) == " abcdefghijklmnopqrstuvwxyz"
    _build(
        "--tokenizer",
        tmp_path / "tok",
        "--output",
        tmp_path / "shards",
        "--format",
        "text8",
        "--input",
        path,
        "--held-out-bytes",
        10_000,
        "--tokens-per-block",
        4096,
    )
    n = 10_000
    authors = {"train": data[: -2 * n].strip(), "valid": data[-2 * n : -n].strip(), "test": data[-n:].strip()}
    for split, expected in authors.items():
        tokens = read_split(tmp_path / "shards", split)[0]
        assert tokenizer.decode(tokens.tolist()) == expected + "\n", split


def test_wikitext_vocabulary_is_the_train_words_and_eos_and_every_line_ends_with_eos(tmp_path):
    folder = tmp_path / "wikitext-103"
    paths = synthetic_charlm.write_wikitext(folder, 20_000)
    _train("--preset", "wikitext", "--format", "wikitext", "--input", folder, "--output", tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    train_words = set(paths["train"].read_text(encoding="utf-8").split())
    assert set(tokenizer.words) == train_words | {"<eos>"} and tokenizer.vocab_size == len(train_words) + 1
    assert tokenizer.words[0] == "<eos>" and tokenizer.id_to_piece(tokenizer.unk_id) == "<unk>"
    _build("--tokenizer", tmp_path / "tok", "--output", tmp_path / "shards", "--format", "wikitext", "--input", folder)
    for split, path in paths.items():
        lines = path.read_text(encoding="utf-8").split("\n")[:-1]
        assert any(not line.strip() for line in lines)  # blank lines, which the authors' data keeps as <eos>
        expected = [tokenizer.encode(line) + [tokenizer.eos_id] for line in lines]
        tokens = read_split(tmp_path / "shards", split)[0]
        assert tokens.tolist() == [token for line in expected for token in line], split


# ---- configs ------------------------------------------------------------------------------------------------


def architecture_parameters(m: ModelConfig) -> int:
    """The parameters of the authors' MemTransformerLM for ``m``, counted from its definition (mem_transformer.py,
    proj_adaptive_softmax.py): decoder layers, the shared position biases, the adaptive input and softmax."""
    h = m.n_head * m.d_head
    attention = m.d_model * 3 * h + h * m.d_model + m.d_model * h + 2 * m.d_model  # qkv, o, r (no biases), norm
    feed_forward = 2 * m.d_model * m.d_inner + m.d_inner + m.d_model + 2 * m.d_model
    total = m.n_layer * (attention + feed_forward) + 2 * h * (m.n_layer if m.untie_r else 1)
    d_embed = m.d_embed or m.d_model
    ends = [0] + m.cutoffs + [m.n_token]
    sizes = [b - a for a, b in zip(ends, ends[1:])]
    if m.div_val == 1:
        total += m.n_token * d_embed + (m.d_model * d_embed if d_embed != m.d_model else 0)
    else:
        dims = [d_embed // m.div_val**i for i in range(len(sizes))]
        total += sum(size * dim + m.d_model * dim for size, dim in zip(sizes, dims))
        tie_projs = m.tie_projs if m.tie_projs is not None else [False] + [True] * len(m.cutoffs)
        total += sum(m.d_model * dim for dim, tied in zip(dims, tie_projs) if not tied)
    total += m.n_token + len(m.cutoffs) * (d_embed + 1)  # output biases, the cluster logits' weight and bias
    assert m.tie_weight  # every config here ties the output weights to the embedding
    return total


PAPER = {"enwik8_base": 41e6, "enwik8_large": 277e6, "text8_large": 277e6, "wt103_base": 151e6}


@pytest.mark.parametrize(
    "name", ["enwik8_base", "enwik8_large", "text8_base", "text8_large", "wt103_base", "wt103_large"]
)
def test_config_loads_with_the_authors_settings_and_its_parameter_count(name):
    cfg = load_config(REPO / "configs" / f"{name}.yaml")
    assert cfg.model_preset == name and cfg.eval.same_length is True
    script = {
        "enwik8_base": (12, 512, 2048, 512, 80, 2100, 820, 22),
        "text8_base": (12, 512, 2048, 512, 80, 2100, 820, 22),
        "enwik8_large": (24, 1024, 3072, 768, 128, 3800, 1000, 64),
        "text8_large": (24, 1024, 3072, 768, 128, 3800, 1000, 64),
        "wt103_base": (16, 410, 2100, 150, 64, 640, 400, 60),
        "wt103_large": (18, 1024, 4096, 384, 128, 1600, 1000, 128),
    }[name]
    m = cfg.model
    assert (
        m.n_layer,
        m.d_model,
        m.d_inner,
        m.tgt_len,
        cfg.eval.tgt_len,
        cfg.eval.mem_len,
        cfg.eval.clamp_len,
        cfg.train.global_batch,
    ) == script
    assert m.mem_len == m.tgt_len and cfg.optim.lr == 2.5e-4 and cfg.optim.grad_clip == 0.25
    with torch.device("meta"):
        built = TransformerXLLM(m)
    counted = sum(p.numel() for p in built.parameters())
    assert counted == architecture_parameters(m)
    if name in PAPER:
        assert abs(counted - PAPER[name]) / PAPER[name] < 0.01, counted


# ---- bits per character -------------------------------------------------------------------------------------


def test_bits_per_character_is_the_loss_in_bits_per_byte_of_a_model_whose_answer_is_known(enwik8, tmp_path):
    """A model whose output ignores its input (zero embedding, tied output weight) predicts the biases' softmax
    p for every byte: its bpc over the scored bytes is -mean(log2 p(byte))."""
    from txl_dist.export import write_export

    model = TransformerXLLM(preset("tiny", n_token=256, cutoffs=[], div_val=1, tgt_len=64, mem_len=64))
    p = np.full(256, 0.25 / 255)
    p[10] = 0.75  # the newline: a prediction that is far from uniform
    with torch.no_grad():
        model.word_emb.emb_layers[0].weight.zero_()
        model.crit.out_layers[0].bias.copy_(torch.from_numpy(np.log(p)))
    export = write_export(model, model.config, tmp_path / "export", tokenizer_dir=enwik8["tokenizer"])
    result = in_process(
        "launchers/evaluate.py",
        str(export),
        "--split",
        "valid",
        "--shards",
        str(enwik8["shards"]),
        "--batch-size",
        "1",
        "--output",
        str(tmp_path / "eval.json"),
        "--no-progress",
    )
    summary = json.loads((tmp_path / "eval.json").read_text())
    stream = read_split(enwik8["shards"], "valid")[0].astype(np.int64)
    targets = stream[1:]  # one stream: every token but the first is predicted
    assert summary["tokens"] == len(targets)
    expected = -np.log2(p[targets]).mean()
    assert summary["bits_per_character"] == pytest.approx(expected, rel=1e-6)  # fp32 log-softmax
    assert summary["bits_per_character"] == pytest.approx(summary["loss"] / math.log(2), rel=1e-12)
    assert "bits/char" in result.stdout


@pytest.mark.launcher
def test_a_character_models_export_evaluates_to_its_checkpoints_bpc(enwik8, tmp_path):
    run_dir = tmp_path / "run"
    run(
        torchrun_command(
            "launchers/train.py",
            [
                "--config",
                "configs/tiny_cpu.yaml",
                f"data.shards={enwik8['shards']}",
                f"train.output_dir={run_dir}",
                "model.cutoffs=[]",
                "model.div_val=1",
                "train.max_steps=10",
                "eval.every=0",
                "checkpoint.every=10",
                "optim.lr=5e-3",
                "log.every=5",
            ],
        )
    )
    logged = records(run_dir)
    assert logged and all(r["bpc"] == pytest.approx(r["loss"] / math.log(2)) for r in logged.values())
    assert "bpc" in records(run_dir, "eval")[10]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {"train/bpc", "eval/bpc"} <= set(events.Tags()["scalars"])
    export = tmp_path / "export"
    in_process("launchers/convert.py", "zero-to-export", str(run_dir), str(export))
    settings = [
        "--split",
        "test",
        "--tgt-len",
        "16",
        "--mem-len",
        "48",
        "--same-length",
        "--batch-size",
        "4",
        "--no-progress",
    ]
    in_process("launchers/evaluate.py", str(export), *settings, "--output", str(tmp_path / "export.json"))
    in_process("launchers/evaluate.py", str(run_dir), *settings, "--output", str(tmp_path / "checkpoint.json"))
    from_export = json.loads((tmp_path / "export.json").read_text())
    from_checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    assert from_export["tokens"] == from_checkpoint["tokens"] == HELD_OUT  # 20,001 tokens, the first unscored
    assert from_export["bits_per_character"] == from_checkpoint["bits_per_character"]
    # --eval-settings: the run config's eval section (tiny_cpu.yaml: tgt_len 8, mem_len 16), from both.
    for source in (export, run_dir):
        in_process(
            "launchers/evaluate.py",
            str(source),
            "--split",
            "valid",
            "--eval-settings",
            "--batch-size",
            "8",
            "--no-progress",
            "--output",
            str(tmp_path / "section.json"),
        )
        section = json.loads((tmp_path / "section.json").read_text())["settings"]
        assert (section["tgt_len"], section["mem_len"]) == (8, 16), source
    # generate.py: a byte model's text is printed (bytes that are not UTF-8 as U+FFFD) and --score gives bpc.
    printed = in_process(
        "launchers/generate.py", str(export), "--prompt", "<page>", "--max-new-tokens", "40", "--seed", "0"
    ).stdout
    assert printed.startswith("<page>") and len(printed) > len("<page>")
    scored = in_process("launchers/generate.py", str(export), "--score", "the", "é").stdout.splitlines()
    assert [line.split()[3] for line in scored] == ["characters"] * 2 and [line.split()[5] for line in scored] == [
        "bpc"
    ] * 2
    assert int(scored[1].split()[2]) == 3  # é: 2 bytes, and the newline that closes a scored text


def test_the_planner_counts_the_long_evaluation_memory():
    from txl_dist import plan

    cfg = load_config(REPO / "configs" / "enwik8_large.yaml")
    layout = plan.plan_memory(cfg, world_size=8)
    terms = {term.name: term for term in layout.terms}
    evaluation = terms["evaluation mems (read and written)"]
    # 16 evaluation streams over 8 ranks: 2 per rank; 25 tensors of 3,800 positions x 1,024 in bf16, twice.
    assert evaluation.phase == "eval" and evaluation.bytes == 2 * 25 * 3800 * 2 * 1024 * 2
    assert layout.peak == layout.phase_total("steady") + max(
        layout.phase_total(p) for p in ("backward", "step", "eval")
    )
    # Where evaluation is the larger phase (many streams per rank, a short training segment), it sets the peak.
    heavy = load_config(REPO / "configs" / "enwik8_large.yaml", ["eval.batch_size=512", "model.tgt_len=16"])
    heavy_layout = plan.plan_memory(heavy, world_size=8, micro_batch=1)
    assert heavy_layout.phase_total("eval") > heavy_layout.phase_total("backward")
    assert heavy_layout.peak == heavy_layout.phase_total("steady") + heavy_layout.phase_total("eval")
    assert (
        plan.main(
            ["--config", str(REPO / "configs" / "enwik8_large.yaml"), "--world-size", "8", "--device-memory", "80GiB"]
        )
        == 0
    )


@pytest.mark.hf
def test_export_to_hub_of_byte_and_char_models_gives_the_same_ids_and_losses(enwik8, tmp_path):
    """The fast tokenizers of a byte and a character model, and the byte model's losses, in current transformers."""
    import os
    import subprocess

    from tests.test_hub_export import HF_PYTHON, SEGMENT, WORKER, _txl_losses, convert
    from txl_dist.export import write_export

    if not HF_PYTHON.is_file():
        pytest.skip(f"{HF_PYTHON}: missing; run `make hf-venv` (or set TXL_HF_PYTHON)")
    chars = tmp_path / "chars.txt"
    chars.write_text(EVERY_UTF8_LENGTH * 2, encoding="utf-8", newline="")
    _train("--kind", "char", "--input", chars, "--output", tmp_path / "tok_char")
    lines = {
        "byte": ["<page> [[Link]] &quot;", "é € 𝄞 日本", "", "  two  spaces\ttab", "Ċ"],
        "char": EVERY_UTF8_LENGTH.split("\n"),
    }
    jobs: dict = {"models": [], "tokenizers": []}
    references: dict = {}
    for kind, directory in (("byte", enwik8["tokenizer"]), ("char", tmp_path / "tok_char")):
        tokenizer = load_tokenizer(directory)
        torch.manual_seed(0)
        model = TransformerXLLM(
            preset("tiny", n_token=tokenizer.vocab_size, cutoffs=[], div_val=1, tgt_len=SEGMENT, mem_len=12)
        ).eval()
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.15)
        export = write_export(model, model.config, tmp_path / f"{kind}_export", tokenizer_dir=directory)
        convert("export-to-hub", str(export), str(tmp_path / kind))
        document = "\n".join(lines[kind][:4])
        jobs["tokenizers"].append(
            {"name": kind, "folder": str(tmp_path / kind), "lines": lines[kind][:4], "document": document}
        )
        data = torch.randint(0, tokenizer.vocab_size, (2, 3 * SEGMENT + 1), generator=torch.Generator().manual_seed(5))
        jobs["models"].append(
            {
                "name": kind,
                "folder": str(tmp_path / kind),
                "data": data.tolist(),
                "segment": SEGMENT,
                "prompt": [tokenizer.eod_id] + tokenizer.encode("ab"),
                "new_tokens": 4,
            }
        )
        references[kind] = {
            "lines": tokenizer.encode_batch(lines[kind][:4]),
            "document": [tokenizer.eod_id] + tokenizer.encode_document(document)[:-1],
            "decoded": tokenizer.decode_document(tokenizer.encode_document(document)[:-1]),
            "losses": _txl_losses(model, data),
        }
    (tmp_path / "jobs.json").write_text(json.dumps(jobs), encoding="utf-8")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    result = subprocess.run(
        [str(HF_PYTHON), "-I", str(WORKER), str(tmp_path / "jobs.json"), str(tmp_path / "out.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    results = torch.load(tmp_path / "out.pt", weights_only=True)
    for kind, reference in references.items():
        found = results["tokenizers"][kind]
        assert found["lines"] == reference["lines"], kind
        assert found["document"] == reference["document"], kind
        assert found["decoded"] == reference["decoded"], kind
        losses = results["models"][kind]["from_logits"]
        assert (losses - reference["losses"]).abs().max().item() <= 1e-5, kind
    assert references["byte"]["lines"][1] == list("é € 𝄞 日本".encode())


def test_generated_bytes_become_text_as_their_characters_complete(enwik8):
    from txl_dist.inference import TextStream

    tokenizer = load_tokenizer(enwik8["tokenizer"])
    stream = TextStream(tokenizer)
    data = "é€\n𝄞x".encode() + b"\xff\xe2\x82"  # then a byte that is not UTF-8, and an unfinished €
    pieces = [stream.push(byte) for byte in data]
    assert pieces[:2] == ["", "é"] and pieces[2:4] == ["", ""]  # nothing printed inside a character
    assert "".join(pieces) + stream.finish() == "é€\n𝄞x\ufffd\ufffd"
