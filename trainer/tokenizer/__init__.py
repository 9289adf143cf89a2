"""Tokenizers: train byte-level BPE, hash it, and encode corpora into training shards."""
