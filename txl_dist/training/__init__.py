"""Training: the run's command line, the DeepSpeed config built from the typed run config, the learning-rate
schedule, and the training loop."""
