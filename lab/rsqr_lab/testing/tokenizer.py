"""A stand-in tokenizer for experiments on tiny models: no files, deterministic, any vocabulary size."""

from __future__ import annotations

import re
import zlib


class ByteTokenizer:
    """UTF-8 bytes as token ids (mod vocab): the `encode(text, add_special_tokens=...)` the experiments call."""

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) % 256 for i in ids).decode("latin-1")


class WordTokenizer:
    """Words with their leading space, single digits (ids 0-9, so answers decode exactly) and punctuation;
    other ids by crc32. Deterministic, no files."""

    def __init__(self, vocab: int):
        self.vocab, self.pieces = vocab, {i: str(i) for i in range(10)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        out = []
        for piece in re.findall(r" ?[A-Za-z]+|\d|\s|[^\sA-Za-z\d]", text):
            i = int(piece) if piece.isdigit() else 10 + zlib.crc32(piece.encode()) % (self.vocab - 10)
            self.pieces.setdefault(i, piece)
            out.append(i)
        return out

    def decode(self, ids) -> str:
        return "".join(self.pieces.get(int(i), "?") for i in ids)
