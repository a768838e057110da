"""Statistics of a shard directory, a full check of it against its manifest, and a look at its documents.

    python -m data_tools.inspect_shards shards/               # per-split statistics from manifest.json
    python -m data_tools.inspect_shards shards/ --verify      # check every shard file (exit status 3 if bad)
    python -m data_tools.inspect_shards shards/ --decode 3    # the first 3 documents of each split, as text

``--verify`` checks, for each shard, its size and sha256, that the tar reads to its end, that its blocks have
the keys, byte offsets and token counts of the manifest, that its documents add up, that every id lies below the
vocabulary size, and that every document is followed by the manifest's ``eod_id``. Each problem names the file.
"""

from __future__ import annotations

import argparse
import sys
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from data_tools.command_line import OneLineParser
from txl_dist.data.format import (
    Manifest,
    ManifestError,
    ShardEntry,
    block_key,
    decode_block,
    read_manifest,
)
from txl_dist.exit_status import USAGE_ERROR, VERDICT, run_command
from txl_dist.fileio import sha256_file
from txl_dist.tokenizer import TokenizerError, load_tokenizer


def read_blocks(path: Path) -> Iterator[tuple[str, int, np.ndarray, np.ndarray]]:
    """``(key, byte offset of its first member, tokens, doc_offsets)`` of each block of a shard, in order."""
    key, offset, sample = None, 0, {}
    with tarfile.open(path, "r:") as archive:
        for member in archive:
            member_key, _, ext = member.name.partition(".")
            if member_key != key:  # a block's members are consecutive: a new key completes the previous block
                if key is not None:
                    yield _block(path, key, offset, sample)
                key, offset, sample = member_key, member.offset, {}
            handle = archive.extractfile(member)
            sample[ext] = handle.read() if handle is not None else b""
    if key is not None:
        yield _block(path, key, offset, sample)


def _block(path: Path, key: str, offset: int, sample: dict[str, bytes]) -> tuple[str, int, np.ndarray, np.ndarray]:
    tokens, doc_offsets = decode_block({"__key__": key, **sample}, str(path))
    return key, offset, tokens, doc_offsets


class _SplitChecker:
    """Checks the shards of one split in order (the eod check carries across shard boundaries)."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.previous_token: int | None = None

    def check(self, path: Path, entry: ShardEntry) -> list[str]:
        if not path.is_file():
            return [f"{path}: missing"]
        problems = []
        size = path.stat().st_size
        if size != entry.bytes:
            problems.append(f"{path}: {size} bytes, the manifest says {entry.bytes} (truncated or replaced)")
        digest = sha256_file(path)
        if digest != entry.sha256:
            problems.append(f"{path}: sha256 {digest} differs from the manifest's {entry.sha256}")
        try:
            problems += self._check_blocks(path, entry)
        except (tarfile.TarError, EOFError, OSError) as error:
            problems.append(f"{path}: truncated or damaged tar ({error})")
        except ManifestError as error:
            problems.append(str(error))
        return problems

    def _check_blocks(self, path: Path, entry: ShardEntry) -> list[str]:
        manifest, problems = self.manifest, []
        eod_id, vocab_size = manifest.tokenizer.eod_id, manifest.tokenizer.vocab_size
        blocks = documents = 0
        for i, (key, offset, tokens, doc_offsets) in enumerate(read_blocks(path)):
            at = f"{path}: block {key}"
            blocks += 1
            documents += len(doc_offsets)
            if i >= entry.blocks:
                continue
            if key != block_key(entry.block_offset + i):
                problems.append(f"{at}: expected key {block_key(entry.block_offset + i)}")
            if offset != entry.block_byte_offsets[i]:
                problems.append(f"{at}: at byte {offset}, the manifest says {entry.block_byte_offsets[i]}")
            if tokens.dtype != np.dtype(manifest.dtype):
                problems.append(f"{at}: dtype {tokens.dtype}, the manifest says {manifest.dtype}")
            if len(tokens) != entry.block_tokens[i]:
                problems.append(f"{at}: {len(tokens)} tokens, the manifest says {entry.block_tokens[i]}")
            if len(tokens) and int(tokens.max()) >= vocab_size:
                problems.append(f"{at}: token id {int(tokens.max())} >= vocab_size {vocab_size}")
            if len(doc_offsets) and (
                doc_offsets[0] < 0 or doc_offsets[-1] >= len(tokens) or np.any(np.diff(doc_offsets) <= 0)
            ):
                problems.append(f"{at}: doc_offsets must increase within [0, {len(tokens)})")
            else:
                before = [int(tokens[o - 1]) if o > 0 else self.previous_token for o in doc_offsets]
                if any(token is not None and token != eod_id for token in before):
                    problems.append(f"{at}: a document is not preceded by eod_id {eod_id}")
            if len(tokens):
                self.previous_token = int(tokens[-1])
        if blocks != entry.blocks:
            problems.append(f"{path}: {blocks} blocks, the manifest says {entry.blocks}")
        if documents != entry.documents:
            problems.append(f"{path}: {documents} documents begin here, the manifest says {entry.documents}")
        return problems


def verify_shards(directory: str | Path, progress: bool = False) -> list[str]:
    """Every problem of a shard directory, each naming its file (an empty list: all is well)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    total = sum(s.bytes for split in manifest.splits.values() for s in split.shards)
    problems = []
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", file=sys.stderr, disable=not progress) as bar:
        for name, split in manifest.splits.items():
            checker = _SplitChecker(manifest)
            for entry in split.shards:
                problems += checker.check(directory / entry.path, entry)
                bar.update(entry.bytes)
            if split.tokens and checker.previous_token != manifest.tokenizer.eod_id:
                problems.append(
                    f"{directory / split.shards[-1].path}: split {name} does not end with eod_id "
                    f"{manifest.tokenizer.eod_id}"
                )
    return problems


