"""The world a run runs in: the launcher's environment (deepspeed, torchrun, Slurm, mpirun, a hostfile) read into
one rank, world size and rendezvous; the process group; the run lock; heartbeats, stall and death detection of
the ranks and of the launcher; the node verdicts of an elastic Slurm job; the one-line ending of a stopped process.

Layer: may import the bottom layer (fileio, exit_status, run_layout, checkpoints.layout), txl_dist.config and the
layers between them and itself; today it imports only those (docs/architecture.md, Layers)."""
