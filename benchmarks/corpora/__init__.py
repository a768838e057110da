"""Generators of corpora in the layouts of the published benchmarks, for the tests and benchmarks where no copy of
the real corpus can be downloaded: One Billion Word's layout and statistics (`synthetic_lm1b`), and enwik8, text8
and WikiText files (`synthetic_charlm`). Run from the repository root, e.g. ``python -m
benchmarks.corpora.synthetic_lm1b --output corpus/ --scale 0.01``; nothing in data_tools or txl_dist imports them."""
