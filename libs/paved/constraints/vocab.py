"""Token id -> bytes for a Hugging Face tokenizer: what the C++ engine compiles against.

Constraints are byte-level automata, so every token must be known as the exact bytes it
adds to the output. Three encodings cover the tokenizers vLLM serves: GPT-2 style
byte-level BPE (each byte mapped to a printable char), SentencePiece with byte fallback
(`▁` for space, `<0xHH>` for raw bytes), and plain text pieces. Special and added control
tokens map to b"" and are never allowed by a constraint (EOS is handled separately).
"""

from __future__ import annotations

import re
from functools import lru_cache

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> unicode map: printable bytes map to themselves, the rest to
    # code points from 256 upwards, in byte order.
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    # A Sequence decoder reprs its members, so this also finds a nested ByteLevel.
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes(tokenizer) -> list[bytes]:
    """Bytes of every token id in `tokenizer`, indexed by id (len == len(tokenizer))."""
    vocab = tokenizer.get_vocab()
    size = max(len(tokenizer), max(vocab.values()) + 1)
    out = [b""] * size
    special = set(getattr(tokenizer, "all_special_ids", []))
    special.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    byte_level = _is_byte_level(tokenizer)
    decoder = _byte_decoder()
    for piece, token_id in vocab.items():
        if token_id in special:
            continue
        if byte_level and all(c in decoder for c in piece):
            out[token_id] = bytes(decoder[c] for c in piece)
        elif m := _BYTE_FALLBACK.match(piece):
            out[token_id] = bytes([int(m.group(1), 16)])
        elif "▁" in piece:
            out[token_id] = piece.replace("▁", " ").encode("utf-8")
        else:
            out[token_id] = tokenizer.convert_tokens_to_string([piece]).encode("utf-8")
    return out
