"""Per-token log-probs of the sampled ids without materialising [batch, length, vocab] logits.

A causal LM's forward ends in `logits = lm_head(hidden)`; in fp32 that is batch x length x
vocab x 4 bytes (8 rows x 4k tokens x Qwen3's 151,936 ids: 20 GB), and log_softmax keeps as
much again for backward. The trainer only needs log p(sampled id), so while `logprob_head` is
open the model's output head returns, instead of logits, the [B, T] log-probs of the given ids
(column 0 = 0, column i = log p(ids[i] | ids[:i]) at `temperature`), computed a chunk of
positions at a time. With gradients on, each chunk is checkpointed: only its hidden states are
kept, and backward recomputes its logits (one more head matmul per chunk; the price of
bounded memory). A chunk's logits are at most `chunk_mb` MB.

The swap is valid only where the model's forward returns the head's output unchanged (no
logit soft-capping or scaling after it): HEAD_LAST_MODEL_TYPES lists the families checked;
others take the plain path (full logits, then log_softmax), which is exact but not bounded.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint

# model_type values whose CausalLM forward returns lm_head(hidden) as the logits, untouched
HEAD_LAST_MODEL_TYPES = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "llama", "mistral", "mixtral", "deepseek_v3",
                         "gpt_oss"}


def sampled_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(input_ids[:, i] | < i) from a forward's full logits, [B, T], column 0 = 0."""
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = lp.gather(-1, input_ids[:, 1:, None])[..., 0]
    # (new_zeros, not zeros_like(picked[:, :1]): a width-1 input has no picked column, and the result was [B, 0])
    return torch.cat([picked.new_zeros((picked.shape[0], 1)), picked], dim=1)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head, temperature: float) -> torch.Tensor:
    # log_softmax then gather, exactly as sampled_logprobs: one chunk gives bit-equal values
    return torch.log_softmax(head(hidden).float() / temperature, dim=-1).gather(-1, targets[..., None])[..., 0]


def chunked_sampled_logprobs(hidden: torch.Tensor, head, input_ids: torch.Tensor, temperature: float,
                             chunk_mb: float, vocab_size: int) -> torch.Tensor:
    """What sampled_logprobs(head(hidden), input_ids) gives, a chunk of positions at a time."""
    h, targets = hidden[:, :-1], input_ids[:, 1:]
    per_position = max(1, h.shape[0]) * vocab_size * 4  # bytes of one position's fp32 logits over the batch
    step = max(1, int(chunk_mb * 2**20 // per_position))
    many = h.shape[1] > step
    parts = []
    for s in range(0, h.shape[1], step):
        args = (h[:, s:s + step], targets[:, s:s + step], head, temperature)
        if many and torch.is_grad_enabled():
            parts.append(checkpoint(_chunk_logprobs, *args, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(*args))
    picked = torch.cat(parts, dim=1) if parts else targets.new_zeros((targets.shape[0], 0), dtype=torch.float32)
    return torch.cat([picked.new_zeros((picked.shape[0], 1)), picked], dim=1)


@contextlib.contextmanager
def logprob_head(model, input_ids: torch.Tensor, temperature: float, chunk_mb: float | None):
    """While open, `model(input_ids=...).logits` is the [B, T] log-probs of `input_ids` (see the
    module docstring). Yields False (and changes nothing) where the swap is not valid or
    `chunk_mb` is None: the caller then takes sampled_logprobs of the full logits."""
    head = model.get_output_embeddings()
    if chunk_mb is None or head is None or getattr(model.config, "model_type", None) not in HEAD_LAST_MODEL_TYPES:
        yield False
        return
    plain = type(head).forward.__get__(head)  # the head's own forward (checkpoint recomputes with it)
    vocab = model.config.vocab_size
    head.forward = lambda hidden: chunked_sampled_logprobs(hidden, plain, input_ids, temperature, chunk_mb, vocab)
    try:
        yield True
    finally:
        del head.forward  # the class's forward again


def forward_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                     chunk_mb: float | None = 256.0) -> torch.Tensor:
    """One forward of `model`, returning the [B, T] log-probs of `input_ids` (column 0 = 0)."""
    with logprob_head(model, input_ids, temperature, chunk_mb) as swapped:
        out = model(input_ids=input_ids, attention_mask=attention_mask).logits
    return out if swapped else sampled_logprobs(out, input_ids, temperature)
