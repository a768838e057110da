"""Train a Transformer-XL language model with DeepSpeed ZeRO.

    # one node, 8 GPUs
    deepspeed --num_gpus 8 launchers/train.py --config configs/lm1b_base.yaml \\
        data.shards=/data/lm1b/shards train.output_dir=runs/lm1b_base
    # several nodes: the launcher's flags come before the script; .deepspeed_env carries your variables to them
    python -m txl_dist.world.launch_env --write-deepspeed-env
    deepspeed --hostfile launchers/hostfile.example launchers/train.py --config configs/lm1b_large.yaml \\
        data.shards=/shared/lm1b/shards train.output_dir=/shared/runs/lm1b_large
    # Slurm: a batch job (one task per rank), or srun, or DeepSpeed's srun/mpirun launchers
    sbatch --nodes 4 --ntasks-per-node 8 --gpus-per-node 8 launchers/slurm.sbatch --config ... train.output_dir=...
    srun --nodes 2 --ntasks-per-node 8 python launchers/train.py --config ... train.output_dir=...
    deepspeed --hostfile H --launcher slurm launchers/train.py ...      # or --launcher openmpi
    # two CPU ranks (the demo)
    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 deepspeed --num_gpus 2 launchers/train.py \\
        --config configs/ptb_small.yaml data.shards=demo/shards train.output_dir=demo/run
    # torchrun, or one plain process
    torchrun --nproc_per_node 2 launchers/train.py --config configs/tiny_cpu.yaml data.shards=... train.output_dir=...
    python launchers/train.py --config configs/tiny_cpu.yaml data.shards=... train.output_dir=...

Rerunning the same command resumes from the newest checkpoint in train.output_dir that verifies. One run per output
directory (a second is refused; the lock of a killed run is taken over). SIGTERM, SIGINT, or the end of the process
that started the job (the deepspeed runner, srun's task) checkpoints and exits 0. A failure on any rank stops every
rank with one message; a rank that dies or stops making progress (train.stall_timeout) is named. The rank and world
come from whichever launcher started the process (txl_dist.world.launch_env); one that cannot form one world, or a
process alone in the batch script of a Slurm allocation of several tasks (start it with srun; TXL_SINGLE_RANK=1
to run it alone), stops with one line before anything starts. `--print-config` prints the resolved
configuration and exits. Progress: the console, ``{output_dir}/metrics.jsonl`` and ``tensorboard --logdir
{output_dir}/tensorboard``.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

from txl_dist.exit_status import USAGE_ERROR, print_error, run_command
from txl_dist.run_layout import fault_log
from txl_dist.training.arguments import build_arg_parser
from txl_dist.world import launch_env
from txl_dist.world.guard import RunGuard


def _launch_environment() -> None:
    """Rank, world and rendezvous address from whichever launcher started this process (torchrun, deepspeed,
    srun, mpirun; a plain ``python launchers/train.py`` is a world of one), checked and written as torch's
    variables; ValueError (one line) for a launch that cannot form one world, before anything has started."""
    # Before `apply` writes RANK: a process alone in the batch script of an allocation of several tasks most
    # likely lacks its `srun`, and would train on one task of the allocation.
    launch_env.refuse_lone_batch_process(os.environ)
    launch = launch_env.apply()
    launch_env.require_resolvable_address(launch)
    if launch.launcher != "torch":
        os.environ.setdefault("TXL_LAUNCHER", launch.launcher)


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def main(argv: list[str] | None = None) -> int:
    # First, before the heavy imports: signals, and the launcher chain this rank must not outlive.
    guard = RunGuard()
    # DeepSpeed calls a torch.distributed function that torch has deprecated, once per collective kind.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    parser = build_arg_parser()
    try:
        args = parser.parse_intermixed_args(argv)  # --help and a refused flag: before torch is imported
        # lazy: --help stays under 1 s; torch and DeepSpeed (about 4 s) load once the guard above is in place
        from txl_dist.training import cli

        cfg = cli.resolve_run_config(parser, args)  # exits 2 with the offending key before any process group exists
    except BaseException:
        # Nothing started: give the caller (a test calling main in-process) its own signal handlers back and stop
        # the guard's watch thread.
        guard.close()
        raise
    guard.fault_log = fault_log(cfg.train.output_dir)  # the run folder exists and takes files (resolve_run_config)
    try:
        _launch_environment()
    except ValueError as error:  # a launch whose processes cannot form one world: nothing has started
        guard.close()
        print_error("train.py", error)
        return USAGE_ERROR
    _configure_logging()
    try:
        summary = cli.train(cfg, args, guard)
    except BaseException as error:  # noqa: BLE001 -- every failure ends every rank, with one message
        guard.fail(error)
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            print(f"output: {summary['output_dir']}  (tensorboard --logdir {summary['output_dir']}/tensorboard)")
        except OSError:  # the launcher that read our output is gone
            pass
    return 0


if __name__ == "__main__":
    sys.exit(run_command(main, "train.py"))
