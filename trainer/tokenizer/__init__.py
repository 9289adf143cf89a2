"""Tokenizers: train them, defend their vocabulary size with measurements, encode training shards.

Modules, one concept each: `vocabulary` (special tokens, ids, the multiple-of-128 rule), `bpe`
(HF byte-level BPE), `spm` (SentencePiece BPE/unigram with byte fallback), `trainers` (the kinds
and one call for all), `metadata` (tokenizer.meta.json: hash, corpus, settings), `codec` (a
trained tokenizer opened for encoding, either library), `documents` (inputs and the split by
document), `compression` (held-out measurements), `vocab_law` (Tao et al. 2024's predictors),
`sweep` (sizes measured, costed and recommended), `sweep_report` (table, PNG, JSON), `encode`
(shards for `trainer/data.py`). The `crucible tokenizer` command is
`crucible.trainer.commands.tokenizer`; docs/tokenizer.md has the measured figures behind the
default vocabulary size.
"""
