"""How an epoch's token order is cut into streams: the spans a layout concatenates, its windows, and what is left.

The partition and the resume rule it serves are described in `txl_dist.data.streams`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np


@dataclasses.dataclass
class StreamSpans:
    """The token sequence an epoch's streams are cut from: spans of the epoch order, concatenated.

    A fresh epoch is one span, the whole split; after a re-partition it is the unconsumed spans of the old streams.
    """

    spans: list[tuple[int, int]]
    num_streams: int

    def __post_init__(self) -> None:
        lengths = np.array([end - start for start, end in self.spans], dtype=np.int64)
        self._span_starts = np.zeros(len(self.spans) + 1, dtype=np.int64)
        np.cumsum(lengths, out=self._span_starts[1:])
        self.total = int(self._span_starts[-1])
        self.tokens_per_stream = self.total // self.num_streams

    def windows_left(self, position: int, tgt_len: int) -> int:
        """Windows of tgt_len + 1 tokens that still fit in every stream from ``position`` on."""
        return max(0, (self.tokens_per_stream - 1 - position) // tgt_len)

    def stream_start(self, stream: int) -> int:
        return stream * self.tokens_per_stream

    def epoch_ranges(self, start: int, stop: int) -> Iterator[tuple[int, int]]:
        """The positions of the epoch order that positions [start, stop) of this layout are, as ranges."""
        index = int(np.searchsorted(self._span_starts, start, side="right")) - 1
        while start < stop:
            span_start, span_end = self.spans[index]
            offset = start - int(self._span_starts[index])
            take = min(stop - start, span_end - span_start - offset)
            if take > 0:
                yield span_start + offset, span_start + offset + take
                start += take
            index += 1

    def unconsumed_spans(self, position: int) -> list[tuple[int, int]]:
        """Epoch-order spans not yet used as inputs when every stream stands at ``position``: each stream's rest
        and the tail after the last stream, merged where they touch."""
        pieces = [(self.stream_start(s) + position, self.stream_start(s + 1)) for s in range(self.num_streams)] + [
            (self.num_streams * self.tokens_per_stream, self.total)
        ]
        spans: list[tuple[int, int]] = []
        for start, stop in pieces:
            for begin, end in self.epoch_ranges(start, stop):
                if spans and spans[-1][1] == begin:
                    spans[-1] = (spans[-1][0], end)
                else:
                    spans.append((begin, end))
        return spans
