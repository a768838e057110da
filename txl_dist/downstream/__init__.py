"""Downstream commands' work, imported by ``launchers/evaluate.py`` and ``launchers/generate.py`` once their
command line is parsed (so that --help imports no torch): `evaluate` scores a split of the shards with an export
folder or a training checkpoint across the ranks of any launcher; `generate` continues a prompt or scores texts
with an export folder.

Layer 7, the top (docs/architecture.md, Layers), beside `txl_dist.plot`: it may import every layer, export and
convert included (a checkpoint is read through `txl_dist.convert.zero`)."""
