"""Sequence packing: a micro-batch's rows as one padding-free row.

Batches arrive padded to their widest row ([rows, width], tokens.training_tensors); a forward
over that layout computes every padding position too (in the loop's batches a third to a half
of the positions, since episodes differ in length). Packed, the micro-batch's real tokens are
concatenated into a single row with position ids restarting at 0 for each sequence; with no
attention mask and no KV cache, transformers builds a block-diagonal causal mask from those
position ids (masking_utils.find_packed_sequence_indices), so no token attends across a
sequence boundary and each sequence's log-probs equal its padded forward's (to fp32 rounding:
tests/test_packing.py). Routing replay needs no change: MoE routing is per token, so the
recorded experts are packed the same way as the ids.

Everything outside the forward keeps the padded layout: `unpack` scatters the packed log-probs
back to [rows, width] (column 0 of each row and every padding position 0, as sampled_logprobs
gives column 0), so correction weights, surrogates, aggregation and reports are unchanged.

`micro_batches_by_tokens` cuts a rank's rows into micro-batches of about `budget` real tokens.
Every rank must run the same number of forwards (FSDP's per-layer all-gathers are
collectives), so the count is agreed across ranks (the largest any rank needs) and each rank
cuts its rows into exactly that many micro-batches, balanced by tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, N]: the real tokens of every row, concatenated
    position_ids: torch.Tensor  # [1, N]: 0.. within each row
    experts: torch.Tensor | None  # [1, N, layers, k] (the recorded experts of those tokens) or None
    counted: torch.Tensor | None  # [1, N]: where replay statistics count
    valid: torch.Tensor  # [rows, width] bool: the positions that were packed
    index: torch.Tensor  # [rows, width] long: each valid position's index in the packed row (0 elsewhere)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, experts: torch.Tensor | None = None,
         counted: torch.Tensor | None = None) -> Packed:
    """The attended positions of [rows, width] tensors as one row (any padding side)."""
    valid = attention_mask.bool()
    positions = valid.long().cumsum(1) - 1  # 0.. over each row's attended positions
    flat = valid.reshape(-1)
    index = torch.zeros_like(positions)
    index[valid] = torch.arange(int(flat.sum()), device=input_ids.device)
    return Packed(input_ids=input_ids[valid][None], position_ids=positions[valid][None],
                  experts=None if experts is None else experts[valid][None],
                  counted=None if counted is None else counted[valid][None], valid=valid, index=index)


def unpack(lp: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Packed [1, N] log-probs back to [rows, width]: 0 at padding and at each row's first
    token (the packed row holds there the log-prob given the previous row's tokens)."""
    out = lp[0][packed.index]
    keep = packed.valid & (packed.valid.long().cumsum(1) > 1)
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def packed_forward(model, packed: Packed):
    """model's output for a packed row: no attention mask (the packed block-diagonal mask comes
    from the position ids) and no cache (with one, transformers would not look for packing)."""
    return model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)


def micro_batches_by_tokens(lengths: list[int], budget: int, count: int | None = None) -> list[range]:
    """Row ranges (in order) of at most `budget` tokens each (a longer row alone), or, with
    `count`, exactly `count` ranges balanced by tokens (count <= len(lengths))."""
    if count is None:
        ranges, start, used = [], 0, 0
        for i, n in enumerate(lengths):
            if i > start and used + n > budget:
                ranges.append(range(start, i))
                start, used = i, 0
            used += n
        if start < len(lengths) or not lengths:
            ranges.append(range(start, len(lengths)))
        return ranges
    if not 1 <= count <= max(len(lengths), 1):
        raise ValueError(f"cannot cut {len(lengths)} rows into {count} micro-batches")
    total, ranges, start, used = sum(lengths), [], 0, 0
    for i, n in enumerate(lengths):
        left_rows, left_cuts = len(lengths) - i, count - len(ranges) - 1
        # close the current range before row i once it holds its share of the tokens, or when
        # every remaining range needs one of the remaining rows
        if i > start and left_cuts > 0 and (used + n / 2 > total * (len(ranges) + 1) / count or left_rows == left_cuts):
            ranges.append(range(start, i))
            start = i
        used += n
    ranges.append(range(start, len(lengths)))
    return ranges
