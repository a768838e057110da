"""The one tokenizer interface of txl_dist: load a tokenizer directory, encode, decode, special ids.

A tokenizer directory (written by ``python -m data_tools.train_tokenizer``) holds the tokenizer's files and
``tokenizer.json``::

    {"kind": "sentencepiece" | "word" | "byte" | "char", "vocab_size": 32000, "files": ["spm.model"],
     "fingerprint": "<sha256>", "eos_id": 2, "eod_id": 4, "unk_id": 0,
     "pieces": {"eos": "</s>", "eod": "<eod>", "unk": "<unk>"}, "training": {...settings, for the record...}}

- ``sentencepiece``: ``spm.model``, a SentencePiece model (unigram or BPE). ``eos_id`` is its ``</s>``; ``eod_id``
  is a user-defined end-of-document symbol when one was trained, else ``eos_id``.
- ``word``: ``vocab.txt``, one ``token<TAB>count`` line per id (specials first, then words by descending count).
  Text is split on whitespace (Python's ``str.split()``); a word outside the vocabulary becomes ``unk_id``.
  Decoding joins the words with single spaces.
- ``byte``: ``bytes.txt``, 256 lines ``<0xHH><TAB>count``: id = the byte's value, every byte one id (enwik8,
  which is raw XML bytes, some of them not UTF-8). ``eos_id = eod_id = 10``, the newline byte: a line of the
  input is its bytes followed by its newline, so a file's token stream is exactly its bytes (plus one newline
  when the file does not end with one, the authors' final ``<eos>``). Text in and out is ``str`` holding the
  bytes as UTF-8 with ``surrogateescape`` (bytes that are not UTF-8 are lone surrogates U+DC80..U+DCFF), so that
  ``decode(encode(text)) == text`` for every byte string; `ByteTokenizer.encode_bytes`/`decode_bytes` take bytes.
- ``char``: ``chars.txt``, one line ``U+XXXX<TAB>count`` per id: every character of the alphabet one id (text8's
  27). Id 0 is the newline, ``eos_id = eod_id``, which ends every line as for bytes; there is no unknown token:
  a character outside the alphabet is an error naming it.

The fingerprint is the sha256 of the bytes of ``files`` in their listed order; with one file (both kinds) it is
exactly ``sha256sum`` of that file. Shards record it, and readers refuse shards built with another tokenizer.

Documents. A document is a list of lines. Its tokens are each line's tokens followed by ``eos_id``, except that
the last line is followed by ``eod_id`` instead. A document of one line (a PTB or One Billion Word sentence) is
therefore its tokens and one separator, and with ``eod_id == eos_id`` every line ends in ``eos_id``. Newlines thus
stay meaningful for SentencePiece, whose normaliser would otherwise fold them into spaces.

Layer 2 (docs/architecture.md, Layers): may import layers 1-2; today txl_dist.fileio and txl_dist.word_scan,
never the data or anything above.
"""

from txl_dist.tokenizer.base import (
    BYTE_VOCAB,
    CHAR_VOCAB,
    CHARACTER_KINDS,
    KINDS,
    SENTENCEPIECE_MODEL,
    TOKENIZER_JSON,
    WORD_VOCAB,
    Tokenizer,
    TokenizerError,
)
from txl_dist.tokenizer.characters import NEWLINE, ByteTokenizer, CharTokenizer
from txl_dist.tokenizer.description import (
    find_tokenizer_dir,
    fingerprint_files,
    load_tokenizer,
    tokenizer_dir_of,
    verified_fingerprint,
    write_tokenizer_json,
)
from txl_dist.tokenizer.vocab_files import byte_piece, char_piece, read_word_vocab, write_word_vocab
from txl_dist.tokenizer.words import SentencePieceTokenizer, WordTokenizer

__all__ = [
    "BYTE_VOCAB",
    "CHARACTER_KINDS",
    "CHAR_VOCAB",
    "KINDS",
    "NEWLINE",
    "SENTENCEPIECE_MODEL",
    "TOKENIZER_JSON",
    "WORD_VOCAB",
    "ByteTokenizer",
    "CharTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "WordTokenizer",
    "byte_piece",
    "char_piece",
    "find_tokenizer_dir",
    "fingerprint_files",
    "load_tokenizer",
    "read_word_vocab",
    "tokenizer_dir_of",
    "verified_fingerprint",
    "write_tokenizer_json",
    "write_word_vocab",
]
