"""Shards on disk (format) and the per-rank contiguous token streams read from them."""
