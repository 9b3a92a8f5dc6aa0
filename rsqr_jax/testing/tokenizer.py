"""A stand-in tokenizer for experiments on tiny models: no files, deterministic, any vocabulary size."""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes as token ids (mod vocab): the `encode(text, add_special_tokens=...)` the experiments call."""

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("latin-1")
