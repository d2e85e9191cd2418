"""Advantage estimators and policy-loss surrogates: small registered functions.

Advantages take an `AdvantageInput` and return per-token advantages [N, T] (sequence-level
estimators broadcast their scalar over the sequence's tokens). The unit of credit is the
*episode*: loop.batch_from_groups calls a sequence-level estimator with one row per episode
(its reward, its group) and hands each of the episode's segments the episode's advantage, so
an episode that sealed into five segments weighs once in its group's mean and std, not five
times. Estimators registered with `per_token=True` (distillation) take the teacher's per-token
log-probs; LoopConfig refuses them without a teacher. The trainer applies them again on its own
pi_old (TrainerWorker.train_step), with rewards and groups None: a per-token estimator reads
loss_mask, logprobs and teacher_logprobs only. Surrogates take per-token
log-probs under the current weights (with gradient), the old log-probs (the weights the batch
is trained from, no gradient), advantages, and the correction weights from
workbench.correction (0 where a token or sequence is dropped), and return per-token losses.
`aggregate` turns them into one scalar. `KL_ESTIMATORS` give the optional per-token KL penalty
to a frozen reference model (TrainerConfig.kl_coef).

Register more with `@register_advantage(name)` / `@register_surrogate(name)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

ADVANTAGES: dict[str, Callable] = {}
PER_TOKEN_ADVANTAGES: set[str] = set()  # estimators that need per-token inputs (teacher log-probs)
GROUP_ADVANTAGES: set[str] = set()  # estimators whose baseline is the episode's group: a group of one gives 0
SURROGATES: dict[str, Callable] = {}
# surrogates whose objective weighs each sequence once (GSPO): their default aggregation is
# seq_mean_token_mean (TrainerConfig.loss_aggregation); under token_mean a sequence weighs its length
SEQUENCE_SURROGATES: set[str] = set()
# Per-token estimators of KL(pi || pi_ref) on tokens sampled from pi, as functions of
# d = log pi - log pi_ref (differentiable in log pi): k1 = d; k2 = d^2 / 2; k3 = e^-d - 1 + d
# (unbiased and never negative). Used for the optional KL-to-reference penalty, whose loss is the
# estimate on the sampled tokens, the samples held fixed. Its expected gradient is not always the
# estimated KL's (Tang & Munos 2025; tests/test_losses.py computes it exactly): k2's is
# grad KL(pi || pi_ref); k3's (GRPO's penalty) is grad KL(pi_ref || pi), the forward KL, which
# also pulls the policy to the reference; k1's is 0 (E_pi[grad log pi] = 0), so TrainerConfig
# refuses k1 as a penalty. "Sampled from pi": the trainer weights each token's penalty by
# pi / mu, mu the policy that sampled it (trainer/fsdp.py, as the surrogate's importance weight).
KL_ESTIMATORS: dict[str, Callable] = {
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: torch.exp(-d) - 1 + d,
}


def kl_to_reference(estimator: str, lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The per-token KL(pi || pi_ref) estimate where `mask` is set, 0 elsewhere. d = lp - ref is
    zeroed where nothing trains (prompt, tool output, padding) before the estimator: there the
    policy may sit ~90 nats under the reference, k3's e^-d is inf, and inf * 0 (a mask) is NaN,
    in the loss and in every gradient."""
    m = mask.bool()
    return KL_ESTIMATORS[estimator](torch.where(m, lp - ref, 0.0)) * m


