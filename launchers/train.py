"""Train a Transformer-XL language model with DeepSpeed ZeRO.

    # one node, 8 GPUs
    deepspeed --num_gpus 8 launchers/train.py --config configs/lm1b_base.yaml \\
        data.shards=/data/lm1b/shards train.output_dir=runs/lm1b_base
    # several nodes: the launcher's flags come before the script; .deepspeed_env carries your variables to them
    python -m txl_dist.rendezvous.launch_env --write-deepspeed-env
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
come from whichever launcher started the process (txl_dist.rendezvous.launch_env); one that cannot form one world, or a
process alone in the batch script of a Slurm allocation of several tasks (start it with srun; TXL_SINGLE_RANK=1
to run it alone), stops with one line before anything starts. `--print-config` prints the resolved
configuration and exits. Progress: the console, ``{output_dir}/metrics.jsonl`` and ``tensorboard --logdir
{output_dir}/tensorboard``.
"""

from __future__ import annotations

import sys
import warnings

from txl_dist.exit_status import run_command
from txl_dist.supervision.guard import RunGuard
from txl_dist.training.arguments import build_arg_parser


def main(argv: list[str] | None = None) -> int:
    # First, before the heavy imports: signals, and the launcher chain this rank must not outlive.
    guard = RunGuard()
    # DeepSpeed calls a torch.distributed function that torch has deprecated, once per collective kind.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    parser = build_arg_parser()
    try:
        args = parser.parse_intermixed_args(argv)  # --help and a refused flag: before torch is imported
        # lazy: --help stays under 1 s; torch and DeepSpeed (about 4 s) load once the guard above is in place
        from txl_dist.convert.sources import open_source
        from txl_dist.training import startup
    except BaseException:
        # Nothing started: give the caller (a test calling main in-process) its own signal handlers back and stop
        # the guard's watch thread.
        guard.close()
        raise
    # The start-up sequence, in reading order, then the run; train.init_from's model read by the conversions' reader.
    return startup.run(parser, args, guard, open_source)


if __name__ == "__main__":
    sys.exit(run_command(main, "train.py"))
