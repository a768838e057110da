"""EvalStreams: one pass in which every target token is scored exactly once across ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tests.synthetic_shards import write_position_shards
from txl_dist.data import EvalStreams
from txl_dist.data.stream_rows import BUFFER_TOKENS as _BUFFER_TOKENS

# "long" gives every stream more tokens than a row buffer holds (_BUFFER_TOKENS, about 16k), so rows are refilled
# several times, the last time in part.
SPLIT_TOKENS = {"valid": 5003, "tiny": 6, "long": 60001}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("eval_shards")
    # A 16-bit vocabulary: these shards store uint16 tokens (the training tests use uint32).
    assert write_position_shards(directory, SPLIT_TOKENS, seed=2, vocab_size=2**16).dtype == "uint16"
    return directory


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    "split, batch_size, tgt_len", [("valid", 3, 7), ("valid", 4, 50), ("tiny", 4, 3), ("long", 1, 7), ("long", 1, 50)]
)
def test_every_target_is_scored_exactly_once_across_ranks(shards, world_size, split, batch_size, tgt_len):
    num_tokens = SPLIT_TOKENS[split]
    if split == "long":  # the premise of these cases: at least one refill of every row
        assert (num_tokens - 1) // (world_size * batch_size) > _BUFFER_TOKENS + 1
    scored, step_counts, target_counts = [], set(), 0
    for rank in range(world_size):
        with EvalStreams(
            shards, split, tgt_len=tgt_len, batch_size=batch_size, world_size=world_size, rank=rank
        ) as streams:
            batches = list(streams)
        assert len(batches) == streams.num_steps
        step_counts.add(streams.num_steps)
        target_counts += streams.num_targets
        assert [b.reset_mems for b in batches] == [True] + [False] * (len(batches) - 1)
        assert [b.step for b in batches] == list(range(len(batches)))
        rank_scored = 0
        for batch in batches:
            assert batch.inputs.shape == batch.targets.shape == batch.mask.shape == (batch_size, tgt_len)
            assert batch.mask.dtype == torch.bool
            assert batch.stream_ids.tolist() == list(range(rank * batch_size, (rank + 1) * batch_size))
            assert torch.equal(batch.targets[batch.mask], batch.inputs[batch.mask] + 1)
            rank_scored += int(batch.mask.sum())
            scored.append(batch.targets[batch.mask].numpy())
        assert rank_scored == streams.num_targets
        for row in range(batch_size):
            mask = torch.cat([b.mask[row] for b in batches]).numpy()
            inputs = torch.cat([b.inputs[row] for b in batches]).numpy()
            # Scored positions are a prefix of the row, and the row's inputs there are one contiguous span.
            assert not np.any(mask[1:] & ~mask[:-1])
            assert np.all(np.diff(inputs[mask]) == 1)
    # Every rank runs the same number of forwards (ZeRO-3), enough for the longest stream.
    targets_per_stream = -(-(num_tokens - 1) // (world_size * batch_size))
    assert step_counts == {-(-targets_per_stream // tgt_len)}
    assert target_counts == num_tokens - 1
    assert np.array_equal(np.sort(np.concatenate(scored)), np.arange(1, num_tokens))
