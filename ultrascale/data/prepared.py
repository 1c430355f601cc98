"""Pretraining data tokenized once, offline, and read by memory map on every rank.

`prepare_data` (the `ultrascale prepare-data` command) tokenizes text files, JSONL, Parquet or a saved
`datasets` dataset with a Hugging Face tokenizer in N worker processes and writes one folder:

    tokens.bin      every document's tokens followed by EOS, concatenated (uint16 when the vocabulary
                    fits in 65,536 ids, else uint32): the layout of nanoGPT's memmap and Megatron's .bin
    documents.npy   int64 start offset of every document, and the total at the end (n_documents + 1)
    metadata.json   format, dtype, token and document counts, the tokenizer (name, SHA-256 of its files,
                    vocabulary size, EOS id), the sources

Conversations (`prepare_chat_data`, `ultrascale prepare-data --chat`) are rendered with the chat template once
(`ultrascale.data.chat`) and add

    assistant.bin   uint8 per token: 1 where it belongs to an assistant turn that may be learned (its
                    end-of-turn token included), the labels `InstructionDataModule` cuts and selects from
                    at its own `seq_len` and `learn` options; no EOS is appended (the template ends turns)

with `"kind": "chat"`, the template's text and the end-of-turn id in metadata.json.

The folder is written beside the target under a hidden name and renamed when complete, so a reader
never sees half of one. `PreparedTokens` opens it: the sizes are checked against the metadata (a
truncated copy fails at once) and the tokens are a read-only `np.memmap`, so a rank's start-up time
and memory do not grow with the corpus. `BlendedBlocks` mixes several folders by weight.

Why a memmap of our own and not LitData's `optimize` / `StreamingDataset`: the token stream must be
cut into the same global batches at any dp size and resumed mid-epoch by ultrascale's
`ResumableBlockSampler` (which indexes blocks); LitData's streaming dataset brings its own shuffling,
chunk cache and distributed sampling, and is not among ultrascale's dependencies.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import Dataset

from ultrascale.data.errors import DataError, DataNotFound

__all__ = ["BlendedBlocks", "PreparedTokens", "is_prepared", "prepare_chat_data", "prepare_data"]

FORMAT = "ultrascale-tokens"
FORMAT_VERSION = 1
METADATA, TOKENS, DOCUMENTS, ASSISTANT = "metadata.json", "tokens.bin", "documents.npy", "assistant.bin"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                    "tokenizer.model", "added_tokens.json")
_BATCH_DOCUMENTS = 256  # documents per task sent to a tokenizing worker


# --------------------------------------------------------------------------- reading the inputs


def _saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_info.json").is_file() or (folder / "dataset_dict.json").is_file()


def _input_files(inputs: Sequence[str]) -> list[tuple[Path, str]]:
    """(file or saved-dataset folder, kind) for every input, folders expanded in sorted order."""
    found: list[tuple[Path, str]] = []
    for given in inputs:
        path = Path(given)
        if not path.exists():
            raise DataNotFound(f"input {given!r} does not exist")
        if path.is_dir() and _saved_dataset(path):
            found.append((path, "dataset"))
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*")
                           if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
            found.extend((p, _kind(p)) for p in files)
        else:
            found.append((path, _kind(path)))
    if not found:
        raise DataError(f"no input files under {list(inputs)}")
    return found


def _kind(path: Path) -> str:
    suffix = path.suffix.lower()
    return {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}.get(suffix, "text")


@dataclass
class DecodeCount:
    """Bytes of the inputs that are not UTF-8: replaced by U+FFFD (counted here), or, under `strict`, refused."""

    strict: bool = False
    replaced_bytes: int = 0
    documents: int = 0
    """Documents with at least one replaced byte."""

    def decode(self, data: bytes, where: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            if self.strict:
                raise DataError(f"{where}: byte {error.start + 1} is not UTF-8 ({error.reason}); "
                                "drop --strict to replace such bytes with U+FFFD (they are counted)") from None
        text = data.decode("utf-8", errors="replace")
        # surrogateescape maps each undecodable byte to one lone surrogate U+DC80..U+DCFF: a linear count, no handler
        # registered process-wide.
        self.replaced_bytes += sum(1 for c in data.decode("utf-8", errors="surrogateescape") if "\udc80" <= c <= "\udcff")
        self.documents += 1
        return text


def iter_documents(inputs: Sequence[str], text_field: str = "text", decoding: Optional[DecodeCount] = None) -> Iterator[str]:
    """The documents of `inputs` in order: a text file is one document; a JSONL line, a Parquet row or a
    saved dataset's row is one (its `text_field`). A record that cannot be read is a ValueError naming its
    file and line (JSONL) or row group and row (Parquet); bytes that are not UTF-8 go through `decoding`."""
    decoding = decoding if decoding is not None else DecodeCount()
    for path, kind in _input_files(inputs):
        if kind == "text":
            yield decoding.decode(path.read_bytes(), str(path))
        elif kind == "jsonl":
            with path.open("rb") as lines:
                for number, raw in enumerate(lines, 1):
                    where = f"{path}:{number}"
                    line = decoding.decode(raw, where)
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line.rstrip("\r\n"))  # a column on this line, not the next
                    except json.JSONDecodeError as error:
                        raise DataError(f"{where}: not valid JSON ({error.msg}, column {error.colno})") from None
                    yield _field(record, text_field, where)
        elif kind == "parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            if text_field not in parquet.schema_arrow.names:
                raise DataError(f"{path}: no column `{text_field}`; columns: {parquet.schema_arrow.names}")
            for group in range(parquet.num_row_groups):
                values = parquet.read_row_group(group, columns=[text_field]).column(0).to_pylist()
                for row, value in enumerate(values):
                    if not isinstance(value, str):
                        raise DataError(f"{path} row group {group}, row {row}: field `{text_field}` must be a string, "
                                        f"got {'null' if value is None else type(value).__name__}")
                yield from values
        else:
            import datasets

            dataset = datasets.load_from_disk(str(path))
            if isinstance(dataset, datasets.DatasetDict):
                if "train" not in dataset:
                    raise DataError(f"{path} holds splits {sorted(dataset)} and no 'train'")
                dataset = dataset["train"]
            if text_field not in dataset.column_names:
                raise DataError(f"{path}: no column `{text_field}`; columns: {dataset.column_names}")
            for batch in dataset.select_columns([text_field]).iter(batch_size=1024):
                yield from batch[text_field]


def _field(record: Any, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, not a record (an object with a `{text_field}` field)")
    if text_field not in record:
        raise DataError(f"{where}: field `{text_field}` is missing; fields present: {sorted(record)} "
                        "(--text-field names another)")
    if not isinstance(record[text_field], str):
        raise DataError(f"{where}: field `{text_field}` must be a string, got {type(record[text_field]).__name__}")
    return record[text_field]


def _batched(documents: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# --------------------------------------------------------------------------- tokenizing

_worker_tokenizer: Any = None


def _load(tokenizer_dir: str) -> Any:
    """The Hugging Face tokenizer in `tokenizer_dir` (`load_tokenizer` checks it has the EOS that ends documents)."""
    from ultrascale.data.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_dir).tokenizer


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_tokenizer = _load(tokenizer_dir)


def _encode(batch: list[str], dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """One batch of documents: their tokens, each followed by EOS, and each document's length (with EOS).
    Empty documents are dropped (they would only add a stray EOS)."""
    tokenizer = _worker_tokenizer
    encoded = tokenizer(batch, add_special_tokens=False)["input_ids"]
    encoded = [ids for ids in encoded if ids]
    lengths = np.array([len(ids) + 1 for ids in encoded], dtype=np.int64)
    eos = tokenizer.eos_token_id
    flat = np.fromiter((t for ids in encoded for t in (*ids, eos)), dtype=dtype, count=int(lengths.sum()))
    return flat, lengths


def tokenizer_fingerprint(tokenizer_dir: str | Path) -> str:
    """SHA-256 over the tokenizer's files (names and bytes): two folders with the same vocabulary and
    rules give the same fingerprint wherever they live."""
    digest = hashlib.sha256()
    folder = Path(tokenizer_dir)
    for name in _TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


@contextlib.contextmanager
def _staged(out: Path, progress: bool) -> Iterator[tuple[Path, Any]]:
    """``(staging folder, progress bar or None)``: what is written there becomes `out` when the block ends (one
    rename, so a reader never sees half of it), and is removed if it raises."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    bar = _progress(progress)
    try:
        yield staging, bar
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        if bar is not None:
            bar.close()


