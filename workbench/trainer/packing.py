"""Sequence packing: a micro-batch's rows in fewer rows, with less padding.

Batches arrive padded to their widest row ([rows, width], tokens.training_tensors). Packed, a
micro-batch's rows are placed first-fit decreasing into as few rows of the same width, each
sequence's position ids restarting at 0; with no attention mask, transformers builds a
block-diagonal causal mask from those position ids, so each sequence's log-probs equal its padded
forward's (tests/test_packing.py). Routed experts are packed like the ids (-1 in unused tails).
Everything outside the forward keeps the padded layout (`unpack`). Micro-batches are cut by a
token budget, the same count on every rank (FSDP's all-gathers are collectives).
docs/ARCHITECTURE.md ("Trainer and RL loop") has why rows keep the batch's width (measured).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Packed:
    input_ids: torch.Tensor  # [packed rows, width]: the rows' real tokens, several rows to a packed row
    position_ids: torch.Tensor  # [packed rows, width]: 0.. within each packed sequence (a row's tail too)
    experts: torch.Tensor | None  # [packed rows, width, layers, k] (-1 in tails: live routing) or None
    counted: torch.Tensor | None  # [packed rows, width]: where replay statistics count (never in tails)
    compared: torch.Tensor | None  # [packed rows, width]: where its disagreement counts (routing_replay's compare)
    valid: torch.Tensor  # [rows, width] bool: the positions that were packed
    index: torch.Tensor  # [rows, width] long: each valid position's flat index in the packed rows (0 elsewhere)


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor, experts: torch.Tensor | None = None,
         counted: torch.Tensor | None = None, host_mask: torch.Tensor | None = None,
         compared: torch.Tensor | None = None) -> Packed:
    """The attended positions of [rows, width] tensors (any padding side), first-fit decreasing
    into as few packed rows as hold them, each as wide as the longest row.

    The plan (where each token goes) is made on the host from `host_mask`, the attention mask's
    CPU copy (default: read from `attention_mask`, a wait on a GPU), and moved to the tensors'
    device in one copy; the tensors are then moved by index only. Boolean-mask indexing on a GPU
    waits for the device (the result's size is data-dependent): six waits a micro-batch."""
    device = input_ids.device
    valid = (attention_mask if host_mask is None else host_mask).bool().cpu()
    lengths = valid.sum(1).tolist()
    width = max(lengths, default=0) or 1
    fill, start = [], [0] * len(lengths)  # tokens used per packed row; each row's flat start
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((r for r, used in enumerate(fill) if used + lengths[i] <= width), len(fill))
        if r == len(fill):
            fill.append(0)
        start[i], fill[r] = r * width + fill[r], fill[r] + lengths[i]
    positions = valid.long().cumsum(1) - 1  # 0.. over each row's attended positions
    dest = torch.tensor(start, dtype=torch.long)[:, None] + positions
    index = torch.where(valid, dest, torch.zeros_like(dest))
    n = len(fill) * width
    src, dst = valid.reshape(-1).nonzero()[:, 0], dest[valid]  # flat: where each real token is, where it goes
    # a packed row's unused tail is its own sequence (positions from 0), so no real token sees it
    pos = torch.cat([torch.cat([torch.zeros(used, dtype=torch.long), torch.arange(width - used)]) for used in fill])
    pos[dst] = positions[valid]
    src, dst, pos, index, valid = _to_device(device, src, dst, pos, index, valid)

    def moved(t: torch.Tensor, fill_value) -> torch.Tensor:  # t's real positions at their packed places
        flat = t.reshape(-1, *t.shape[2:])
        out = flat.new_full((n, *t.shape[2:]), fill_value)
        return out.index_copy_(0, dst, flat.index_select(0, src)).view(len(fill), width, *t.shape[2:])

    return Packed(input_ids=moved(input_ids, 0), position_ids=pos.view(len(fill), width),
                  experts=None if experts is None else moved(experts, -1),
                  counted=None if counted is None else moved(counted, 0),
                  compared=None if compared is None else moved(compared, 0), valid=valid, index=index)


def _to_device(device: torch.device, *host: torch.Tensor) -> list[torch.Tensor]:
    """Host tensors (long or bool) on `device` in one copy that does not wait for the device
    (pinned memory, non_blocking): the plan of a micro-batch is ready before its forward runs."""
    if device.type == "cpu":
        return list(host)
    flat = torch.cat([t.reshape(-1).long() for t in host]).pin_memory().to(device, non_blocking=True)
    out = list(flat.split([t.numel() for t in host]))
    return [o.view(t.shape).to(t.dtype) for o, t in zip(out, host)]


def unpack(lp: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Packed log-probs back to [rows, width]: 0 at padding and at each row's first token (the
    packed row holds there the log-prob given the tokens of the row packed before it)."""
    out = lp.reshape(-1)[packed.index]
    keep = packed.valid & (packed.valid.long().cumsum(1) > 1)
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def packed_forward(model, packed: Packed):
    """model's output for a packed row: no attention mask (the packed block-diagonal mask comes
    from the position ids) and no cache (with one, transformers would not look for packing)."""
    return model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False)


# How far a sequence's log-probs may move, on average, when the sequence packed before it changes
# (beyond twice the noise floor below): exactly 0 where a dense model builds the block-diagonal mask
# from the position ids (masked scores add exactly 0), hundredths to tenths of a nat where it does not
PACKING_LEAK_TOL = 1e-4


def packing_leak(model, vocab_size: int, device) -> tuple[float, float]:
    """(leak, noise): the mean change (nats, over the probe sequence's positions and the vocabulary)
    of a sequence's log-probs when the sequence packed before it in the same row is replaced by
    another, and the same change with the sequence packed first (which nothing before it can reach:
    what an MoE's batch-dependent kernels alone move, its experts' matmul shapes following the other
    sequence's routing; in bf16 a single rounding step of a logit is 0.03-0.12 nats, which a
    maximum would pick up and a mean dilutes, where a leak moves every log-prob). Packing is exact
    where the leak is within PACKING_LEAK_TOL plus twice the noise (packing_mixes). Not every model builds the block-diagonal mask from
    position ids: gpt-oss passes none to its mask builder (its packed sequences attended to the
    ones before them: 0.15-0.35 nats), and linear-attention layers (Qwen3-Next, Qwen3.5) carry
    their recurrent state across sequences unless told the boundaries. Run on every rank at once
    (a forward of the sharded model: collectives)."""
    g = torch.Generator().manual_seed(0)
    first, other, probe = (torch.randint(0, vocab_size, (n,), generator=g) for n in (7, 7, 5))

    def probe_logprobs(before: torch.Tensor, probe_first: bool) -> torch.Tensor:
        parts = (probe, before) if probe_first else (before, probe)
        ids = torch.cat(parts)[None].to(device)
        positions = torch.cat([torch.arange(len(p)) for p in parts])[None].to(device)
        logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
        at = slice(0, len(probe)) if probe_first else slice(len(before), None)
        return torch.log_softmax(logits[at].float(), dim=-1)

    with torch.no_grad():
        leak = (probe_logprobs(first, False) - probe_logprobs(other, False)).abs().mean()
        noise = (probe_logprobs(first, True) - probe_logprobs(other, True)).abs().mean()
    return float(leak), float(noise)


def packing_mixes(leak: float, noise: float) -> bool:
    """Whether packing_leak's result says the model mixes packed sequences (a NaN says so too:
    nothing shows it does not)."""
    return not leak <= PACKING_LEAK_TOL + 2 * noise


def micro_batches_by_tokens(lengths: list[int], budget: int, count: int | None = None) -> list[range]:
    """Row ranges (in order) of at most `budget` tokens each (a longer row alone). With `count`
    (what every rank agreed on: at least this rank's own number of ranges, at most its rows),
    exactly `count` ranges, each still within the budget: the ranges above, the largest of two or
    more rows cut in two, closest to its halves, until there are `count`. (Re-cut into `count`
    ranges balanced over the whole batch instead, a range went up to 1.6x the budget the user
    sized to fit activation memory, on every rank, one rank alone included.)"""
    ranges, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            ranges.append(range(start, i))
            start, used = i, 0
        used += n
    if start < len(lengths) or not lengths:
        ranges.append(range(start, len(lengths)))
    if count is None:
        return ranges
    if not len(ranges) <= count <= max(len(lengths), 1):
        raise ValueError(f"cannot cut {len(lengths)} rows of {budget}-token micro-batches into {count} micro-batches")
    while len(ranges) < count:
        j = max((j for j, r in enumerate(ranges) if len(r) > 1), key=lambda j: sum(lengths[k] for k in ranges[j]))
        r = ranges[j]
        total, prefix, best = sum(lengths[k] for k in r), 0, None
        for k in range(1, len(r)):  # the cut whose halves are closest (the later one on a tie)
            prefix += lengths[r.start + k - 1]
            if best is None or abs(2 * prefix - total) <= best[0]:
                best = (abs(2 * prefix - total), k)
        ranges[j:j + 1] = [range(r.start, r.start + best[1]), range(r.start + best[1], r.stop)]
    return ranges
