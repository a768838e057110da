"""TrainStreams: partition, continuity, shuffling, exact and elastic resume, shard errors, pipe: URLs, gloo ranks.

The shards hold synthetic tokens whose value is their position in the split (tests/synthetic_shards.py), so the
expected stream contents follow from the partition rule of docs/architecture.md (Streams) by plain arithmetic.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.synthetic_shards import FINGERPRINT, write_position_shards
from txl_dist.data import ManifestError, ResumeKind, ShardError, StreamStateError, TrainStreams
from txl_dist.data.format import read_manifest, write_manifest

TRAIN_TOKENS = 30011
VALID_TOKENS = 5003


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("shards")
    write_position_shards(directory, {"train": TRAIN_TOKENS, "valid": VALID_TOKENS})
    return directory


def epoch_order(directory: Path, split: str, seed: int, epoch: int) -> np.ndarray:
    """The split's positions in the order of DESIGN's seeded block permutation for ``epoch``."""
    block_tokens = np.array([n for s in read_manifest(directory).splits[split].shards for n in s.block_tokens])
    starts = np.concatenate([[0], np.cumsum(block_tokens)])
    permutation = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(block_tokens.size)
    return np.concatenate([np.arange(starts[b], starts[b + 1]) for b in permutation])


def take(iterator, count: int) -> list:
    return list(itertools.islice(iterator, count))


def rows_by_stream(batches) -> dict[int, list[np.ndarray]]:
    """stream id -> its input rows, in the order read."""
    rows: dict[int, list[np.ndarray]] = {}
    for batch in batches:
        for row, stream in enumerate(batch.stream_ids.tolist()):
            rows.setdefault(stream, []).append(batch.inputs[row].numpy())
    return rows


def consumed_inputs(batches) -> np.ndarray:
    return np.concatenate([batch.inputs.reshape(-1).numpy() for batch in batches])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_one_epoch_reads_every_token_once_in_contiguous_streams(shards, world_size):
    micro_batch, grad_accum, tgt_len = 3, 2, 7
    num_streams = world_size * micro_batch * grad_accum
    tokens_per_stream = TRAIN_TOKENS // num_streams
    steps = (tokens_per_stream - 1) // tgt_len
    batches, ids_by_rank = [], []
    for rank in range(world_size):
        with TrainStreams(
            shards,
            "train",
            tgt_len=tgt_len,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            world_size=world_size,
            rank=rank,
        ) as streams:
            assert (streams.num_streams, streams.steps_per_epoch) == (num_streams, steps)
            iterator = iter(streams)
            rank_batches = take(iterator, steps * grad_accum)
            following = next(iterator)
            ids_by_rank.append([streams.stream_ids(slot) for slot in range(grad_accum)])
            dropped = streams.dropped_tail_tokens
        assert (following.epoch, following.step, following.reset_mems) == (1, 0, True)
        for index, batch in enumerate(rank_batches):
            assert batch.inputs.shape == batch.targets.shape == (micro_batch, tgt_len)
            assert batch.inputs.dtype == batch.targets.dtype == torch.int64
            assert (batch.slot, batch.step, batch.epoch) == (index % grad_accum, index // grad_accum, 0)
            assert batch.reset_mems == (index < grad_accum)
            assert batch.stream_ids.tolist() == ids_by_rank[rank][batch.slot]
            assert torch.equal(batch.targets, batch.inputs + 1)
        batches += rank_batches

    # Rank r owns consecutive ids, slot by slot; together the ranks own every stream once.
    flat_ids = [s for rank_ids in ids_by_rank for slot_ids in rank_ids for s in slot_ids]
    assert flat_ids == list(range(num_streams))
    rows = rows_by_stream(batches)
    for stream, windows in rows.items():
        # Row b of step t+1 starts at the token after row b of step t: the windows tile the stream.
        assert np.array_equal(
            np.concatenate(windows), np.arange(stream * tokens_per_stream, stream * tokens_per_stream + steps * tgt_len)
        )
    inputs = consumed_inputs(batches)
    assert np.unique(inputs).size == inputs.size == TRAIN_TOKENS - dropped
    assert dropped == TRAIN_TOKENS - num_streams * steps * tgt_len


def test_shuffled_epochs_follow_their_seeded_block_order(shards):
    micro_batch, tgt_len, seed, world_size = 2, 9, 5, 2
    num_streams = world_size * micro_batch
    tokens_per_stream = TRAIN_TOKENS // num_streams
    steps = (tokens_per_stream - 1) // tgt_len
    batches = []
    for rank in range(world_size):
        streams = TrainStreams(
            shards,
            "train",
            tgt_len=tgt_len,
            micro_batch=micro_batch,
            grad_accum=1,
            world_size=world_size,
            rank=rank,
            seed=seed,
            shuffle_blocks=True,
        )
        batches.append(take(iter(streams), 2 * steps))
    orders = [epoch_order(shards, "train", seed, epoch) for epoch in (0, 1)]
    assert not np.array_equal(orders[0], orders[1])
    for epoch, order in enumerate(orders):
        epoch_batches = [b for rank_batches in batches for b in rank_batches if b.epoch == epoch]
        for stream, windows in rows_by_stream(epoch_batches).items():
            start = stream * tokens_per_stream
            assert np.array_equal(np.concatenate(windows), order[start : start + steps * tgt_len])
        inputs = consumed_inputs(epoch_batches)
        assert np.unique(inputs).size == inputs.size == num_streams * steps * tgt_len


def assert_same_batches(expected, got):
    assert len(expected) == len(got)
    for a, b in zip(expected, got):
        assert (a.slot, a.epoch, a.step, a.reset_mems) == (b.slot, b.epoch, b.step, b.reset_mems)
        for field in ("inputs", "targets", "stream_ids"):
            assert torch.equal(getattr(a, field), getattr(b, field)), field


def test_exact_resume_gives_the_next_100_windows(shards):
    kwargs = dict(tgt_len=5, micro_batch=2, grad_accum=2, world_size=2, rank=1, seed=7, shuffle_blocks=True)
    original = TrainStreams(shards, "train", **kwargs)
    iterator = iter(original)
    # Stop 10 steps before the end of the epoch, so that the 100 windows (50 steps) cross into epoch 1.
    take(iterator, (original.steps_per_epoch - 10) * 2)
    state = json.loads(json.dumps(original.state_dict()))
    expected = take(iterator, 100)
    assert {b.epoch for b in expected} == {0, 1}

    resumed = TrainStreams(shards, "train", **kwargs)
    assert resumed.load_state_dict(state) == ResumeKind.EXACT
    assert_same_batches(expected, take(iter(resumed), 100))


def test_a_step_handed_out_in_part_is_handed_out_again_after_a_resume(shards):
    kwargs = dict(tgt_len=5, micro_batch=2, grad_accum=2, world_size=1, rank=0)
    streams = TrainStreams(shards, "train", **kwargs)
    iterator = iter(streams)
    first_slot = next(iterator)
    state = streams.state_dict()
    assert (state["step"], state["position"]) == (0, 0)
    resumed = TrainStreams(shards, "train", **kwargs)
    resumed.load_state_dict(state)
    assert_same_batches([first_slot, next(iterator)], take(iter(resumed), 2))
    assert streams.state_dict()["step"] == 1
    # One iterator at a time: a newer one ends the older, whose buffers no longer match the position.
    newer = iter(streams)
    assert next(newer).step == 1
    with pytest.raises(RuntimeError, match="superseded"):
        next(iterator)


def test_world_2_to_1_with_the_same_streams_continues_every_stream_exactly(shards):
    common = dict(tgt_len=6, seed=1, shuffle_blocks=True)
    old = [TrainStreams(shards, "train", micro_batch=2, grad_accum=2, world_size=2, rank=r, **common) for r in (0, 1)]
    iterators = [iter(streams) for streams in old]
    for iterator in iterators:
        take(iterator, 37 * 2)
    states = [streams.state_dict() for streams in old]
    assert states[0] == states[1]
    expected = rows_by_stream([b for iterator in iterators for b in take(iterator, 20 * 2)])

    merged = TrainStreams(shards, "train", micro_batch=4, grad_accum=2, world_size=1, rank=0, **common)
    assert merged.num_streams == old[0].num_streams
    assert merged.load_state_dict(states[0]) == ResumeKind.EXACT
    batches = take(iter(merged), 20 * 2)
    assert not any(b.reset_mems for b in batches) and batches[0].step == 37
    got = rows_by_stream(batches)
    assert sorted(got) == sorted(expected)
    for stream in expected:
        assert all(np.array_equal(a, b) for a, b in zip(expected[stream], got[stream], strict=True))


def run_until_epoch_ends(loaders) -> list:
    """Every batch of the current epoch, from every rank's loader; each loader is left at the next epoch's start."""
    batches = []
    for streams in loaders:
        epoch = streams.epoch
        for batch in streams:
            batches.append(batch)
            if streams.epoch != epoch:
                break
    return batches


@pytest.mark.parametrize("old_shape, new_shape", [((2, 3, 1), (1, 4, 1)), ((1, 2, 2), (2, 5, 1))])
def test_other_stream_count_repartitions_the_rest_of_the_epoch(shards, old_shape, new_shape):
    tgt_len, steps_before = 7, 300

    def loaders(shape):
        world_size, micro_batch, grad_accum = shape
        return [
            TrainStreams(
                shards,
                "train",
                tgt_len=tgt_len,
                micro_batch=micro_batch,
                grad_accum=grad_accum,
                world_size=world_size,
                rank=rank,
            )
            for rank in range(world_size)
        ]

    old = loaders(old_shape)
    before = [b for streams in old for b in take(iter(streams), steps_before * streams.grad_accum)]
    state = old[0].state_dict()
    assert state["tokens_consumed"] == consumed_inputs(before).size

    new = loaders(new_shape)
    assert {streams.load_state_dict(state) for streams in new} == {ResumeKind.REPARTITIONED}
    after = run_until_epoch_ends(new)
    assert after[0].reset_mems and after[0].step == steps_before
    assert not any(b.reset_mems for b in after if b.step > steps_before)

    inputs = np.concatenate([consumed_inputs(before), consumed_inputs(after)])
    assert np.unique(inputs).size == inputs.size  # no token is used twice
    num_streams = new[0].num_streams
    remaining = TRAIN_TOKENS - consumed_inputs(before).size
    steps_after = (remaining // num_streams - 1) // tgt_len
    # Nothing is skipped beyond the new partition's own tail.
    assert consumed_inputs(after).size == num_streams * steps_after * tgt_len
    # Inside a new stream the text is contiguous except where two old streams' rests meet.
    jumps = sum(int(np.sum(np.diff(np.concatenate(windows)) != 1)) for windows in rows_by_stream(after).values())
    assert jumps <= old[0].num_streams

    # The next epoch is a fresh partition with the new number of streams (unshuffled: the same as epoch 0).
    for streams, fresh in zip(new, loaders(new_shape)):
        next_epoch, first_epoch = take(iter(streams), 4), take(iter(fresh), 4)
        assert {b.epoch for b in next_epoch} == {1}
        for batch in next_epoch:
            batch.epoch = 0
        assert_same_batches(first_epoch, next_epoch)


def test_repartitioning_twice_in_one_epoch_still_uses_no_token_twice(shards):
    def loader(micro_batch):
        return TrainStreams(
            shards,
            "train",
            tgt_len=5,
            micro_batch=micro_batch,
            grad_accum=1,
            world_size=1,
            rank=0,
            seed=3,
            shuffle_blocks=True,
        )

    first = loader(6)
    batches = take(iter(first), 400)
    second = loader(4)
    assert second.load_state_dict(first.state_dict()) == ResumeKind.REPARTITIONED
    batches += take(iter(second), 500)
    third = loader(5)
    assert third.load_state_dict(second.state_dict()) == ResumeKind.REPARTITIONED
    batches += run_until_epoch_ends([third])
    assert {b.epoch for b in batches} == {0}
    inputs = consumed_inputs(batches)
    assert np.unique(inputs).size == inputs.size
    assert set(inputs.tolist()) <= set(epoch_order(shards, "train", 3, 0).tolist())
    remaining = TRAIN_TOKENS - second.state_dict()["tokens_consumed"] - 500 * 4 * 5
    assert inputs.size == TRAIN_TOKENS - remaining + 5 * 5 * ((remaining // 5 - 1) // 5)


def test_other_tgt_len_with_the_same_streams_continues_at_the_same_token(shards):
    old = TrainStreams(shards, "train", tgt_len=7, micro_batch=2, grad_accum=1, world_size=1, rank=0)
    before = take(iter(old), 100)
    new = TrainStreams(shards, "train", tgt_len=5, micro_batch=2, grad_accum=1, world_size=1, rank=0)
    assert new.load_state_dict(old.state_dict()) == ResumeKind.EXACT
    after = run_until_epoch_ends([new])
    assert after[0].step == 100 and not after[0].reset_mems
    tokens_per_stream = TRAIN_TOKENS // 2
    steps_after = (tokens_per_stream - 1 - 700) // 5
    for stream, windows in rows_by_stream(before + after).items():
        start = stream * tokens_per_stream
        assert np.array_equal(np.concatenate(windows), np.arange(start, start + 700 + 5 * steps_after))


def copy_with_manifest(shards: Path, directory: Path, **changes) -> Path:
    """A copy of the shard directory whose manifest has ``changes`` applied (tokenizer fields or shard paths)."""
    shutil.copytree(shards, directory)
    manifest = read_manifest(directory)
    for key, value in changes.items():
        if key == "paths":
            for split in manifest.splits.values():
                for shard in split.shards:
                    shard.path = value(directory / shard.path)
        else:
            setattr(manifest.tokenizer, key, value)
    write_manifest(directory, manifest)
    return directory


def test_states_of_another_split_tokenizer_shard_set_or_seed_are_refused(shards, tmp_path):
    kwargs = dict(tgt_len=5, micro_batch=2, grad_accum=1, world_size=1, rank=0)
    streams = TrainStreams(shards, "train", **kwargs)
    take(iter(streams), 3)
    state = streams.state_dict()
    with pytest.raises(StreamStateError, match="key 'split' is 'train', this loader has 'valid'"):
        TrainStreams(shards, "valid", **kwargs).load_state_dict(state)
    retokenized = copy_with_manifest(shards, tmp_path / "retokenized", fingerprint="b" * 64)
    with pytest.raises(StreamStateError, match="key 'tokenizer_fingerprint' is 'a{64}', this loader has 'b{64}'"):
        TrainStreams(retokenized, "train", **kwargs).load_state_dict(state)
    rebuilt = tmp_path / "rebuilt"
    write_position_shards(rebuilt, {"train": TRAIN_TOKENS}, seed=1)
    with pytest.raises(StreamStateError, match="key 'manifest_id'.*other shards than those of .*rebuilt"):
        TrainStreams(rebuilt, "train", **kwargs).load_state_dict(state)
    # The seed orders the blocks of a shuffled split only: a shuffled state refuses another seed, an ordered one not.
    shuffled = TrainStreams(shards, "train", shuffle_blocks=True, **kwargs)
    take(iter(shuffled), 3)
    with pytest.raises(StreamStateError, match="key 'seed' is 0, this loader has 4"):
        TrainStreams(shards, "train", seed=4, shuffle_blocks=True, **kwargs).load_state_dict(shuffled.state_dict())
    assert TrainStreams(shards, "train", seed=4, **kwargs).load_state_dict(state) == ResumeKind.EXACT
    with pytest.raises(StreamStateError, match="key 'layout_spans'"):
        streams.load_state_dict({**state, "layout_spans": [[0, TRAIN_TOKENS + 1]]})
    # A state of the other shuffle setting would read the epoch's blocks in another order.
    with pytest.raises(
        StreamStateError,
        match="key 'shuffle_blocks' is False, this loader has True: the epoch's block order would differ",
    ):
        TrainStreams(shards, "train", shuffle_blocks=True, **kwargs).load_state_dict(state)
    with pytest.raises(StreamStateError, match="key 'shuffle_blocks' is True, this loader has False"):
        TrainStreams(shards, "train", **kwargs).load_state_dict(shuffled.state_dict())
    # Moving the shards behind pipe: URLs does not change what a position refers to.
    piped = copy_with_manifest(shards, tmp_path / "piped", paths=lambda path: f"pipe:cat {path}")
    assert TrainStreams(piped, "train", **kwargs).load_state_dict(state) == ResumeKind.EXACT


def test_states_that_are_not_stream_states_or_point_past_the_streams_are_refused(shards):
    kwargs = dict(tgt_len=5, micro_batch=2, grad_accum=1, world_size=1, rank=0)
    streams = TrainStreams(shards, "train", **kwargs)
    take(iter(streams), 3)
    state = streams.state_dict()
    fresh = TrainStreams(shards, "train", **kwargs)
    for bad, message in (
        (["not", "a", "dict"], "not a stream state: key 'format' must be 'txl_dist.streams'"),
        ({**state, "format": "other.streams"}, "not a stream state: key 'format' must be 'txl_dist.streams'"),
        ({**state, "version": 2}, "stream state: version 2, this reader reads 1"),
        ({k: v for k, v in state.items() if k != "version"}, "stream state: version None, this reader reads 1"),
        ({**state, "num_streams": 0}, "key 'num_streams' must be a positive integer, got 0"),
        ({**state, "tgt_len": "5"}, "key 'tgt_len' must be a positive integer, got '5'"),
        ({**state, "position": -5}, "key 'position' must be a non-negative integer, got -5"),
        ({**state, "epoch": None}, "key 'epoch' must be a non-negative integer, got None"),
        ({**state, "layout_spans": []}, "key 'layout_spans' must be a non-empty list"),
        ({**state, "layout_spans": [[0, 100], [50, 200]]}, r"key 'layout_spans' has \[50, 200\]"),
    ):
        with pytest.raises(StreamStateError, match=message):
            fresh.load_state_dict(bad)
    # The streams of that state hold TRAIN_TOKENS // 2 tokens each: a position past them is no place to continue.
    per_stream = TRAIN_TOKENS // 2
    with pytest.raises(
        StreamStateError, match=f"position {per_stream + 1} lies beyond the streams' {per_stream} tokens"
    ):
        fresh.load_state_dict({**state, "position": per_stream + 1})
    # A refused state changes nothing: the loader still reads from the start.
    assert_same_batches(take(iter(TrainStreams(shards, "train", **kwargs)), 4), take(iter(fresh), 4))


def test_a_tokenizer_other_than_the_configured_one_is_refused(shards):
    with pytest.raises(
        ManifestError,
        match=f"{shards}/manifest.json: tokenizer fingerprint {FINGERPRINT} differs "
        f"from the configured tokenizer's {'c' * 64}",
    ):
        TrainStreams(
            shards, "train", tgt_len=5, micro_batch=2, grad_accum=1, world_size=1, rank=0, expected_fingerprint="c" * 64
        )
    with pytest.raises(ManifestError, match="no split 'test'; it has \\['train', 'valid'\\]"):
        TrainStreams(shards, "test", tgt_len=5, micro_batch=2, grad_accum=1, world_size=1, rank=0)


def read_whole_epoch(directory: Path, **kwargs) -> list:
    streams = TrainStreams(directory, "valid", tgt_len=5, micro_batch=4, grad_accum=1, world_size=1, rank=0, **kwargs)
    return take(iter(streams), streams.steps_per_epoch)


def test_missing_truncated_and_altered_shards_are_named(shards, tmp_path):
    broken = shutil.copytree(shards, tmp_path / "missing")
    (broken / "valid-000001.tar").unlink()
    with pytest.raises(ShardError, match=f"{broken}/valid-000001.tar: shard missing"):
        read_whole_epoch(broken)

    broken = shutil.copytree(shards, tmp_path / "truncated")
    path = broken / "valid-000001.tar"
    path.write_bytes(path.read_bytes()[:-3000])
    with pytest.raises(ShardError, match=f"{path}: shard is \\d+ bytes, .* says \\d+ \\(truncated\\)"):
        read_whole_epoch(broken)

    # Same size, a damaged tar header in the middle: found when its block is read.
    broken = shutil.copytree(shards, tmp_path / "header")
    path = broken / "valid-000001.tar"
    offset = read_manifest(broken).splits["valid"].shards[1].block_byte_offsets[3]
    data = bytearray(path.read_bytes())
    data[offset : offset + 512] = b"\x07" * 512
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=f"{path}: bad tar header at byte {offset}"):
        read_whole_epoch(broken)

    # Same size, one token changed: only the sha256 check sees it.
    broken = shutil.copytree(shards, tmp_path / "altered")
    path = broken / "valid-000001.tar"
    entry = read_manifest(broken).splits["valid"].shards[1]
    data = bytearray(path.read_bytes())
    # doc_offsets header and data, tokens header, the 128-byte .npy header: then the first token.
    data[entry.block_byte_offsets[0] + 3 * 512 + 128 + 1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert len(read_whole_epoch(broken)) > 0
    with pytest.raises(
        ShardError, match=f"{path}: sha256 mismatch: .* expects {entry.sha256}, the file has [0-9a-f]{{64}}"
    ):
        read_whole_epoch(broken, verify_sha256=True)


def test_pipe_urls_read_the_same_windows_as_local_files(shards, tmp_path):
    piped = copy_with_manifest(shards, tmp_path / "piped", paths=lambda path: f"pipe:cat {path}")
    for shuffle in (False, True):
        local = read_whole_epoch(shards, shuffle_blocks=shuffle, verify_sha256=True)
        assert_same_batches(local, read_whole_epoch(piped, shuffle_blocks=shuffle, verify_sha256=True))


def test_broken_pipe_shards_are_named(shards, tmp_path):
    piped = copy_with_manifest(shards, tmp_path / "missing", paths=lambda path: f"pipe:cat {path}.gone")
    with pytest.raises(ShardError, match=f"pipe:cat {piped}/valid-000000.tar.gone"):
        read_whole_epoch(piped)
    piped = copy_with_manifest(shards, tmp_path / "truncated", paths=lambda path: f"pipe:head -c 5000 {path}")
    with pytest.raises(ShardError, match=f"pipe:head -c 5000 {piped}/valid-000000.tar"):
        read_whole_epoch(piped)


def gloo_rank(rank: int, world_size: int, shards: Path, init_file: Path, out: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    streams = TrainStreams(
        shards, "train", tgt_len=7, micro_batch=3, grad_accum=2, world_size=dist.get_world_size(), rank=dist.get_rank()
    )
    batches = take(iter(streams), streams.steps_per_epoch * 2)
    inputs = torch.stack([b.inputs for b in batches])  # [steps * grad_accum, micro_batch, tgt_len]
    ids = torch.stack([b.stream_ids for b in batches])
    gathered_inputs = [torch.empty_like(inputs) for _ in range(world_size)]
    gathered_ids = [torch.empty_like(ids) for _ in range(world_size)]
    dist.all_gather(gathered_inputs, inputs)
    dist.all_gather(gathered_ids, ids)
    if rank == 0:
        np.savez(out, inputs=torch.stack(gathered_inputs).numpy(), ids=torch.stack(gathered_ids).numpy())
    dist.barrier()
    dist.destroy_process_group()


def test_two_gloo_processes_read_disjoint_streams_covering_the_split(shards, tmp_path):
    out = tmp_path / "gathered.npz"
    mp.spawn(gloo_rank, args=(2, shards, tmp_path / "init", out), nprocs=2, join=True)
    gathered = np.load(out)
    inputs, ids = gathered["inputs"], gathered["ids"]  # [rank, step*slot, row, tgt_len], [rank, step*slot, row]
    num_streams, tgt_len = 12, 7
    tokens_per_stream = TRAIN_TOKENS // num_streams
    steps = (tokens_per_stream - 1) // tgt_len
    assert set(ids[0].ravel()).isdisjoint(ids[1].ravel())
    for stream in range(num_streams):
        rank, index, row = (array[0] for array in np.nonzero(ids == stream))
        windows = inputs[rank, index::2, row]  # this stream's rows in step order (grad_accum 2)
        assert np.array_equal(
            windows.ravel(), np.arange(stream * tokens_per_stream, stream * tokens_per_stream + steps * tgt_len)
        )
    assert np.unique(inputs).size == inputs.size == num_streams * steps * tgt_len


def test_penn_treebank_streams_tile_the_real_token_stream(ptb_word_shards, ptb_word_tokenizer):
    """On real shards from data_tools: the windows of every stream, over both ranks, are exactly the PTB token
    stream (each sentence's words, then <eos>) cut as docs/architecture.md (Streams) says."""
    import treebank

    from txl_dist.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ptb_word_tokenizer)
    expected = [
        i
        for line in treebank.penn["train"].split("\n")
        if line.strip()
        for i in tokenizer.encode(line) + [tokenizer.eos_id]
    ]
    tgt_len, micro_batch, grad_accum, world_size = 32, 4, 2, 2
    n_streams = world_size * micro_batch * grad_accum
    per_stream = len(expected) // n_streams
    inputs: dict[int, list[int]] = {}
    last_target: dict[int, int] = {}
    for rank in range(world_size):
        with TrainStreams(
            ptb_word_shards,
            "train",
            tgt_len=tgt_len,
            micro_batch=micro_batch,
            grad_accum=grad_accum,
            world_size=world_size,
            rank=rank,
            expected_fingerprint=tokenizer.fingerprint,
            verify_sha256=True,
        ) as streams:
            assert streams.num_tokens == len(expected)
            steps = streams.steps_per_epoch
            batches = iter(streams)
            for _ in range(steps * grad_accum):
                batch = next(batches)
                assert torch.equal(batch.targets[:, :-1], batch.inputs[:, 1:])
                for row, stream in enumerate(batch.stream_ids.tolist()):
                    inputs.setdefault(stream, []).extend(batch.inputs[row].tolist())
                    last_target[stream] = batch.targets[row, -1].item()
    assert sorted(inputs) == list(range(n_streams))
    for stream, tokens in inputs.items():
        start = stream * per_stream
        assert tokens == expected[start : start + steps * tgt_len], stream
        assert last_target[stream] == expected[start + steps * tgt_len], stream
