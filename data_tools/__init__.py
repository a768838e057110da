"""Tools that turn a raw corpus into a tokenizer and webdataset shards (see txl_dist.data.format).

The commands users type lie at the top (`build_shards`, `train_tokenizer`, `inspect_shards`), with what they
share: `command_line`, `workers` (the worker processes) and `errors` (`InputError`). The packages below them hold
what the commands make: `corpora` reads the user's corpus files, `shards` builds the shards and `vocabularies` a
tokenizer's vocabulary."""
