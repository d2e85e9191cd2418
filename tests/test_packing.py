"""Sequence packing (trainer/packing.py): a packed micro-batch gives each row the log-probs,
gradients and replay statistics of its padded forward, and token-budget micro-batches agree
across FSDP ranks."""

from __future__ import annotations

import pytest
import ray
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
    with pytest.raises(ValueError, match="cannot cut 2 rows .* into 3"):
        micro_batches_by_tokens([1, 1], 9, count=3)
    # every range stays within the budget (a longer row alone) however many the ranks agreed on: the
    # batch re-cut into `count` balanced ranges went up to 1.6x the budget ([6, 13, 6] here)
    assert micro_batches_by_tokens([6, 6, 1, 6, 6], 12, count=3) == [range(0, 2), range(2, 4), range(4, 5)]
    import random

    rng = random.Random(0)
    for _ in range(2000):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 12))]
        budget = rng.randint(1, 80)
        own = len(micro_batches_by_tokens(lengths, budget))
        count = rng.randint(own, len(lengths))
        cut = micro_batches_by_tokens(lengths, budget, count)
        assert len(cut) == count and [k for r in cut for k in r] == list(range(len(lengths)))
        assert all(len(r) == 1 or sum(lengths[k] for k in r) <= budget for r in cut), (lengths, budget, count, cut)


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


def _tiny(model_type: str, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256, **extra)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


GPT_OSS = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 128,
           "layer_types": ["full_attention", "full_attention"]}


def test_the_packing_check_finds_the_models_whose_forward_mixes_packed_sequences():
    """Packing relies on the model building the block-diagonal mask from the position ids. gpt-oss
    passes none to its mask builder, and Qwen3-Next's linear attention carries its state across
    sequences: a packed sequence's log-probs changed with the sequence before it (0.01-0.15 nats:
    trained on another episode's context). packing_leak measures it; 0 exactly where packing is exact."""
    from workbench.trainer.packing import PACKING_LEAK_TOL, packing_leak, packing_mixes

    assert packing_leak(_tiny("qwen3"), 256, "cpu") == (0.0, 0.0)
    # an MoE moves a little with the other sequence's routing (its experts' matmul shapes), packed
    # before or after it: noise, measured with the probe packed first, where nothing can reach it
    moe = packing_leak(_tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), 256, "cpu")
    assert not packing_mixes(*moe), moe
    leak, noise = packing_leak(_tiny("gpt_oss", **GPT_OSS), 256, "cpu")
    assert leak > 100 * PACKING_LEAK_TOL and packing_mixes(leak, noise), (leak, noise)
    linear = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
              "linear_num_value_heads": 2, "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
              "layer_types": ["linear_attention", "full_attention"]}
    leak, noise = packing_leak(_tiny("qwen3_next", **linear), 256, "cpu")
    assert leak > 10 * PACKING_LEAK_TOL and packing_mixes(leak, noise), (leak, noise)
    assert packing_mixes(0.2, 1e-3) and not packing_mixes(1.5e-3, 1e-3) and not packing_mixes(5e-5, 0.0)
    assert packing_mixes(float("nan"), 0.0)  # nothing shows it keeps them apart


def test_a_trainer_pads_where_the_model_mixes_packed_sequences(ray_local, tmp_path):
    """A trainer on a gpt-oss checkpoint turns packing off at setup (every rank alike) and says so:
    its log-probs are each row's own forward's. Packed, the rows placed behind another in a packed
    row read up to 0.19 nats off."""
    model = _tiny("gpt_oss", **GPT_OSS)
    model.save_pretrained(tmp_path)
    ids, mask = _rows(256, [23, 5, 17, 11, 9, 3])
    scored = mask.bool() & (mask.cumsum(1) > 1)
    alone = torch.zeros(ids.shape)
    with torch.no_grad():
        for i, n in enumerate(mask.sum(1).tolist()):
            logits = model(input_ids=ids[i:i + 1, :n]).logits
            alone[i, 1:n] = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[i, 1:n, None])[:, 0]
    batch = {"input_ids": ids, "attention_mask": mask, "loss_mask": scored.long()}
    # a token budget, with padded rows, is that many tokens of the batch's width (2 rows of 23 here),
    # not micro_batch_size rows (it was dropped: 64 padded long rows a forward)
    t = Trainer(str(tmp_path), world_size=2, cfg=TrainerConfig(micro_batch_size=8, micro_batch_tokens=50))
    try:
        assert all(r["packing"]["packed"] is False and r["packing"]["leak"] > 1e-2 for r in t.footprint())
        lp = t.logprobs(batch)
        assert float((lp - alone)[scored].abs().max()) < 1e-4
        micro = ray.get(t.workers[0].__ray_call__.remote(lambda w, b: [len(r["input_ids"]) for r in w._micro(w._to(b))],
                                                         {k: v[:3] for k, v in batch.items()}))
        assert micro == [2, 1], micro
    finally:
        t.shutdown()
    # a KL reference of another architecture is checked too: a dense Qwen3 policy (which keeps packed
    # sequences apart) with this gpt-oss as its reference packed both, the reference's log-probs (the KL
    # term and its gradient) taken partly on another episode's context
    policy = tmp_path / "policy"
    _tiny("qwen3").save_pretrained(policy)
    t = Trainer(str(policy), world_size=1, cfg=TrainerConfig(kl_coef=0.1, ref_model_path=str(tmp_path)))
    try:
        [r] = t.footprint()
        assert r["packing"]["packed"] is False and r["packing"]["leak"] == 0.0 and r["packing"]["reference_leak"] > 1e-2, r["packing"]
    finally:
        t.shutdown()
