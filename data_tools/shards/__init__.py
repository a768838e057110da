"""Building webdataset shards from a corpus with a tokenizer (`python -m data_tools.build_shards`): the settings
of a build (`settings`), the tokenising of chunks in worker processes (`tokenize_chunks`), the packing of
documents into blocks (`block_packer`), the shard files (`writer`), the journal and input digests that
``--resume`` reads (`journal`, `input_digests`), and the build that runs them all (`builder`)."""
