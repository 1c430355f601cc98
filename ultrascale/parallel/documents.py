"""Attention over packed documents, one document at a time: the rows of a padding-free or packed batch hold several
documents (a document starts wherever `position_ids` is 0), each attending to itself alone.

A dense block-diagonal mask over a row of T positions costs O(T²) scores whatever the documents' lengths; per
document it is sum(l_i²). For a padding-free batch of 8 sequences of about 130 tokens laid end to end (T = 1,047),
that is 8·130² = 135k score entries per head against 1.1M, and no (T, T) mask at all. torch's SDPA has no
variable-length entry point on CPU (flash-attn's varlen kernel is CUDA's), so each document is its own causal SDPA
call: one call per document and layer, cheap beside the matmuls of the document itself.
"""

from __future__ import annotations

from typing import Optional

import torch

from ultrascale.parallel.device import grouped_sdpa


def document_ids(position_ids: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """(B, T) document index per token of packed sequences (a document starts where the position is 0),
    or None when no row restarts after its first token (plain causal attention)."""
    if position_ids is None or position_ids.dim() != 2:
        return None
    starts = position_ids == 0
    if not starts[:, 1:].any():
        return None
    return starts.cumsum(-1)


def document_spans(documents: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row of ``documents`` (B, T) (a document number per token, non-decreasing along the row, as
    `context.document_ids` gives), the ``(start, end)`` of each document. One host sync for the batch."""
    B, T = documents.shape
    change = torch.ones(B, T, dtype=torch.bool, device=documents.device)
    change[:, 1:] = documents[:, 1:] != documents[:, :-1]
    rows, starts = change.nonzero(as_tuple=True)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(B)]
    for row, start in zip(rows.tolist(), starts.tolist()):
        spans[row].append(start)  # type: ignore[arg-type]
    return [[(s, e) for s, e in zip(row, row[1:] + [T])] for row in spans]  # type: ignore[operator]


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: torch.Tensor, *,
                       scale: Optional[float] = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention within each document: ``q`` (B, H, T, D), ``k``/``v`` (B, Hkv, T, D) grouped-query heads,
    ``documents`` (B, T) document numbers; returns (B, H, T, D). Equal to SDPA under the block-diagonal causal mask
    (`document_mask`), computed one document at a time. Under `torch.compile` the dense mask is used instead: a
    per-document loop would specialise the graph on every batch's lengths."""
    if torch.compiler.is_compiling():
        return grouped_sdpa(q, k, v, attn_mask=document_mask(documents), scale=scale, dropout_p=dropout_p)
    rows = []
    for b, spans in enumerate(document_spans(documents)):
        if len(spans) == 1:
            rows.append(grouped_sdpa(q[b : b + 1], k[b : b + 1], v[b : b + 1], is_causal=True, scale=scale,
                                     dropout_p=dropout_p))
            continue
        rows.append(torch.cat([
            grouped_sdpa(q[b : b + 1, :, s:e], k[b : b + 1, :, s:e], v[b : b + 1, :, s:e], is_causal=True, scale=scale,
                         dropout_p=dropout_p)
            for s, e in spans
        ], dim=2))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)


def document_mask(documents: torch.Tensor) -> torch.Tensor:
    """``(B, 1, T, T)`` bool: query t may attend to key s iff s <= t and both lie in the same document."""
    T = documents.shape[-1]
    same = documents.unsqueeze(-1) == documents.unsqueeze(-2)  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=documents.device).tril()
    return (same & causal).unsqueeze(1)


__all__ = ["document_attention", "document_ids", "document_mask", "document_spans"]
