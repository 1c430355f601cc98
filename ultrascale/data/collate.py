"""How a rank's rows of ``seq_len`` become its batch: cut to the longest row (:class:`PadToLongest`) or laid end to
end in one row without padding (:class:`PaddingFree`), lengths rounded by :func:`padded_length`."""

from __future__ import annotations

import torch
from torch.utils.data import default_collate

from ultrascale.parallel.loss import IGNORE_INDEX, content_lengths


def padded_length(longest: int, multiple: int, cap: int, buckets: bool = False) -> int:
    """A batch's length for `longest` positions of content: ``min(cap, ceil(longest / multiple) * multiple)``; with
    `buckets`, ``multiple * 2^k`` for the least k that holds it (at most log2(cap / multiple) + 1 shapes)."""
    units = -(-longest // multiple)
    if buckets:
        units = 1 << (units - 1).bit_length()
    return min(cap, units * multiple)


class PadToLongest:
    """Collate rows of ``seq_len`` into a batch cut to its longest row's content
    (:func:`~ultrascale.parallel.loss.content_lengths`), rounded up to `multiple` and capped at `seq_len`: the
    padding a block carries after its last example is never computed."""

    def __init__(self, multiple: int, seq_len: int, buckets: bool = False) -> None:
        self.multiple, self.seq_len, self.buckets = multiple, seq_len, buckets

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(rows)
        length = self.length(batch["position_ids"], batch["labels"])
        return {key: value[:, :length] for key, value in batch.items()} if length < batch["input_ids"].shape[1] else batch

    def length(self, position_ids: torch.Tensor, labels: torch.Tensor) -> int:
        """The batch's padded length (`padded_length` of its longest row's content, capped at `seq_len`)."""
        longest = int(content_lengths(position_ids, labels).max())
        return padded_length(longest, self.multiple, self.seq_len, self.buckets)


class PaddingFree:
    """Collate rows of ``seq_len`` into one row: each cut to its content (:func:`~ultrascale.parallel.loss.
    content_lengths`) and laid end to end, the positions restarting at 0 where each row (and each example packed in
    it) starts, so the model attends within each example alone (TRL's ``padding_free``). The only padding is the
    rounding of the whole to `multiple` (`padded_length`, capped at rows x `seq_len`): a document of its own at the
    end, without a target. A batch of B rows becomes ``(1, T)`` with T about the sum of their lengths, where
    :class:`PadToLongest` computes B x the longest."""

    def __init__(self, multiple: int, seq_len: int, pad_id: int, buckets: bool = False) -> None:
        self.multiple, self.seq_len, self.pad_id, self.buckets = multiple, seq_len, pad_id, buckets

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = default_collate(rows)
        lengths = content_lengths(batch["position_ids"], batch["labels"]).tolist()
        pieces = {key: [value[b, :n] for b, n in enumerate(lengths)] for key, value in batch.items()}
        content = sum(lengths)
        tail = padded_length(content, self.multiple, len(rows) * self.seq_len, self.buckets) - content
        if tail:
            filler = {"input_ids": torch.full((tail,), self.pad_id, dtype=batch["input_ids"].dtype),
                      "labels": torch.full((tail,), IGNORE_INDEX, dtype=batch["labels"].dtype),
                      "position_ids": torch.arange(tail, dtype=batch["position_ids"].dtype)}
            for key in pieces:
                pieces[key].append(filler[key])
        return {key: torch.cat(values).unsqueeze(0) for key, values in pieces.items()}


__all__ = ["PadToLongest", "PaddingFree", "padded_length"]
