"""`InputError`, the error of input that cannot be read as asked. It has a module of its own, below every module
that reads inputs (`corpus_inputs`, `zip_member`, `benchmark_corpora`, `chunking`, `text_decoding`), so that each
of them raises it without any two of them importing each other."""


class InputError(ValueError):
    """Input that cannot be read as asked; the message names the file (and the byte offset or line)."""
