"""Test helper, launched by `deepspeed`: train with launchers/train.py's Trainer, then write the live parameters
gathered from every rank (ZeRO-3 partitions them) to OUT.pt, for comparison with an offline conversion.

    deepspeed --num_gpus 2 tests/scripts/train_and_gather.py OUT.pt --config ... key=value ...
"""

import logging
import sys

import deepspeed
import torch
import torch.distributed as dist

from txl_dist.training.cli import parse_run_args
from txl_dist.training.trainer import Trainer


def main() -> None:
    # The launcher puts --local_rank=N first; LOCAL_RANK in the environment says the same.
    out, *argv = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    cfg, args = parse_run_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trainer = Trainer(cfg, deepspeed_overlay=args.deepspeed_config)
    trainer.run()
    module = trainer.engine.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        live = {name: p.detach().clone().float() for name, p in module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(live, out)
    dist.barrier()


if __name__ == "__main__":
    main()
