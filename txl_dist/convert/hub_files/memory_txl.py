"""The memory of Transformer-XL, the cache of `TransformerXLForCausalLM`: per layer, the last positions of its input.

Part of the remote code that `launchers/convert.py export-to-hub` writes beside modeling_txl.py (which see);
it imports torch only.
"""

from __future__ import annotations

import torch


class TransformerXLMemory:
    """The cache of `TransformerXLForCausalLM`: per layer, the last positions of the layer's input.

    ``hidden[i]`` [batch, m, d_model] holds the input of layer i for the last m positions (``hidden[n_layer]`` the
    output of the last layer, as in the paper's memory of n_layer + 1 tensors); ``keys[i]`` and ``values[i]``
    [batch, m, n_head, d_head] are that layer's keys and values of those positions, kept so that a new token does
    not project the memory again; ``attended`` [batch, m] is False at padding; ``seen`` counts the positions read so
    far. Between calls m <= mem_len.
    """

    is_compileable = False
    is_croppable = False

    def __init__(
        self,
        hidden: list[torch.Tensor],
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        attended: torch.Tensor,
        seen: int,
    ):
        self.hidden, self.keys, self.values, self.attended, self.seen = hidden, keys, values, attended, seen

    @property
    def length(self) -> int:
        """Positions held (m)."""
        return self.attended.shape[1]

    @property
    def is_linear(self) -> list[bool]:
        # Read by generate() when a memory is passed in: not a recurrent state of linear layers, so it slices the
        # input_ids it is given after get_seq_length() positions.
        return [False] * len(self.keys)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions read since the memory started (what generate() skips of input_ids it is given again)."""
        return self.seen

    def mems(self) -> list[torch.Tensor]:
        """The memory in txl_dist's layout: n_layer + 1 tensors [m, batch, d_model]."""
        return [h.transpose(0, 1) for h in self.hidden]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep/duplicate batch rows (beam search)."""

        def pick(t: torch.Tensor) -> torch.Tensor:
            return t.index_select(0, beam_idx.to(t.device))

        self.hidden = [pick(t) for t in self.hidden]
        self.keys = [pick(t) for t in self.keys]
        self.values = [pick(t) for t in self.values]
        self.attended = pick(self.attended)

    def __repr__(self) -> str:
        batch = self.attended.shape[0]
        return f"TransformerXLMemory(layers={len(self.keys)}, batch={batch}, positions={self.length}, seen={self.seen})"


def keep_last(memory: torch.Tensor, new: torch.Tensor, keep: int) -> torch.Tensor:
    """The last ``keep`` positions of [B, m, ...] ``memory`` followed by [B, n, ...] ``new``."""
    return torch.cat([memory, new], dim=1)[:, -keep:] if keep else memory[:, :0]


def last_positions(memory: TransformerXLMemory, count: int, seen: int) -> TransformerXLMemory:
    """The memory of the last ``count`` positions of ``memory`` (all when it holds fewer), having read ``seen``."""

    def last(t: torch.Tensor) -> torch.Tensor:
        return t[:, t.shape[1] - min(count, t.shape[1]) :]

    return TransformerXLMemory(
        [last(h) for h in memory.hidden],
        [last(k) for k in memory.keys],
        [last(v) for v in memory.values],
        last(memory.attended),
        seen,
    )
