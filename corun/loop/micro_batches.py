"""Token-budget micro-batches: how the update splits a part of a batch so that no
backward pass holds more than ``loop.micro_batch_tokens`` tokens.

A trainer that reports its rows' lengths (``Trainer.row_tokens``) has each part of a
batch (a micro-batch of ``Trainer.micro_batches``, within a mini-batch) split into
*chunks*: its rows sorted by length, longest first, then taken in order while the
chunk's rows x its longest row stays within the budget and its rows within
``loop.micro_batch_rows``. A row longer than the budget goes alone. Each chunk's rows
are handed to the trainer in batch order (``Part.chunk_rows``); the trainer cuts the
chunk to its own longest row and normalises its loss over the whole mini-batch, so
the chunks' gradients add up to the unsplit part's.

A part that fits whole is one chunk and is handed over as before (``chunk_rows`` is
None): the default budget keeps the shipped recipes' updates exactly as they were.

Under torchrun every rank must run as many forward and backward passes as the others
(FSDP2 gathers parameters in each, and a loss's shared counts are collectives), so the
ranks agree on each part's chunk count, the largest any rank needs, and a rank with
fewer splits its largest chunks further.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from corun.execution import distributed

Chunks = list[torch.Tensor]  # each a chunk's row indices (int64, ascending), in batch order


def plan_chunks(
    lengths: Sequence[int], start: int, stop: int, tokens: int, max_rows: int = 0
) -> Chunks | None:
    """Rows ``start:stop`` (of a batch whose rows cost ``lengths`` tokens) in chunks of at
    most ``tokens`` tokens (rows x the chunk's longest) and ``max_rows`` rows (0: any).
    None when they fit in one chunk (or ``tokens`` is 0: never split)."""
    count = stop - start
    if count <= 0 or (tokens <= 0 and max_rows <= 0):
        return None
    longest = max(lengths[start:stop])
    rows_cap = max_rows if max_rows > 0 else count
    if (tokens <= 0 or count * longest <= tokens) and count <= rows_cap:
        return None
    # Longest first, ties in batch order: a chunk's first row is its longest.
    order = sorted(range(start, stop), key=lambda row: (-lengths[row], row))
    chunks: list[list[int]] = []
    for row in order:
        current = chunks[-1] if chunks else None
        if current is not None and _fits(len(current) + 1, lengths[current[0]], tokens, rows_cap):
            current.append(row)
        else:
            chunks.append([row])
    return [torch.tensor(sorted(chunk), dtype=torch.long) for chunk in chunks]


def _fits(rows: int, longest: int, tokens: int, rows_cap: int) -> bool:
    return rows <= rows_cap and (tokens <= 0 or rows * longest <= tokens)


def split_to(chunks: Chunks, count: int) -> Chunks:
    """``chunks`` split further (the one with most rows in two, again and again) until
    there are ``count`` of them: for a rank that needs fewer than its peers."""
    chunks = list(chunks)
    while len(chunks) < count:
        largest = max(range(len(chunks)), key=lambda i: (chunks[i].numel(), -i))
        rows = chunks[largest]
        if rows.numel() < 2:
            raise RuntimeError(
                f"the update cannot make {count} micro-batches of {sum(c.numel() for c in chunks)} "
                "rows to match its peer ranks (each needs a row)"
            )
        half = (rows.numel() + 1) // 2
        chunks[largest : largest + 1] = [rows[:half], rows[half:]]
    return chunks


def agree_counts(counts: list[int]) -> list[int]:
    """Each part's chunk count, the largest over the ranks (one collective; the same
    list at world size 1)."""
    if not distributed.world().parallel or not counts:
        return counts
    wide = torch.tensor(counts, dtype=torch.float64)
    distributed.all_reduce_max(wide, "the micro-batch counts' all-reduce")
    return [int(c) for c in wide.tolist()]