def _readable_blocks(path: Path) -> Iterator[tuple[str, int, np.ndarray, np.ndarray]]:
    """`read_blocks`, with a damaged or missing shard raised as ManifestError naming it."""
    try:
        yield from read_blocks(path)
    except (tarfile.TarError, EOFError, OSError) as error:
        raise ManifestError(f"{path}: truncated or damaged shard ({error}); --verify checks every shard") from None


def first_documents(directory: str | Path, manifest: Manifest, split: str, count: int) -> list[np.ndarray]:
    """The ids of the first ``count`` documents of a split (separators included)."""
    documents: list[np.ndarray] = []
    current: list[np.ndarray] = []
    for entry in manifest.splits[split].shards:
        for _, _, tokens, doc_offsets in _readable_blocks(Path(directory) / entry.path):
            bounds = [0, *doc_offsets.tolist(), len(tokens)]
            for start, end, begins in zip(bounds[:-1], bounds[1:], [False] + [True] * len(doc_offsets)):
                if begins and current:
                    documents.append(np.concatenate(current))
                    current = []
                    if len(documents) == count:
                        return documents
                if end > start:
                    current.append(tokens[start:end])
    if current and len(documents) < count:
        documents.append(np.concatenate(current))
    return documents


def statistics_table(manifest: Manifest) -> str:
    header = (
        "split",
        "shards",
        "blocks",
        "documents",
        "tokens",
        "words",
        "characters",
        "MB",
        "tokens/doc",
        "tokens/word",
    )
    rows = [header]
    for name, split in manifest.splits.items():
        megabytes = sum(s.bytes for s in split.shards) / 1e6
        rows.append(
            (
                name,
                f"{len(split.shards):,}",
                f"{split.blocks:,}",
                f"{split.documents:,}",
                f"{split.tokens:,}",
                f"{split.words:,}",
                f"{split.characters:,}",
                f"{megabytes:.1f}",
                f"{split.tokens / max(split.documents, 1):.1f}",
                f"{split.tokens / max(split.words, 1):.3f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.rjust(width) if i else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths)))
        for row in rows
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(
        name="inspect_shards",
        prog="python -m data_tools.inspect_shards",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", type=Path, help="a shard directory (with manifest.json)")
    parser.add_argument("--verify", action="store_true", help="check every shard file against the manifest")
    parser.add_argument("--decode", type=int, default=0, metavar="N", help="print the first N documents of each split")
    parser.add_argument("--tokenizer", type=Path, help="tokenizer for --decode (default: the one the build recorded)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        manifest = read_manifest(args.directory)
        tokenizer_identity = manifest.tokenizer
        print(
            f"{args.directory}: {tokenizer_identity.kind} tokenizer, vocab_size {tokenizer_identity.vocab_size}, "
            f"fingerprint {tokenizer_identity.fingerprint[:16]}..., eos_id {tokenizer_identity.eos_id}, "
            f"eod_id {tokenizer_identity.eod_id}, dtype {manifest.dtype}, block_tokens {manifest.block_tokens}"
        )
        print(statistics_table(manifest))
        if args.decode:
            directory = args.tokenizer or manifest.build.get("tokenizer_directory")
            if directory is None:
                raise TokenizerError("--decode needs --tokenizer DIR (the manifest records none)")
            tokenizer = load_tokenizer(directory)
            if tokenizer.fingerprint != tokenizer_identity.fingerprint:
                raise TokenizerError(
                    f"{directory}: fingerprint {tokenizer.fingerprint} is not the shards' "
                    f"{tokenizer_identity.fingerprint}"
                )
            for split in manifest.splits:
                for number, ids in enumerate(first_documents(args.directory, manifest, split, args.decode)):
                    print(f"--- {split} document {number} ({len(ids)} tokens)")
                    # A byte tokenizer's text holds bytes that are not UTF-8 as lone surrogates: print them as U+FFFD.
                    text = tokenizer.decode_document(ids.tolist())
                    print(text.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
        if args.verify:
            problems = verify_shards(args.directory, progress=args.progress)
            for problem in problems:
                print(f"FAIL {problem}")
            shards = sum(len(split.shards) for split in manifest.splits.values())
            print(
                f"verify: {'all' if not problems else 'NOT all'} of {shards} shards match the manifest"
                + (f" ({len(problems)} problems)" if problems else "")
            )
            return VERDICT if problems else 0  # the check ran and found problems: not a failure to run it
    except (ManifestError, TokenizerError) as error:
        print(f"inspect_shards: error: {error}", file=sys.stderr)
        return USAGE_ERROR
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "inspect_shards"))
