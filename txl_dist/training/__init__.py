"""The training run: the command line (`arguments`, the parser, without torch), the start-up sequence in reading
order (`startup`: the run resolved once, then ranks, run folder, resume plan, engine, streams), the run folder
(`run_dir`), the DeepSpeed config built from the typed run config, the learning-rate schedule, the step cadence,
the state saved and loaded as one with the per-slot stream memories (`train_state`), the two logging modules
(`run_log`: where reports go; `step_log`: what they say), throughput and profiling, and the `Trainer`, the loop.

Layer 5 (docs/architecture.md, Layers): may import layers 1-5; today every package of layers 1-4 but
inference, never export, convert or the launchers."""