def _checked_target(out: str | Path, tokenizer_dir: str | Path, workers: int, overwrite: bool) -> Path:
    out = Path(out).resolve()
    if workers < 1:
        raise ValueError(f"prepare-data: --workers={workers} must be >= 1")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"prepare-data: {out} exists and is not empty (pass --overwrite to replace it)")
    if not Path(tokenizer_dir).is_dir():
        raise FileNotFoundError(f"prepare-data: tokenizer folder {tokenizer_dir} does not exist")
    return out


def _common_metadata(tokenizer: Any, tokenizer_dir: str | Path, dtype: np.dtype, total: int, staging: Path,
                     lengths: list[np.ndarray]) -> dict[str, Any]:
    """documents.npy written from `lengths`; the metadata both kinds of folder share."""
    counts = np.concatenate(lengths)
    np.save(staging / DOCUMENTS, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))
    return {"format": FORMAT, "version": FORMAT_VERSION, "dtype": dtype.name, "num_tokens": int(total),
            "num_documents": int(counts.size),
            "tokenizer": {"name": getattr(tokenizer, "name_or_path", str(tokenizer_dir)),
                          "sha256": tokenizer_fingerprint(tokenizer_dir), "vocab_size": len(tokenizer),
                          "eos_id": int(tokenizer.eos_token_id)}}


