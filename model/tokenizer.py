"""Text ⇄ token ids, through Hugging Face's ``tokenizers`` (byte-level BPE).

Byte-level BPE maps every UTF-8 byte to a symbol first, so any text — emoji,
other scripts, control characters, NUL — encodes, and decoding the ids gives
the text back. A single token may hold part of a multi-byte character; the
display label of such a token shows those bytes as ``\\xNN``.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

END_OF_TEXT = "<|endoftext|>"


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TextTokenizer:
    """A thin wrapper naming the few operations the project needs."""

    def __init__(self, tokenizer: Tokenizer, source: str = "") -> None:
        self._tok = tokenizer
        self.source = source
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_id: int | None = tokenizer.token_to_id(END_OF_TEXT)

    @classmethod
    def from_file(cls, path: str | Path) -> TextTokenizer:
        """Load a ``tokenizer.json`` written by ``tokenizers`` / ``save_pretrained``."""
        return cls(Tokenizer.from_file(str(path)), source=str(path))

    @classmethod
    def from_vocab_merges(cls, vocab: str | Path, merges: str | Path) -> TextTokenizer:
        """GPT-2's original pair of files: ``vocab.json`` and ``merges.txt``."""
        tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        with open(vocab, encoding="utf-8") as f:
            if END_OF_TEXT in json.load(f):
                tok.add_special_tokens([END_OF_TEXT])
        return cls(tok, source=f"{vocab} + {merges}")

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; ids this tokenizer does not know (a model whose
        vocabulary is larger than its tokenizer's) show as ``⟨id⟩``."""
        known: list[int] = []
        parts: list[str] = []
        for i in ids:
            if 0 <= i < self.vocab_size:
                known.append(int(i))
            else:
                if known:
                    parts.append(self._tok.decode(known, skip_special_tokens=False))
                    known = []
                parts.append(f"⟨{int(i)}⟩")
        if known:
            parts.append(self._tok.decode(known, skip_special_tokens=False))
        return "".join(parts)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes a byte-level token stands for (None for unknown or special ids)."""
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return None
        table = _unicode_to_byte()
        if not all(ch in table for ch in piece):
            return None
        return bytes(table[ch] for ch in piece)

    def token_label(self, token_id: int) -> str:
        """One token as a person should see it: its text, with bytes that are not
        a whole UTF-8 character shown as ``\\xNN`` and control characters escaped."""
        raw = self.token_bytes(token_id)
        if raw is None:
            piece = self._tok.id_to_token(int(token_id))
            return piece if piece is not None else f"⟨{int(token_id)}⟩"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"\\x{b:02x}" if b >= 0x80 else _escape_char(chr(b)) for b in raw)
        return "".join(_escape_char(ch) for ch in text)

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @property
    def backend(self) -> Tokenizer:
        return self._tok


def _escape_char(ch: str) -> str:
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    if ord(ch) < 0x20 or ord(ch) == 0x7F:
        return f"\\x{ord(ch):02x}"
    if not ch.isprintable():  # format and separator characters: zero-width, bidi overrides, no-break space …
        return f"\\u{ord(ch):04x}" if ord(ch) <= 0xFFFF else f"\\U{ord(ch):08x}"
    return ch
