"""The training loop: the run's command line (`arguments`, the parser, without torch; `cli`, the checks and the
run), the run folder, the DeepSpeed config built from the typed run config, the learning-rate schedule, the step
cadence, the per-rank stream memories, the step log and its writers (metrics.jsonl, TensorBoard events and text),
and the `Trainer` that joins them.

Layer 5 (docs/architecture.md, Layers): may import layers 1-5; today every package of layers 1-4 but
inference, never export, convert or the launchers."""
