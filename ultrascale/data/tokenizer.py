"""Tokenizers for the causal-LM data pipeline.

Two implementations share one small interface (``encode``, ``encode_array``,
``decode``, ``eos_id``, ``bos_id``, ``vocab_size``):

* :class:`ByteTokenizer`: UTF-8 bytes are the tokens. Needs no files, so every
  machine (CI, an offline cluster node) can train out of the box.
* :class:`HFTokenizer`: wraps a ``transformers`` tokenizer saved in a local
  folder, for real vocabularies.

:func:`load_tokenizer` picks one from a path (``None`` means bytes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]


@runtime_checkable
class Tokenizer(Protocol):
    """What the data module needs from a tokenizer."""

    eos_id: int
    """Id appended after every document; the model learns where texts end."""
    bos_id: int | None
    """Beginning-of-sequence id, or ``None`` if the vocabulary has none."""
    vocab_size: int
    """Number of ids, special ones included; the model's embedding size."""

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _as_int_list(ids: Any) -> list[int]:
    # Accept lists, numpy arrays and torch tensors alike without importing torch here.
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is BOS, 257 is EOS."""

    bos_id: int = 256
    """Beginning-of-sequence id (one past the last byte)."""
    eos_id: int = 257
    """End-of-sequence id, appended after every document."""
    vocab_size: int = 258
    """256 byte values plus BOS and EOS."""

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as ids (no special tokens added)."""
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but as an ``int32`` array, without a Python list in between."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text, dropping BOS/EOS.

        Invalid byte sequences (a model may emit half a multi-byte character)
        become U+FFFD instead of raising, so decoding samples never crashes.
        """
        data = bytes(i for i in _as_int_list(ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size})"


class HFTokenizer:
    """A ``transformers`` tokenizer behind the :class:`Tokenizer` interface.

    Documents are encoded with ``add_special_tokens=False``: the data module
    appends ``eos_id`` itself, and tokenizers that add BOS/EOS on their own
    would otherwise double them.
    """

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{type(self).__name__}: the tokenizer {type(tokenizer).__name__} has no eos_token; "
                "it is needed to separate documents. Set `eos_token` on it and save it again."
            )
        self.tokenizer = tokenizer
        self.eos_id: int = int(tokenizer.eos_token_id)
        self.bos_id: int | None = None if tokenizer.bos_token_id is None else int(tokenizer.bos_token_id)
        # len() counts added special tokens; `tokenizer.vocab_size` does not, and an
        # embedding sized from it would be indexed out of range by those tokens.
        self.vocab_size: int = len(tokenizer)

    def encode(self, text: str) -> list[int]:
        """Return the ids of ``text`` (no special tokens added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_array(self, text: str) -> np.ndarray:
        """Like :meth:`encode` but as an ``int32`` array."""
        return np.asarray(self.encode(text), dtype=np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Turn ids back into text, dropping special tokens."""
        return self.tokenizer.decode(_as_int_list(ids), skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.tokenizer).__name__}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | None) -> ByteTokenizer | HFTokenizer:
    """Return a :class:`ByteTokenizer` for ``None``, else the HF tokenizer saved in folder ``path``.

    Only local files are read (``local_files_only=True``): a typo must fail here,
    not turn into a download attempt on an offline node.
    """
    if path is None:
        return ByteTokenizer()
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"tokenizer folder `tokenizer_path={path!r}` does not exist or is not a directory; "
            "pass a folder written by `tokenizer.save_pretrained(...)`, or None for the byte tokenizer"
        )
    from transformers import AutoTokenizer  # imported lazily: transformers is slow to import

    return HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