def kl_penalty(estimator: str, lp: torch.Tensor, ref: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The per-token KL penalty the loss adds (before kl_coef): the estimate times `weight` (the
    correction's pi / mu, 0 where it dropped a token or its sequence), taken only where the weight
    is above 0. A row the staleness gate dropped was sampled versions ago and may sit ~90 nats
    under the reference, where k3's e^-d is inf: inf * 0 was NaN in the loss and in every row's
    gradient, and the whole update was skipped for one gated row (and a NaN weight adds nothing
    here either: the surrogate carries it)."""
    return kl_to_reference(estimator, lp, ref, mask.bool() & (weight > 0)) * weight


def register_advantage(name: str, per_token: bool = False, group: bool = False):
    """`group`: its baseline is the episode's group (LoopConfig refuses group_size 1 for it)."""
    def deco(fn):
        ADVANTAGES[name] = fn
        if per_token:
            PER_TOKEN_ADVANTAGES.add(name)
        if group:
            GROUP_ADVANTAGES.add(name)
        return fn

    return deco


def register_surrogate(name: str, sequence_level: bool = False):
    """`sequence_level`: the objective weighs each sequence once (see SEQUENCE_SURROGATES)."""
    def deco(fn):
        SURROGATES[name] = fn
        if sequence_level:
            SEQUENCE_SURROGATES.add(name)
        return fn

    return deco


@dataclass
class AdvantageInput:
    rewards: torch.Tensor  # [N] one per row: an episode (loop.batch_from_groups) or a sequence
    groups: torch.Tensor  # [N] int group index (episodes of one prompt share it)
    loss_mask: torch.Tensor  # [N, T]
    logprobs: torch.Tensor | None = None  # [N, T] the student's log-probs (the trainer's pi_old: TrainerWorker.train_step)
    teacher_logprobs: torch.Tensor | None = None  # [N, T] a teacher's log-probs of the same tokens
    # [N] the trainable tokens each row's advantage lands on (loop.batch_from_groups: the episode's,
    # 0 for one masked or without a trainable token); None: loss_mask's per row
    tokens: torch.Tensor | None = None


EQUAL_REWARDS_TOL = 1e-9  # rewards of a group this close are one value (here and in loop.zero_variance)


def _group_stats(x: torch.Tensor, groups: torch.Tensor):
    """Per-element mean, std (unbiased where a group has > 1 member) and size of its group, in
    float64. A group whose rewards are all equal (within EQUAL_REWARDS_TOL) has its rewards as
    mean and std 0 exactly: in float32 eight rewards of 0.7 had a mean off by ~1e-8 and a std
    of ~1e-8, and grpo's (r - mean) / (std + eps) gave the whole group the same advantage
    (+0.056), its sign set by rounding: the policy's own samples pushed up or down together."""
    x = x.double()
    _, idx, counts = torch.unique(groups, return_inverse=True, return_counts=True)
    sums = torch.zeros(len(counts), dtype=x.dtype).index_add_(0, idx, x)
    mean = (sums / counts)[idx]
    sq = torch.zeros(len(counts), dtype=x.dtype).index_add_(0, idx, (x - mean) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))[idx]
    hi = torch.full((len(counts),), -torch.inf, dtype=x.dtype).scatter_reduce(0, idx, x, "amax")
    lo = torch.full((len(counts),), torch.inf, dtype=x.dtype).scatter_reduce(0, idx, x, "amin")
    flat = (hi - lo)[idx] <= EQUAL_REWARDS_TOL
    return torch.where(flat, x, mean), torch.where(flat, torch.zeros_like(std), std), counts[idx]


def _per_token(a: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return a.float()[:, None] * mask.float()


@register_advantage("grpo", group=True)
def grpo(x: AdvantageInput, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps)."""
    mean, std, _ = _group_stats(x.rewards, x.groups)
    return _per_token((x.rewards.double() - mean) / (std + eps), x.loss_mask)


@register_advantage("dr_grpo", group=True)
def dr_grpo(x: AdvantageInput) -> torch.Tensor:
    """r - group mean, no std scaling (pair with aggregate="constant")."""
    mean, _, _ = _group_stats(x.rewards, x.groups)
    return _per_token(x.rewards.double() - mean, x.loss_mask)


@register_advantage("rloo", group=True)
def rloo(x: AdvantageInput) -> torch.Tensor:
    """r_i minus the mean of the *other* rewards of its group (leave-one-out)."""
    mean, std, n = _group_stats(x.rewards, x.groups)
    r = x.rewards.double()
    loo = torch.where(n > 1, (mean * n - r) / (n - 1).clamp(min=1), torch.zeros_like(mean))
    return _per_token(torch.where((n > 1) & (std > 0), r - loo, torch.zeros_like(mean)), x.loss_mask)


@register_advantage("reinforce_pp_baseline", group=True)
def reinforce_pp_baseline(x: AdvantageInput, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++ with baseline (Hu et al. 2025): subtract the group mean, then scale over the
    batch's trainable tokens, each episode's centred reward counted once per token it trains (the
    paper's, OpenRLHF's and verl's masked whitening). Over episodes instead, a batch whose wrong
    answers ran long got advantages 1.2x too small, and episodes that train nothing (masked as
    truncated: their reward still in their group's mean) inflated every advantage.
    The paper also shifts by the token mean; that is a constant baseline (unbiased), left out so
    that a group of equal rewards keeps advantage 0 exactly, as every other estimator here gives it
    (loop.zero_variance, dynamic sampling and the no-signal warning read such a group as teaching
    nothing; with the shift it pushed every one of its tokens one way, set by the other groups).
    Without the shift the scale is the root mean square about 0 (the std about the token mean, with
    one trained episode among masked ones, was 0: its advantage 1/eps, ~750,000)."""
    mean, _, _ = _group_stats(x.rewards, x.groups)
    a = x.rewards.double() - mean
    w = (x.tokens if x.tokens is not None else x.loss_mask.sum(-1)).double()
    if w.sum() <= 0:
        return _per_token(torch.zeros_like(a), x.loss_mask)
    rms = torch.sqrt((w * a ** 2).sum() / w.sum())
    return _per_token(a / (rms + eps), x.loss_mask)


@register_advantage("distill", per_token=True)
def on_policy_distillation(x: AdvantageInput) -> torch.Tensor:
    """On-policy distillation: per-token advantage log p_teacher - log p_student (the negative
    per-token reverse KL on the student's own samples)."""
    if x.teacher_logprobs is None or x.logprobs is None:
        raise ValueError("on-policy distillation needs teacher_logprobs and the student's logprobs")
    return (x.teacher_logprobs - x.logprobs) * x.loss_mask.float()


@register_surrogate("ppo_clip")
def ppo_clip(logprobs, old_logprobs, advantages, weights, mask, eps_low: float = 0.2, eps_high: float = 0.2):
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped) * weights * mask


@register_surrogate("cispo")
def cispo(logprobs, old_logprobs, advantages, weights, mask, eps_high: float = 0.2):
    """CISPO: REINFORCE on log-probs, scaled by the clipped, stop-gradient ratio: no token's
    gradient is ever zeroed by clipping, its weight is only capped."""
    ratio = torch.exp(logprobs - old_logprobs).detach().clamp(max=1 + eps_high)
    return -ratio * advantages * logprobs * weights * mask


@register_surrogate("gspo", sequence_level=True)
def gspo(logprobs, old_logprobs, advantages, weights, mask, eps_low: float = 3e-4, eps_high: float = 4e-4):
    """GSPO: PPO-style clipping on the sequence's geometric-mean ratio; each token carries the
    sequence ratio in value and its own log-prob's gradient. Its objective averages over
    sequences (each one's token mean), so its aggregation is seq_mean_token_mean unless set."""
    m = mask.float()
    seq_log = ((logprobs - old_logprobs) * m).sum(-1) / m.sum(-1).clamp(min=1)
    ratio = torch.exp(seq_log.detach()[:, None] + logprobs - logprobs.detach())
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high) * advantages
    return -torch.minimum(unclipped, clipped) * weights * m


