"""Test helper, launched by `deepspeed`: train with launchers/train.py's Trainer, then write the live parameters
gathered from every rank (ZeRO-3 partitions them) to OUT.pt, for comparison with an offline conversion. Under
ZeRO-3 it also writes OUT.pt.zero3.json: per parameter its elements, the elements rank 0 holds and whether
DeepSpeed keeps it whole on every rank (``stage3_param_persistence_threshold``), so a test can check that the
parameters really were partitioned.

    deepspeed --num_gpus 2 tests/scripts/train_and_gather.py OUT.pt --config ... key=value ...
"""

import json
import logging
import sys

import deepspeed
import torch
import torch.distributed as dist

from txl_dist.supervision.guard import RunGuard
from txl_dist.training import startup
from txl_dist.training.arguments import build_arg_parser


def main() -> None:
    # The launcher puts --local_rank=N first; LOCAL_RANK in the environment says the same.
    out, *argv = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    parser = build_arg_parser()
    run = startup.resolve(parser, parser.parse_intermixed_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    trainer = startup.start(run, RunGuard())
    trainer.run()
    module = trainer.engine.module
    partitions = {
        name: {"numel": p.ds_numel, "local_numel": p.ds_tensor.numel(), "persist": p.ds_persist}
        for name, p in module.named_parameters()
        if hasattr(p, "ds_tensor")
    }
    if partitions and dist.get_rank() == 0:
        with open(f"{out}.zero3.json", "w", encoding="utf-8") as handle:
            json.dump(partitions, handle)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        live = {name: p.detach().clone().float() for name, p in module.named_parameters()}
    if dist.get_rank() == 0:
        torch.save(live, out)
    dist.barrier()
    # As txl_dist.training.startup.train does: a process group left to interpreter shutdown aborted rank 1 at exit once
    # ("terminate called without an active exception") after a finished run.
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
