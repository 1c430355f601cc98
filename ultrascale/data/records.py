"""Records of the fine-tuning data, read the same way wherever they are kept: JSONL, Parquet, folders of them, or a
`datasets` dataset saved with `save_to_disk`; each record with where it is (``FILE:LINE``, ``FILE row N``)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ultrascale.data.errors import DataError, DataNotFound

__all__ = ["read_records"]

# Files `Dataset.save_to_disk` / `DatasetDict.save_to_disk` always write.
_SAVED_DATASET_MARKERS = ("state.json", "dataset_dict.json")


def _read_jsonl(files: Sequence[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    for f in files:
        with f.open("rb") as lines:
            for lineno, raw in enumerate(lines, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataError(f"{f}:{lineno}: byte {e.start + 1} of the line is not UTF-8 ({e.reason}); "
                                    "JSONL is UTF-8 text") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))  # a column on this line, not the next
                except json.JSONDecodeError as e:
                    raise DataError(f"{f}:{lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
                if not isinstance(record, dict):
                    raise DataError(f"{f}:{lineno}: expected a JSON object per line, got {type(record).__name__}")
                yield f"{f}:{lineno}", record


def _read_parquet(files: Sequence[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    import pyarrow.parquet as pq  # a dependency of `datasets`; imported lazily: only needed for this input kind

    for f in files:
        row = 0
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # pyarrow's ArrowInvalid and OSError: not a Parquet file, or a cut one
            raise DataError(f"{f}: not a readable Parquet file ({e})") from None
        # Batched so `max_examples` can stop early without materialising the whole file.
        for batch in parquet.iter_batches(batch_size=1000):
            for record in batch.to_pylist():
                yield f"{f} row {row}", record
                row += 1


def _read_saved_dataset(folder: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    import datasets  # imported lazily: only needed for this input kind

    try:
        ds = datasets.load_from_disk(str(folder))
    except (ValueError, OSError) as e:  # a folder save_to_disk did not finish, or another's
        raise DataError(f"{folder}: not a readable saved dataset ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise DataError(
                f"`data_path={str(folder)!r}` holds a DatasetDict without a 'train' split (splits: {sorted(ds)}); "
                "save a single Dataset or one with a 'train' split"
            )
        # The validation split is carved from the tail of the packed blocks, so only one split is read.
        ds = ds["train"]
    for b, batch in enumerate(ds.iter(batch_size=1000)):
        columns = list(batch)
        for i, values in enumerate(zip(*(batch[c] for c in columns))):
            yield f"{folder} row {b * 1000 + i}", dict(zip(columns, values))


def read_records(data_path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, record)`` from a ``.jsonl`` or ``.parquet`` file, a folder of them, or a saved dataset;
    ``where`` is ``FILE:LINE`` (``FILE row N`` for Parquet, ``FOLDER row N`` for a saved dataset).

    A folder holding ``state.json`` or ``dataset_dict.json`` is read with
    ``datasets.load_from_disk`` (its ``train`` split for a ``DatasetDict``);
    any other folder contributes its ``*.jsonl`` and ``*.parquet`` files (not
    recursive), in sorted name order so every rank reads the same sequence.
    """
    path = Path(data_path)
    if path.is_file():
        return _read_parquet([path]) if path.suffix == ".parquet" else _read_jsonl([path])
    if not path.is_dir():
        raise DataNotFound(
            f"`data_path={data_path!r}` does not exist; expected a .jsonl or .parquet file, a folder of them "
            "or a folder written by `Dataset.save_to_disk`"
        )
    if any((path / marker).is_file() for marker in _SAVED_DATASET_MARKERS):
        return _read_saved_dataset(path)
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".jsonl", ".parquet"))
    if not files:
        raise DataError(
            f"`data_path={data_path!r}` is a folder with no *.jsonl or *.parquet files and is not a saved `datasets` "
            f"dataset (no {' / '.join(_SAVED_DATASET_MARKERS)}); it is empty for instruction data"
        )
    return _read_files(files)


def _read_files(files: Sequence[Path]) -> Iterator[tuple[str, dict[str, Any]]]:
    for f in files:
        yield from _read_parquet([f]) if f.suffix == ".parquet" else _read_jsonl([f])