def episode_units(mask: torch.Tensor, episode_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """How much of an episode each row is: its trainable tokens / its episode's trainable tokens
    (rows of one episode sum to 1; padding rows are 0). Without `episode_tokens` every row is
    its own episode."""
    m = mask.float()
    own = m.sum(-1)
    et = own if episode_tokens is None else episode_tokens.to(m.dtype)
    return torch.where(own > 0, own / et.clamp(min=1), torch.zeros_like(own))


def aggregation_weights(mask: torch.Tensor, how: str = "token_mean", total_tokens: float | None = None,
                        total_episodes: float | None = None, max_len: int | None = None,
                        episode_tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Each token loss's weight in the aggregated loss ([B, T]): sum(token_losses * weights) is
    the loss. A "sequence" is an episode (all its segments, `episode_tokens` [B]: the trainable
    tokens of each row's episode; None: each row is one).

        token_mean           sum / trainable tokens
        seq_mean_token_mean  mean over episodes of (sum over the episode's tokens / its tokens)
        constant             sum / (episodes x max_len)   Dr.GRPO; max_len is a fixed, configured
                             length (the padded width changes with every batch)

    `total_tokens` / `total_episodes`: the whole batch's counts when `mask` is only a part of it
    (a micro-batch, a rank's rows; see episode_units)."""
    m = mask.float()
    tokens = float(m.sum()) if total_tokens is None else float(total_tokens)
    episodes = float(episode_units(m, episode_tokens).sum()) if total_episodes is None else float(total_episodes)
    if how == "token_mean":
        return m / max(tokens, 1.0)
    if how == "seq_mean_token_mean":
        et = m.sum(-1) if episode_tokens is None else episode_tokens.to(m.dtype)
        return m / et[:, None].clamp(min=1) / max(episodes, 1e-9)
    if how == "constant":
        if not max_len:
            raise ValueError("the 'constant' aggregation divides by a fixed length: set max_len "
                             "(TrainerConfig.constant_len), not the batch's padded width")
        return m / (max(episodes, 1e-9) * max_len)
    raise ValueError(f"unknown aggregation {how!r}: token_mean, seq_mean_token_mean or constant")


def aggregate(token_losses: torch.Tensor, mask: torch.Tensor, how: str = "token_mean", max_len: int | None = None,
              episode_tokens: torch.Tensor | None = None):
    """The aggregated loss of a whole batch (see aggregation_weights)."""
    return (token_losses * aggregation_weights(mask, how, max_len=max_len, episode_tokens=episode_tokens)).sum()


def get_advantage(name: str) -> Callable:
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {sorted(ADVANTAGES)}")
    return ADVANTAGES[name]


def get_surrogate(name: str) -> Callable:
    if name not in SURROGATES:
        raise ValueError(f"unknown surrogate {name!r}; registered: {sorted(SURROGATES)}")
    return SURROGATES[name]
