"""Bad input, grouped by the module or command it is given to: each case ends in one clear line with a non-zero exit
(and nothing left behind that a later step trusts), or in correct handling.

- test_config.py: txl_dist.config (sections, includes, YAML, the ranges of numbers);
- test_training.py: launchers/train.py's command line (parse_run_args, require_memory_fits): what a run needs,
  checked before any process group starts;
- test_launch.py: txl_dist.rendezvous: launcher variables, host lists and the rendezvous itself;
- test_checkpoints.py: txl_dist.checkpoints: completion markers, and resuming under another ZeRO stage;
- test_exports.py: txl_dist.export as the commands that read an export load it (checksums, non-finite weights, a
  folder that is not an export);
- test_downstream.py: launchers/evaluate.py and launchers/generate.py (txl_dist.downstream);
- test_convert.py: launchers/convert.py (txl_dist.convert);
- test_hub_tokenizers.py: the tokenizers of export-to-hub's folders in current transformers (the hf tier);
- test_plan.py: python -m txl_dist.plan;
- test_data_tools.py: data_tools (build_shards, train_tokenizer) and benchmarks.corpora (synthetic_charlm,
  synthetic_lm1b).

Shared fixtures are in conftest.py, shared helpers in helpers.py.
"""
