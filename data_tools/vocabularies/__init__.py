"""Building a tokenizer's vocabulary from a corpus (`python -m data_tools.train_tokenizer`): the documents read for
it, with a progress bar and the counts for the record (`reading`), words counted in worker processes
(`word_counts`), a SentencePiece model learned from a sample of the lines (`sentencepiece`), and the vocabularies
that are lists of their entries: words by count, every byte value, the characters of the text (`lists`)."""
