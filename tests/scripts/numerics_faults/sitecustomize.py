"""Numerical faults injected from outside the product: a ``sitecustomize`` that a test puts on the ``PYTHONPATH`` of
the ranks it starts (`tests/numerics_faults.py`, ``fault_environment``). Every Python process that starts with it
imports it; it changes nothing unless one of its variables is set:

- ``TXL_TEST_NAN_AT_CALL=RANK:CALL[,RANK:CALL...]``: the training forward number CALL (counted from 1 in this
  process) of rank RANK returns a NaN loss. The count goes on across a rollback, so a replay does not meet it
  again: a transient fault, as a flipped bit in a device would give.
- ``TXL_TEST_SPIKE_AT_CALL=RANK:CALL[,...]``: that forward's loss times ``TXL_TEST_SPIKE_FACTOR`` (default 30),
  finite: a transient spike.
- ``TXL_TEST_POISON=SHA256[,SHA256...]``: a training forward whose input tokens (int64, C order) have one of these
  sha256 digests returns a NaN loss: a fault in the data, met again by every replay of that batch.
"""

import hashlib
import os

_NAN_AT = {
    tuple(int(part) for part in item.split(":"))
    for item in os.environ.get("TXL_TEST_NAN_AT_CALL", "").split(",")
    if item.strip()
}
_SPIKE_AT = {
    tuple(int(part) for part in item.split(":"))
    for item in os.environ.get("TXL_TEST_SPIKE_AT_CALL", "").split(",")
    if item.strip()
}
_POISON = {item.strip() for item in os.environ.get("TXL_TEST_POISON", "").split(",") if item.strip()}

if _NAN_AT or _SPIKE_AT or _POISON:
    from txl_dist.model import TransformerXLLM

    _forward = TransformerXLLM.forward
    _factor = float(os.environ.get("TXL_TEST_SPIKE_FACTOR", "30"))
    _calls = [0]

    def _faulty_forward(self, tokens, targets=None, mems=None, **options):
        loss, new_mems = _forward(self, tokens, targets, mems, **options)
        if not self.training or targets is None:
            return loss, new_mems
        _calls[0] += 1
        rank = int(os.environ.get("RANK", "0"))
        if (rank, _calls[0]) in _NAN_AT:
            return loss * float("nan"), new_mems
        if (rank, _calls[0]) in _SPIKE_AT:
            return loss * _factor, new_mems
        if _POISON and hashlib.sha256(tokens.detach().cpu().contiguous().numpy().tobytes()).hexdigest() in _POISON:
            return loss * float("nan"), new_mems
        return loss, new_mems

    TransformerXLLM.forward = _faulty_forward
