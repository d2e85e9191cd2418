"""Log-probs of the sampled ids in chunks (trainer/logprobs.py) equal the full-logits ones, in
value and in gradient, and never build the full logits when chunked."""

from __future__ import annotations

import pytest
import torch

from workbench.toy.models import load_hf_model
from workbench.trainer.logprobs import forward_logprobs, logprob_head


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_chunked_logprobs_equal_the_full_logits_ones(name, dense_path, moe_path):
    model = load_hf_model(dense_path if name == "dense" else moe_path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 37), generator=g)
    attn = torch.ones_like(ids)
    attn[2, 30:] = 0  # right padding, as in training batches
    weights = torch.randn(3, 37, generator=g)

    def run(chunk_mb):
        model.zero_grad(set_to_none=True)
        lp = forward_logprobs(model, ids, attn, temperature=0.7, chunk_mb=chunk_mb)
        (lp * weights).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    full, g_full = run(None)
    # 3 rows x 512 ids x 4 bytes = 6 KB a position: 0.05 MB is 8 positions per chunk (5 chunks),
    # 0.01 MB one position per chunk (36 chunks; the matmul then takes another BLAS path, so
    # values agree to fp32 rounding of |log p| up to ~19 nats, not bit for bit)
    chunked, g_chunked = run(0.05)
    assert full.shape == chunked.shape == (3, 37) and (full[:, 0] == 0).all()
    assert float((full - chunked).abs().max()) <= 1e-6
    tiny, _ = run(0.01)
    assert float(((full - tiny).abs() / full.abs().clamp(min=1)).max()) <= 1e-6
    assert g_full.keys() == g_chunked.keys() and "lm_head.weight" in g_full or "model.embed_tokens.weight" in g_full
    for k in g_full:
        assert torch.allclose(g_full[k], g_chunked[k], atol=1e-6, rtol=1e-5), k
    # the default budget is one chunk for the toy: the same values, no recompute
    assert float((full - forward_logprobs(model, ids, attn, temperature=0.7)).detach().abs().max()) <= 1e-6


def test_while_chunked_no_full_logits_are_built(dense_path):
    model = load_hf_model(dense_path)
    ids = torch.randint(3, 500, (2, 20))
    biggest = []
    head = model.get_output_embeddings()
    hook = head.register_forward_hook(lambda m, i, o: biggest.append(tuple(o.shape)))
    try:
        with torch.no_grad(), logprob_head(model, ids, 1.0, chunk_mb=0.01) as swapped:
            out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    finally:
        hook.remove()
    assert swapped and out.shape == (2, 20)
    assert not hasattr(head, "forward") or "forward" not in head.__dict__  # the head is restored
    assert biggest == [(2, 20)]  # the head's one call returned log-probs, not [2, 20, vocab] logits


def test_a_one_position_row_keeps_its_column():
    """sampled_logprobs gives [B, T] whatever T: a width-1 input came back [B, 0] (no picked
    column to copy the zero from), misaligning a micro-batch of one-token rows."""
    import torch

    from workbench.trainer.logprobs import sampled_logprobs

    assert sampled_logprobs(torch.randn(2, 1, 5), torch.zeros(2, 1, dtype=torch.long)).shape == (2, 1)
    assert sampled_logprobs(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3)


def test_a_model_that_soft_caps_attention_loads_with_eager_attention(tmp_path):
    """Gemma 2 soft-caps attention logits (tanh(x / cap) * cap): transformers' default SDPA path
    leaves the cap out and vLLM applies it, so the trainer's and the reference sampler's
    log-probs were another forward's (0.3 nat apart here). Both load it with eager attention."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    from workbench.trainer.loading import meta_model

    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, attn_logit_softcapping=5.0)
    torch.manual_seed(0)
    src = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for layer in src.model.layers:  # attention logits well past the cap
            layer.self_attn.q_proj.weight.mul_(30)
            layer.self_attn.k_proj.weight.mul_(30)
    src.save_pretrained(tmp_path)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(1))
    loaded = load_hf_model(tmp_path)
    eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    sdpa = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        got, capped, uncapped = (m(ids).logits.log_softmax(-1) for m in (loaded, eager, sdpa))
    assert torch.allclose(got, capped, atol=1e-5) and (got - uncapped).abs().max() > 1e-2
    assert meta_model(str(tmp_path), torch.float32).config._attn_implementation == "eager"
