"""Sequence packing (trainer/packing.py): a packed micro-batch gives each row the log-probs,
gradients and replay statistics of its padded forward, and token-budget micro-batches agree
across FSDP ranks."""

from __future__ import annotations

import pytest
import torch

from workbench.replay import RouterCapture
from workbench.toy.models import load_hf_model
from workbench.trainer.fsdp import Trainer, TrainerConfig, replayed_logprobs
from workbench.trainer.packing import micro_batches_by_tokens, pack


def test_micro_batches_by_tokens():
    assert micro_batches_by_tokens([5, 5, 5, 5], 10) == [range(0, 2), range(2, 4)]
    assert micro_batches_by_tokens([20, 1, 1, 1], 10) == [range(0, 1), range(1, 4)]  # a long row alone
    # exactly `count` ranges (what every rank agreed on), balanced by tokens, none empty
    assert micro_batches_by_tokens([20, 1, 1, 1], 10, count=4) == [range(i, i + 1) for i in range(4)]
    assert micro_batches_by_tokens([3] * 6, 9, count=2) == [range(0, 3), range(3, 6)]
    assert micro_batches_by_tokens([1, 1, 1, 30], 9, count=3) == [range(0, 2), range(2, 3), range(3, 4)]
    with pytest.raises(ValueError, match="cannot cut 2 rows into 3"):
        micro_batches_by_tokens([1, 1], 9, count=3)


def _rows(vocab: int, lengths: list[int], left: bool = False):
    g = torch.Generator().manual_seed(0)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        cols = slice(width - n, width) if left else slice(0, n)
        ids[i, cols] = torch.randint(0, vocab, (n,), generator=g)
        mask[i, cols] = 1
    return ids, mask


@pytest.mark.parametrize("left", [False, True])
def test_packed_rows_equal_their_padded_forward(moe_path, left):
    """Rows of 5..23 tokens (right or left padded) with their recorded experts: packed, every
    attended position's log-prob and the gradient of a masked loss equal the padded forward's;
    routing replay counts the same positions; padding and each row's first column are 0."""
    model = load_hf_model(str(moe_path))
    ids, mask = _rows(model.config.vocab_size, [23, 5, 17, 11], left)
    cap = RouterCapture(model)  # the experts a sampler would have recorded
    cap.active = True
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    flat = cap.pop()  # [rows * width, layers, k]
    experts = flat.reshape(*ids.shape, *flat.shape[1:])
    cap.remove()
    first = mask.bool() & (mask.cumsum(1) == 1)  # a row's first token has no log-prob (never trained)
    scored = mask.bool() & ~first
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)) * scored

    def run(packed: bool):
        model.zero_grad()
        with replayed_logprobs(model, ids, mask, 0.9, experts, positions=mask, packed=packed) as (lp, stats):
            (lp * weights).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        return lp.detach(), stats, grads

    lp_pad, st_pad, g_pad = run(False)
    lp_pack, st_pack, g_pack = run(True)
    assert torch.max(torch.abs(lp_pack[scored] - lp_pad[scored])) <= 1e-5
    assert (lp_pack[~scored] == 0).all()
    assert (g_pack - g_pad).abs().max() <= 1e-5 * g_pad.abs().max()  # fp32 rounding (gradients reach ~150)
    assert st_pack == st_pad and sum(st_pack.replayed) == int(mask.sum()) * len(st_pack.replayed)
    p = pack(ids, mask)
    # first-fit decreasing into rows as wide as the longest: [23], [17, 5] + a 1-token tail, [11] + tail
    assert p.input_ids.shape == (3, 23) and p.position_ids[0].tolist() == list(range(23))
    assert p.position_ids[1].tolist() == list(range(17)) + list(range(5)) + [0]


def test_token_budget_micro_batches_agree_across_ranks(ray_local, moe_path):
    """Two gloo ranks whose rows need different numbers of token-budget micro-batches (rank 0
    holds one long row, rank 1 many short ones): the count is agreed (no collective hangs), the
    log-probs equal the padded trainer's, and a training step runs."""
    lengths = [40, 4, 4, 4, 4, 4, 4, 4]  # _split: rank 0 gets rows 0-3, rank 1 rows 4-7
    model = load_hf_model(str(moe_path))
    ids, mask = _rows(model.config.vocab_size, lengths)
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": mask.clone(), "versions": torch.zeros_like(ids),
             "behaviour_logprobs": torch.zeros(ids.shape), "advantages": torch.ones(ids.shape) * mask}
    batch["loss_mask"][:, 0] = 0
    t = Trainer(str(moe_path), world_size=2, cfg=TrainerConfig(micro_batch_tokens=12, micro_batch_size=1))
    try:
        lp = t.logprobs(batch)
        with torch.no_grad():
            with replayed_logprobs(model, ids, mask) as (padded, _):
                pass
        m = batch["loss_mask"].bool()
        assert torch.max(torch.abs(lp[m] - padded[m])) <= 1e-5
        out = t.train_step({**batch, "behaviour_logprobs": padded})
        assert out["version"] == 1 and torch.isfinite(torch.tensor(out["loss"]))
    finally:
        t.shutdown()
