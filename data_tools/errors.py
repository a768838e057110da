"""`InputError`, the one error of the data tools' input: a corpus file that cannot be read as asked, a command line
or settings that cannot build the shards or a tokenizer's vocabulary, a build that cannot go on as asked.
`data_tools.build_shards` and `data_tools.train_tokenizer` print it as one line with exit status 2. It has a module
of its own, below every other module of data_tools, so that each of them raises it without importing another."""


class InputError(ValueError):
    """Input that cannot be used as asked; the message names the file (and the byte offset or line) or the flag, and
    says what to do."""
