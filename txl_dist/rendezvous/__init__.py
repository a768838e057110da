"""How the processes a launcher started become one world: the launcher's variables read into one rank, world
size and rendezvous (`launch_env`, with Slurm's in `slurm_env`; host lists, DeepSpeed's hostfile and `.deepspeed_env`
in `launch_formats`), the process group and its rendezvous (`process_group`), and each rank's device (`ranks`).

Layer 3 (docs/architecture.md, Layers): may import layers 1-3; today the bottom layer only (fileio, exit_status), so
that the launch path stays free of the data and the model. What watches a running world is
`txl_dist.supervision`, above it."""
