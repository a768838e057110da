"""The Transformer-XL memory of each micro-batch slot: carried from step to step, kept finite, saved by stream id.

Micro-batch slot k of a rank always holds the same global streams, and its rows continue exactly where the
previous step's rows ended, so the memory of slot k (n_layer + 1 tensors [mem_len, micro_batch, d_model]) always
belongs to the text that follows. A stream whose new memory holds inf/nan (an fp16 forward that overflowed) gets a
zero memory instead, counted in the logged ``mems_reset``, so no later segment carries it and no checkpoint
stores it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def finite_mems(mems: list[torch.Tensor], resets: torch.Tensor) -> list[torch.Tensor]:
    """``mems`` (n_layer + 1 tensors [mem_len, B, d_model]) with the columns (streams) that hold inf or nan in any
    layer set to zero -- the memory HuggingFace's Transformer-XL starts from -- and their number added to
    ``resets``; all on the device, without a host synchronisation."""
    finite = torch.stack([m.isfinite().all(dim=2).all(dim=0) for m in mems]).all(dim=0)  # [B]
    resets += (~finite).sum()
    keep = finite.view(1, -1, 1)
    return [torch.where(keep, m, torch.zeros((), dtype=m.dtype, device=m.device)) for m in mems]


class SlotMemories:
    """The memory of each of a rank's ``slots`` micro-batch slots (None: empty), on ``device``."""

    def __init__(self, slots: int, device: torch.device):
        self._mems: list[list[torch.Tensor] | None] = [None] * slots
        self._resets = torch.zeros((), dtype=torch.int64, device=device)
        self._device = device

    def __getitem__(self, slot: int) -> list[torch.Tensor] | None:
        return self._mems[slot]

    def clear(self, slot: int) -> None:
        self._mems[slot] = None

    def update(self, slot: int, mems: list[torch.Tensor]) -> None:
        """The memory a forward returned for ``slot``, with its non-finite streams reset."""
        self._mems[slot] = finite_mems(mems, self._resets)

    def for_checkpoint(self) -> list[torch.Tensor] | None:
        """Every slot's memory, columns in slot order, finite, on the CPU; None while any slot has none."""
        if any(m is None for m in self._mems):
            return None
        layers = [torch.cat([slot[layer] for slot in self._mems], dim=1) for layer in range(len(self._mems[0]))]
        return [layer.cpu() for layer in finite_mems(layers, self._resets)]

    def restore(self, mems_by_stream: dict[int, list[torch.Tensor]], slot_streams: list[list[int]]) -> None:
        """Each slot's memory from a checkpoint's memories by stream id (``slot_streams``: the stream ids of each
        slot); a slot missing any of its streams stays empty."""
        for slot, ids in enumerate(slot_streams):
            if all(i in mems_by_stream for i in ids):
                layers = zip(*(mems_by_stream[i] for i in ids))
                self._mems[slot] = [torch.stack(columns, dim=1).to(self._device) for columns in layers]

    def reset_total(self) -> int:
        """Collective: streams whose memory was reset since this process started, over all ranks."""
        total = self._resets.clone()
        dist.all_reduce(total)
        return int(total.item())
