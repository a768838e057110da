"""Tools that turn a raw corpus into a tokenizer and webdataset shards (see txl_dist.data.format)."""
