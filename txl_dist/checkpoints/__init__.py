"""Checkpoints, used alike by training, export and convert: the folder layout of a run's checkpoints, saving,
choosing and pruning them (`manager`), verifying them (`verify`), converting between ZeRO stages and world sizes
through DeepSpeed's universal format (`universal`), the per-rank stream state (`rank_state`) and reading weights
without unpickling code (`weights_only`).

Layer: may import txl_dist.fileio, txl_dist.config and txl_dist.world, nothing above (docs/architecture.md).
`layout` alone is paths only and lies in the bottom layer, so that `world` (Slurm verdicts) and the run folder
can name a checkpoint's files without importing the rest of this package."""
