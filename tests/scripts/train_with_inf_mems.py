"""Test helper, launched by `deepspeed`: launchers/train.py, with the new memory of rank 0's first stream of its
first micro-batch slot made inf from the third optimizer step on -- what an fp16 forward that overflows leaves.

    deepspeed --num_gpus 2 tests/scripts/train_with_inf_mems.py --config ... key=value ...
"""

import os
import runpy
import sys
from pathlib import Path

from txl_dist.model import TransformerXLLM

TRAIN = Path(__file__).resolve().parents[2] / "launchers" / "train.py"
FIRST_POISONED_CALL = 5  # training forwards per rank, 2 micro-batches per step: slot 0 of the third step
_calls = 0
_forward = TransformerXLLM.forward


def poisoned_forward(self, tokens, targets=None, mems=None, **options):
    global _calls
    loss, new_mems = _forward(self, tokens, targets, mems, **options)
    if self.training:
        _calls += 1
        if os.environ.get("RANK") == "0" and _calls >= FIRST_POISONED_CALL and _calls % 2 == 1:
            new_mems = [m.clone() for m in new_mems]
            new_mems[1][:, 0] = float("inf")
    return loss, new_mems


if __name__ == "__main__":
    TransformerXLLM.forward = poisoned_forward
    sys.argv = [str(TRAIN), *sys.argv[1:]]
    runpy.run_path(str(TRAIN), run_name="__main__")
