"""What watches a run once its processes are started: the guard of every rank (`guard`: one failure message, the
ranks' heartbeats, stalls and deaths, the launcher's end), the run lock (`lock`), the run's fault log (`faults`), the
one-line ending of a command on a signal (`interrupts`), and the batch script's decisions after a failed Slurm step
(`slurm_nodes`, the command; `slurm_view`, Slurm's view of the nodes; `run_progress`, how far the run got;
`relaunch`, the decision).

Layer 4 (docs/architecture.md, Layers): may import layers 1-4; today the bottom layer (fileio, exit_status, config,
run_paths, checkpoint_paths) and `txl_dist.rendezvous.launch_formats` (Slurm's host lists)."""
