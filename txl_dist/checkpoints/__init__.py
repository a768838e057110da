"""Checkpoints, used alike by training, export and convert: the folder layout of a run's checkpoints, saving,
choosing and loading them (`manager`), DeepSpeed's files written atomically with their checksums (`recording`),
writes in the background (`background`) and memory snapshots (`snapshots`), rotation (`rotation`), verifying them
(`verify`), converting between ZeRO stages and world sizes through DeepSpeed's universal format (`universal`), the
per-rank stream state (`rank_state`) and reading weights without unpickling code (`weights_only`).

Layer 4 (docs/architecture.md, Layers): may import layers 1-4; today the bottom layer (fileio, exit_status,
checkpoint_paths, where a checkpoint's files lie) and `txl_dist.rendezvous.ranks`."""
