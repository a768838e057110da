"""Reading the user's corpus files: the input files a command line names (`inputs`: globs, .gz, the ``treebank``
package), the published corpora of ``--format`` (`published`, with `zip_member` for the files inside a zip), the
chunks of whole documents they are cut into (`chunking`), and the documents of a chunk, as text (`text_decoding`)
or as the bytes and characters a byte or char tokenizer reads (`character_documents`). The shards and the
vocabularies are both built from what this package reads."""