def prepare_data(
    inputs: Sequence[str],
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    workers: int = 1,
    text_field: str = "text",
    overwrite: bool = False,
    progress: bool = True,
    strict: bool = False,
) -> Path:
    """Tokenize `inputs` once into the folder `out` (see the module docstring); returns its path.

    `workers` processes tokenize batches of documents in parallel; the output is the same for any number
    of them (batches are written in input order). Bytes that are not UTF-8 are replaced by U+FFFD and
    counted in metadata.json (`replaced_bytes`); `strict` refuses them, naming the file and line."""
    out = _checked_target(out, tokenizer_dir, workers, overwrite)
    files = _input_files(inputs)  # every input checked before any work
    tokenizer = _load(str(tokenizer_dir))
    dtype = token_dtype(len(tokenizer))
    lengths: list[np.ndarray] = []
    started = time.perf_counter()
    with _staged(out, progress) as (staging, bar):
        decoding = DecodeCount(strict)
        batches = _batched(iter_documents(inputs, text_field, decoding), _BATCH_DOCUMENTS)
        with (staging / TOKENS).open("wb") as sink:
            if workers == 1:
                _init_worker(str(tokenizer_dir))
                results: Iterable[tuple[np.ndarray, np.ndarray]] = (_encode(b, dtype.str) for b in batches)
                total = _write(results, sink, lengths, bar)
            else:
                context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
                with context.Pool(workers, initializer=_init_worker, initargs=(str(tokenizer_dir),)) as pool:
                    results = pool.imap(_encode_batch_star, ((b, dtype.str) for b in batches), chunksize=1)
                    total = _write(results, sink, lengths, bar)
        if total == 0:
            raise DataError(f"the inputs {list(inputs)} hold no text")
        metadata = {
            **_common_metadata(tokenizer, tokenizer_dir, dtype, total, staging, lengths),
            "sources": [str(path) for path, _ in files], "text_field": text_field,
            "seconds": time.perf_counter() - started, "workers": workers,
            "replaced_bytes": decoding.replaced_bytes, "documents_with_replaced_bytes": decoding.documents,
        }
        (staging / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    return out


def _encode_batch_star(task: tuple[list[str], str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode(*task)


def _progress(enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(unit=" tokens", unit_scale=True, desc="prepare-data", file=sys.stderr)


def _write(results: Iterable[tuple[np.ndarray, np.ndarray]], sink: Any, lengths: list[np.ndarray], bar: Any) -> int:
    total = 0
    for tokens, counts in results:
        sink.write(tokens.tobytes())
        lengths.append(counts)
        total += tokens.size
        if bar is not None:
            bar.update(tokens.size)
    return total


# --------------------------------------------------------------------------- conversations

_worker_encoder: Any = None
_BATCH_CONVERSATIONS = 64


def _init_chat_worker(tokenizer_dir: str, template: str, end_of_turn: Optional[str]) -> None:
    from ultrascale.data.chat import ChatEncoder

    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker_encoder = ChatEncoder(_load(tokenizer_dir), template, max_ids=2**62, end_of_turn=end_of_turn)


def _encode_conversations(batch: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One batch of conversations: their tokens, assistant masks (uint8) and lengths, concatenated."""
    encoded = [_worker_encoder.assistant_tokens(conversation) for conversation in batch]
    ids = np.concatenate([i for i, _ in encoded]) if encoded else np.zeros(0, np.int32)
    mask = np.concatenate([m for _, m in encoded]).astype(np.uint8) if encoded else np.zeros(0, np.uint8)
    return ids, mask, np.array([i.size for i, _ in encoded], dtype=np.int64)


def read_conversations(inputs: Sequence[str], messages_field: str = "messages") -> Iterator[Any]:
    """The conversations of `inputs` (files or folders `InstructionDataModule` reads), checked record by record:
    a record that is not one is a ValueError naming its file and line (row)."""
    from ultrascale.data.chat import conversation_of
    from ultrascale.data.records import read_records

    for given in inputs:
        for where, record in read_records(given):
            conversation = conversation_of(record, messages_field, where)
            if conversation is None:
                raise DataError(f"{where}: field `{messages_field}` is missing (nor are `prompt` and `completion` "
                                 f"message lists); fields present: {sorted(record)}")
            yield conversation


def prepare_chat_data(
    inputs: Sequence[str],
    tokenizer_dir: str | Path,
    out: str | Path,
    *,
    chat_template: Optional[str] = None,
    messages_field: str = "messages",
    end_of_turn: Optional[str] = None,
    workers: int = 1,
    overwrite: bool = False,
    progress: bool = True,
) -> Path:
    """Render and tokenize the conversations of `inputs` once into the folder `out` (the module docstring's
    `assistant.bin` layout): `chat_template` (its text or a file; None: the tokenizer's own), `end_of_turn` (None:
    the tokenizer's EOS) as `InstructionDataModule` takes them. Same output for any number of `workers`."""
    from ultrascale.data.chat import resolve_chat_template

    out = _checked_target(out, tokenizer_dir, workers, overwrite)
    tokenizer = _load(str(tokenizer_dir))
    template = resolve_chat_template(chat_template, tokenizer, str(tokenizer_dir))
    _init_chat_worker(str(tokenizer_dir), template, end_of_turn)  # the options checked here, before any work
    dtype = token_dtype(len(tokenizer))
    lengths: list[np.ndarray] = []
    started = time.perf_counter()
    with _staged(out, progress) as (staging, bar):
        batches = _batched(read_conversations(inputs, messages_field), _BATCH_CONVERSATIONS)
        with (staging / TOKENS).open("wb") as tokens, (staging / ASSISTANT).open("wb") as assistant:
            if workers == 1:
                results: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]] = map(_encode_conversations, batches)
                total = _write_chat(results, tokens, assistant, dtype, lengths, bar)
            else:
                context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
                with context.Pool(workers, initializer=_init_chat_worker,
                                  initargs=(str(tokenizer_dir), template, end_of_turn)) as pool:
                    results = pool.imap(_encode_conversations, batches, chunksize=1)
                    total = _write_chat(results, tokens, assistant, dtype, lengths, bar)
        if total == 0:
            raise DataError(f"the inputs {list(inputs)} hold no conversation")
        metadata = {
            **_common_metadata(tokenizer, tokenizer_dir, dtype, total, staging, lengths), "kind": "chat",
            "chat_template": template, "end_of_turn_id": _worker_encoder.end_of_turn_id,
            "messages_field": messages_field, "sources": [str(Path(given)) for given in inputs],
            "seconds": time.perf_counter() - started, "workers": workers,
        }
        (staging / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    return out


def _write_chat(results: Iterable[tuple[np.ndarray, np.ndarray, np.ndarray]], tokens: Any, assistant: Any,
                dtype: np.dtype, lengths: list[np.ndarray], bar: Any) -> int:
    total = 0
    for ids, mask, counts in results:
        tokens.write(ids.astype(dtype).tobytes())
        assistant.write(mask.tobytes())
        lengths.append(counts)
        total += ids.size
        if bar is not None:
            bar.update(ids.size)
    return total


# --------------------------------------------------------------------------- reading a prepared folder


def is_prepared(path: Any) -> bool:
    """Whether `path` is a folder written by `prepare_data`."""
    return isinstance(path, (str, os.PathLike)) and (Path(path) / METADATA).is_file()


@dataclass
class PreparedTokens:
    """A prepared folder, checked and memory-mapped (`open`)."""

    path: Path
    metadata: dict[str, Any]
    tokens: np.ndarray  # read-only np.memmap
    document_starts: np.ndarray  # (n_documents + 1,) int64, memory-mapped
    assistant: Optional[np.ndarray] = None  # conversations: uint8 per token, read-only np.memmap

    @property
    def is_chat(self) -> bool:
        return self.metadata.get("kind") == "chat"

    @classmethod
    def open(cls, path: str | Path) -> "PreparedTokens":
        path = Path(path)
        try:
            metadata = json.loads((path / METADATA).read_text())
        except (OSError, ValueError) as error:
            raise DataError(f"{path} is not a prepared data folder (`ultrascale prepare-data`): {error}") from None
        if metadata.get("format") != FORMAT or metadata.get("version") != FORMAT_VERSION:
            raise DataError(f"{path}: format {metadata.get('format')!r} v{metadata.get('version')}; this ultrascale reads "
                             f"{FORMAT!r} v{FORMAT_VERSION} (prepare it again)")
        dtype = np.dtype(metadata["dtype"])
        expected = metadata["num_tokens"] * dtype.itemsize
        tokens_file = path / TOKENS
        found = tokens_file.stat().st_size if tokens_file.is_file() else None
        if found != expected:
            raise DataError(
                f"{tokens_file} holds {found if found is not None else 'no'} bytes, its metadata says "
                f"{metadata['num_tokens']:,} tokens of {dtype.name} = {expected:,} bytes: the copy is truncated or "
                "incomplete; copy or prepare it again"
            )
        starts = np.load(path / DOCUMENTS, mmap_mode="r")
        if starts.shape != (metadata["num_documents"] + 1,) or int(starts[-1]) != metadata["num_tokens"]:
            raise DataError(f"{path / DOCUMENTS} does not match {METADATA} (documents or tokens differ): prepare it again")
        tokens = np.memmap(tokens_file, dtype=dtype, mode="r", shape=(metadata["num_tokens"],))
        assistant = None
        if metadata.get("kind") == "chat":
            mask_file = path / ASSISTANT
            found = mask_file.stat().st_size if mask_file.is_file() else None
            if found != metadata["num_tokens"]:
                raise DataError(f"{mask_file} holds {found if found is not None else 'no'} bytes, one per token of "
                                 f"{metadata['num_tokens']:,}: the copy is truncated or incomplete; prepare it again")
            assistant = np.memmap(mask_file, dtype=np.uint8, mode="r", shape=(metadata["num_tokens"],))
        return cls(path, metadata, tokens, starts, assistant)

    @property
    def vocab_size(self) -> int:
        return int(self.metadata["tokenizer"]["vocab_size"])

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.metadata["tokenizer"]["sha256"])

    def positions(self, start: int, stop: int) -> np.ndarray:
        """Positions of tokens [start, stop) as a packed block's: 0 at `start` (the block's piece of the document
        it starts in) and again at every document that starts inside the block."""
        index = np.arange(start, stop, dtype=np.int64)
        document = np.searchsorted(self.document_starts, index, side="right") - 1
        return index - np.maximum(np.asarray(self.document_starts[document]), start)


class BlendedBlocks(Dataset):
    """Blocks of `seq_len + 1` tokens from one or several prepared folders, mixed by weight.

    Source s contributes its k-th block at "time" (k + 1/2) / w_s; all blocks in order of time (ties:
    the lower source first) interleave so that among the first n samples source s has n·w_s of them
    within one (deterministic, the same on every rank, resumable by index). The blend is as long as
    the weights allow without repeating a block: n = min over sources of blocks_s / w_s.

    No index is built: sample i is found by counting, per source, the blocks due before a given time
    (closed form, then checked with the same float comparison a sort would make), and a binary
    search over each source's blocks: O(S² log n) per sample for S sources, nothing per block. (An
    index was 9 bytes a block on every rank, and its sort held 3x that: for 1T tokens at 4k sequences,
    6 GB and half a minute per rank.)

    Item i: `input_ids`, `labels` (int64), and with `document_positions` `position_ids` restarting
    at every document (document masking for pretraining).
    """

    def __init__(self, sources: Sequence[PreparedTokens], weights: Sequence[float], seq_len: int, *,
                 max_blocks: Optional[int] = None, document_positions: bool = False) -> None:
        if len(sources) != len(weights) or not sources:
            raise ValueError("BlendedBlocks: one weight per source")
        if any(w <= 0 for w in weights):
            raise ValueError(f"BlendedBlocks: weights must be positive, got {list(weights)}")
        self.sources, self.seq_len, self.document_positions = list(sources), seq_len, document_positions
        total = float(sum(weights))
        self.weights = [w / total for w in weights]
        blocks = [s.tokens.size // (seq_len + 1) for s in sources]
        if len(sources) == 1:
            self.available = blocks
            self.length = blocks[0] if max_blocks is None else min(blocks[0], max_blocks)
            return
        length = int(min(b / w for b, w in zip(blocks, self.weights)))
        if max_blocks is not None:
            length = min(length, max_blocks)
        # Each source's candidates: a block past n·w_s + 1 can never be among the first n.
        self.available = [min(int(np.ceil(length * w)) + 1, b) for w, b in zip(self.weights, blocks)]
        self.length = length

    def _time(self, source: int, block: int) -> float:
        return (block + 0.5) / self.weights[source]

    def _due(self, source: int, time: float, inclusive: bool) -> int:
        """How many of `source`'s blocks come at a time before `time` (or at it, if `inclusive`)."""
        w, available = self.weights[source], self.available[source]
        before = (lambda k: self._time(source, k) <= time) if inclusive else (lambda k: self._time(source, k) < time)
        count = min(max(int(np.ceil(time * w - 0.5)), 0), available)  # the closed form, then the exact comparison
        while count > 0 and not before(count - 1):
            count -= 1
        while count < available and before(count):
            count += 1
        return count

    def _position(self, source: int, block: int) -> int:
        """Where block `block` of `source` stands in the blend: the blocks due before it (ties: lower sources)."""
        time = self._time(source, block)
        return block + sum(self._due(s, time, inclusive=s < source) for s in range(len(self.sources)) if s != source)

    def locate(self, index: int) -> tuple[int, int]:
        """(source, block) of sample `index`."""
        if len(self.sources) == 1:
            return 0, index
        for source in range(len(self.sources)):
            low, high = 0, self.available[source] - 1  # the last block of `source` at or before `index`
            if high < 0 or self._position(source, low) > index:
                continue
            while low < high:
                middle = (low + high + 1) // 2
                if self._position(source, middle) <= index:
                    low = middle
                else:
                    high = middle - 1
            if self._position(source, low) == index:
                return source, low
        raise AssertionError(f"BlendedBlocks: no block at position {index}")  # positions are a bijection

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"block {index} out of range for {self.length} blocks")
        which, block = self.locate(index)
        source = self.sources[which]
        start = block * (self.seq_len + 1)
        ids = torch.from_numpy(np.asarray(source.tokens[start : start + self.seq_len + 1], dtype=np.int64))
        item = {"input_ids": ids[:-1], "labels": ids[1:]}
        if self.document_positions:
            item["position_ids"] = torch.from_numpy(source.positions(start, start + self.seq_len))
        return item

    def source_counts(self, count: int) -> list[int]:
        """How many of the first `count` samples come from each source."""
        count = min(count, self.length)
        if len(self.sources) == 1 or count == 0:
            return [count] + [0] * (len(self.sources) - 1)
        last, block = self.locate(count - 1)
        time = self._time(last, block)
        return [block + 1 if s == last else self._due(s, time, inclusive=s < last) for s in range(len(self.sources))]
