"""Invariant 2, policy-version semantics: the only place correction weights are computed.

Every trainable token carries its behaviour log-prob (the engine's, processed) and the policy
version that sampled it. With r_t = pi_old(t) / pi_behav(t) (pi_old: the trainer's recomputed
log-prob under the weights the batch is trained from), the *unit* ratio at each level is

    token: u = r_t              seq: u = exp(sum_t log r_t)      geo: u = exp(mean_t log r_t)

and the weight every trainable token of a kept unit carries is

    mask:  keep the unit only when low <= u <= high (a sequence for seq/geo, a token for
           token); a kept unit weighs u (kept_weight="ratio", bounded by the band) or 1
           (kept_weight="one": pure rejection sampling)
    clip:  w = clamp(u, low, high)
    trunc: w = min(u, high)                                      (TIS)

Sequence-level masks never hand a kept sequence its per-token ratios: a sequence whose
geometric mean is exactly 1 can hold one token with r_t = 20, and weighting that token by 20
is the unbounded variance the sequence-level test was meant to remove. Two sequence gates
apply at every level, whatever the mode:

    staleness  a sequence whose oldest token is more than max_staleness versions behind the
               trainer is dropped, whatever its ratio.
    veto       a sequence holding any token with r_t < veto_low or r_t > veto_high is dropped
               (the per-token veto of sequence-level rejection sampling).

References: token TIS, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You
Off-Policy RL Training"; sequence-level and geometric-mean masks and the token veto, Liu et
al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference
Mismatch" (MIS), also verl's rollout-correction options.

Weights are constants in the loss (computed without gradient). `Correction.token_keep` is the
mask of tokens that take part in the loss at all; the KL penalty to a reference is weighted by
`Correction.weights` (0 outside token_keep) as the surrogate is, so a gated sequence gets no
gradient from anything. Statistics every step:
gate pass ratio, k1/k3 KL between behaviour and trainer log-probs, max |delta p|, IS-weight and
staleness histograms, tokens per version, the kept weights' effective sample size and the share
of kept tokens whose weight a clip or truncation bounded.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch

LEVELS = ("token", "seq", "geo")
MODES = ("mask", "clip", "trunc")
KEPT_WEIGHTS = ("ratio", "one")
WEIGHT_BINS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0, 1.01, 1.05, 1.1, 1.25, 2.0, float("inf"))


class CorrectionConfigError(ValueError):
    pass


@dataclass
class CorrectionConfig:
    level: str = "geo"
    mode: str = "mask"
    low: float = 0.99
    high: float = 1.01
    max_staleness: int | None = 4  # None: no staleness gate
    enabled: bool = True  # False: every kept token weighs 1 (the staleness gate and the veto still apply)
    kept_weight: str = "ratio"  # mask mode: a kept unit weighs its ratio u ("ratio") or 1 ("one")
    veto_low: float | None = None  # drop a sequence holding any token ratio below this (e.g. 1e-4)
    veto_high: float | None = None  # ... or above this

    @classmethod
    def tis(cls, cap: float = 2.0, max_staleness: int | None = 4) -> "CorrectionConfig":
        """Token-level truncated importance sampling: weight = min(r_t, cap)."""
        return cls(level="token", mode="trunc", low=0.0, high=cap, max_staleness=max_staleness)

    def __post_init__(self):
        if self.level not in LEVELS:
            raise CorrectionConfigError(f"correction level {self.level!r} unknown; choose one of {LEVELS}")
        if self.mode not in MODES:
            raise CorrectionConfigError(f"correction mode {self.mode!r} unknown; choose one of {MODES}")
        if not (self.high > 0 and self.low >= 0 and self.low <= self.high):
            raise CorrectionConfigError(f"correction band must satisfy 0 <= low <= high and high > 0, got [{self.low}, {self.high}]")
        if self.mode in ("mask", "clip") and not self.low <= 1.0 <= self.high:
            raise CorrectionConfigError(
                f"a {self.mode} band [{self.low}, {self.high}] that excludes 1.0 rejects even perfectly on-policy tokens")
        if self.mode == "trunc" and self.high < 1.0:
            raise CorrectionConfigError(f"a trunc cap of {self.high} (< 1) weighs even perfectly on-policy tokens down to it")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise CorrectionConfigError(f"max_staleness must be >= 0 or None, got {self.max_staleness}")
        if self.kept_weight not in KEPT_WEIGHTS:
            raise CorrectionConfigError(f"kept_weight {self.kept_weight!r} unknown; choose one of {KEPT_WEIGHTS}")
        lo, hi = self.veto_low, self.veto_high
        if (lo is not None and not 0 < lo <= 1) or (hi is not None and hi < 1):
            raise CorrectionConfigError(f"a token veto needs 0 < veto_low <= 1 <= veto_high, got veto_low={lo}, veto_high={hi}")

    def check_sampling(self, top_p: float = 1.0, top_k: int = -1, logprobs_mode: str = "processed_logprobs",
                       temperature: float | None = None, trainer_temperature: float | None = None) -> None:
        """Refuse sampling set-ups under which the behaviour log-probs cannot be compared with the
        trainer's log-probs, so every ratio would be biased. Called wherever a run starts
        (loop.run) with the rollout's policy sampling and the trainer's temperature."""
        if temperature is not None and trainer_temperature is not None:
            if temperature <= 0:
                raise CorrectionConfigError(
                    f"the policy samples at temperature {temperature}: greedy tokens have no sampling "
                    "distribution to train on; use a temperature > 0 for recorded turns")
            if temperature < 0.01 or temperature > 2:
                raise CorrectionConfigError(
                    f"the policy samples at temperature {temperature}: vLLM samples below 0.01 at 0.01 (the "
                    "recorded log-probs would not be at the trainer's temperature) and refuses above 2; use "
                    "a temperature in [0.01, 2]")
            if abs(temperature - trainer_temperature) > 1e-6:
                raise CorrectionConfigError(
                    f"the rollout samples at temperature {temperature} but the trainer computes log-probs at "
                    f"{trainer_temperature}: every ratio would be biased. Set one temperature for both "
                    "(WorkbenchConfig.temperature sets both)")
        # the veto reads the ratios whether correction is enabled or not: it needs them unbiased too (raw
        # log-probs at temperature 0.6 put 45% of on-policy tokens outside [0.5, 2]: every sequence vetoed)
        if not self.enabled and self.veto_low is None and self.veto_high is None:
            return
        what = "importance correction" if self.enabled else "the token veto (veto_low / veto_high)"
        if top_p < 1.0 or (top_k not in (-1, 0, None)):
            raise CorrectionConfigError(
                f"{what} with top_p={top_p}, top_k={top_k}: the engine reports log-probs "
                "renormalized over the kept tokens, which a full-vocabulary trainer log-prob cannot match "
                "(every ratio would be biased). Sample with top_p=1 and top_k=-1, or disable correction and the veto.")
        if logprobs_mode != "processed_logprobs":
            raise CorrectionConfigError(
                f"{what} needs the engine's processed log-probs (got {logprobs_mode!r}): "
                "raw log-probs ignore the temperature the tokens were sampled at")


def oldest_token_gate(staleness: torch.Tensor, loss_mask: torch.Tensor, max_staleness: int) -> torch.Tensor:
    """The staleness gate: keep a sequence ([B] bool) whose oldest trainable token is at most
    max_staleness versions behind. `staleness` [B, T]: versions behind per token, 0 where not trainable."""
    return staleness.masked_fill(~loss_mask, 0).max(-1).values <= max_staleness


_gate = [oldest_token_gate]


def register_staleness_gate(fn=None) -> None:
    """Make `fn(staleness, loss_mask, max_staleness) -> keep [B]` the staleness gate that
    correction_weights applies in this process (None: oldest_token_gate again). The extension
    point of workshop notebook 02's exercise; a trainer rank is another process and keeps its own."""
    _gate[0] = fn or oldest_token_gate


@dataclass
class Correction:
    weights: torch.Tensor  # [B, T] per-token weight, 0 where dropped or not trainable
    keep: torch.Tensor  # [B] bool: sequence passed the staleness gate, the veto and (seq/geo mask) the band
    token_keep: torch.Tensor | None = None  # [B, T] bool: trainable tokens of kept units (every loss term's mask)
    # the statistics' inputs, detached, where they were computed: read by `stats` on first use, so
    # a trainer on a GPU reads every micro-batch's statistics once, after its step's last kernel
    # is queued (each read on the host waits for the device to drain its queue)
    _inputs: tuple = ()
    _computed: dict | None = None

    @property
    def stats(self) -> dict:
        if self._computed is None:
            self._computed = _stats(*self._inputs)
            self._inputs = ()
        return self._computed


def correction_weights(trainer_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, loss_mask: torch.Tensor,
                       versions: torch.Tensor, trainer_version: int, cfg: CorrectionConfig) -> Correction:
    """All tensors [B, T], aligned per token (see tokens.training_tensors)."""
    with torch.no_grad():
        mask = loss_mask.float()
        m = mask.bool()
        # (where, not a product: a non-finite log-prob at a position that is not trained made inf * 0 =
        # NaN there, which dropped its row under a sequence mask and skipped the update under TIS)
        log_r = torch.where(m, trainer_logprobs.float() - behaviour_logprobs.float(), torch.zeros_like(mask))
        r = torch.exp(log_r)
        n_tok = mask.sum(-1).clamp(min=1)
        B = mask.shape[0]

        # staleness gate, per sequence (oldest_token_gate unless another is registered)
        stale = (trainer_version - versions).masked_fill(~m, 0)
        fresh = (torch.ones(B, dtype=torch.bool, device=m.device) if cfg.max_staleness is None
                 else _gate[0](stale, m, cfg.max_staleness).to(device=m.device, dtype=torch.bool))

        if cfg.level == "token":
            unit = r
        else:
            seq_log = log_r.sum(-1) if cfg.level == "seq" else log_r.sum(-1) / n_tok
            unit = torch.exp(seq_log)[:, None].expand_as(r)

        in_band = (unit >= cfg.low) & (unit <= cfg.high)
        if not cfg.enabled:
            w = torch.ones_like(r)
        elif cfg.mode == "mask":  # a kept unit weighs its own ratio (inside the band) or 1
            w = torch.where(in_band, unit if cfg.kept_weight == "ratio" else torch.ones_like(r), torch.zeros_like(r))
        elif cfg.mode == "clip":
            w = unit.clamp(cfg.low, cfg.high)
        else:
            w = unit.clamp(max=cfg.high)
        keep = fresh.clone()
        vetoed = torch.zeros_like(fresh)
        if cfg.veto_low is not None or cfg.veto_high is not None:  # a gate: it applies enabled or not
            bad = torch.zeros_like(m)
            # written so that a NaN ratio is bad (a NaN log-prob: `r < low` and `r > high` are both False,
            # and the vetoed sequence was kept, its NaN weight skipping the whole update)
            if cfg.veto_low is not None:
                bad |= ~(r >= cfg.veto_low)
            if cfg.veto_high is not None:
                bad |= ~(r <= cfg.veto_high)
            vetoed = (bad & m).any(-1)
            keep &= ~vetoed
        if cfg.enabled and cfg.mode == "mask" and cfg.level != "token":
            keep &= in_band.all(-1)  # the unit is the sequence: its ratio is the same on every token
        weights = torch.where(m & keep[:, None], w, torch.zeros_like(w))
        token_keep = m & keep[:, None]
        if cfg.enabled and cfg.mode == "mask" and cfg.level == "token":
            token_keep &= in_band

        # kept tokens whose weight the clip or truncation bounded (their unit ratio was outside it)
        bounded = token_keep & (w != unit) & ~unit.isnan() if cfg.enabled and cfg.mode in ("clip", "trunc") else torch.zeros_like(token_keep)
        inputs = tuple(t.detach() for t in (trainer_logprobs, behaviour_logprobs, m, token_keep, weights, keep, fresh, stale,
                                            versions, vetoed, bounded))
    return Correction(weights, keep, token_keep, inputs)


def kl_k3_sum(trainer_lp: torch.Tensor, behaviour_lp: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, int]:
    """Sum over trainable tokens of k3 = r - 1 - log r (r = pi_trainer / pi_behaviour), an
    unbiased, never negative estimate of KL(behaviour || trainer), and the token count (so parts
    of a batch can be merged)."""
    m = loss_mask.bool()
    lr = (trainer_lp.double() - behaviour_lp.double())[m]  # float64: near 0, fp32 rounding would go negative
    # r = inf (a token the engine gave -inf: a broken engine) is an infinite k3, not inf - inf = NaN,
    # which read as no warning (NaN > limit is False) on the very case the statistic is for
    k3 = torch.where(lr == float("inf"), lr, torch.expm1(lr) - lr)
    return float(k3.sum()), int(m.sum())


def effective_sample_size(weight_sum: float, weight_sq_sum: float, n: int) -> float | None:
    """(sum w)^2 / (n sum w^2), in (0, 1]: 1 when every kept token weighs the same, 1/n when one
    token carries all the weight (the importance weights' variance, as one number). None: no
    kept token, or every weight 0; NaN where a weight is (a broken engine's: not "nothing measured")."""
    if n and math.isnan(weight_sq_sum):
        return float("nan")
    return weight_sum ** 2 / (n * weight_sq_sum) if n and weight_sq_sum > 0 else None


def _weight_hist(w: torch.Tensor) -> dict:
    """Weights counted in WEIGHT_BINS. A NaN weight is in no bin (torch.histogram drops it): counted
    beside the bins, or the panel read clean on the very step a weight broke; an inf is in the last
    bin (clamped)."""
    hist = torch.histogram(w.clamp(max=1e6), bins=torch.tensor(WEIGHT_BINS[:-1] + (1e6,))).hist if w.numel() else torch.zeros(len(WEIGHT_BINS) - 1)
    return {"edges": list(WEIGHT_BINS), "counts": [int(c) for c in hist.tolist()], "nonfinite": int(torch.isnan(w).sum())}


def _stats(trainer_lp, behav_lp, m, token_keep, weights, keep, fresh, stale, versions, vetoed, bounded) -> dict:
    # on CPU: small tensors, and torch.histogram has no CUDA kernel
    trainer_lp, behav_lp, m, token_keep, weights, keep, fresh, stale, versions, vetoed, bounded = (
        t.cpu() for t in (trainer_lp, behav_lp, m, token_keep, weights, keep, fresh, stale, versions, vetoed, bounded))
    n = int(m.sum())
    current = m & (stale == 0)  # sampled by the weights the trainer holds now
    n_current = int(current.sum())
    older = m & (stale > 0)  # (a token newer than the trainer, after a restore to older weights, is neither)
    n_older = int(older.sum())
    rows = m.any(-1)  # sequences with trainable tokens (padding rows are neither kept nor dropped)
    # the tokens the correction kept (a token-level mask's rejections are not: token_keep_ratio). From
    # the decision, not weights > 0: a TIS weight min(r, cap) that underflowed to 0 is a kept token
    # (it counts in signal_tokens_trained; its weight, 0, takes its KL term too), and it read as a dropped one
    kept = token_keep
    w = weights[kept]
    return {
        "gate_pass_ratio": float(keep[rows].float().mean()) if rows.any() else 1.0,
        "sequences": int(rows.sum()),
        "stale_dropped": int((~fresh & rows).sum()),
        "band_dropped": int((fresh & ~keep & ~vetoed & rows).sum()),
        "veto_dropped": int((fresh & vetoed & rows).sum()),
        # share of trainable tokens the correction kept: a token-level mask drops tokens, not
        # sequences, so its rejections show here and not in gate_pass_ratio
        "token_keep_ratio": float(kept[m].float().mean()) if n else 1.0,
        # KL(behaviour || trainer) estimators on the behaviour samples, with r = pi_old / pi_behav
        # (from the log-probs in float64: log(exp(log r)) in float32 overflowed to +-inf past ~88 nats,
        # on the broken engine this statistic is read for)
        "kl_k1": float((behav_lp.double() - trainer_lp.double())[m].mean()) if n else 0.0,
        "kl_k3": kl_k3_sum(trainer_lp, behav_lp, m)[0] / n if n else 0.0,
        # the same on the tokens of the trainer's own version: staleness excluded, what is left is
        # the engine's forward against the trainer's (0 up to rounding when they agree; a K/V kept
        # from older weights, a missed sync, a lower-precision engine or unreplayed routing show here).
        # None without such tokens: a 0 would read as a healthy engine where nothing was measured
        "kl_k3_current": kl_k3_sum(trainer_lp, behav_lp, current)[0] / n_current if n_current else None,
        "tokens_current": n_current,
        # ... and on the stale tokens (sampled by older weights): how far the policy moved between
        # their version and the trainer's (loop.warn_policy_outran_correction reads it); None
        # without stale tokens
        "kl_k3_stale": kl_k3_sum(trainer_lp, behav_lp, older)[0] / n_older if n_older else None,
        "tokens_stale": n_older,
        "max_abs_delta_p": float((trainer_lp.float().exp() - behav_lp.float().exp())[m].abs().max()) if n else 0.0,
        "is_weight_hist": _weight_hist(w),
        # ... of the kept tokens of the trainer's own version: what the audit holds to its band (a stale
        # token's weight is its staleness corrected, judged by kl_k3_stale: counted in, a healthy async
        # run's learning steps were flagged, 19 of 35)
        "is_weight_hist_current": _weight_hist(weights[kept & current]),
        # the kept weights' spread (effective_sample_size) and how often the clip or cap bounded one:
        # a correction that keeps every token but weighs a few by its cap shows here, not in the gate
        "is_ess": effective_sample_size(float(w.double().sum()), float(w.double().square().sum()), int(w.numel())),
        "is_weight_sum": float(w.double().sum()), "is_weight_sq_sum": float(w.double().square().sum()),
        "tokens_kept": int(w.numel()),
        "is_bounded_fraction": float(bounded[kept].float().mean()) if kept.any() else None,
        "tokens_bounded": int(bounded.sum()),
        "staleness_hist": dict(sorted(Counter(stale[m].tolist()).items())),
        # the oldest token trained on (what the gate bounds; the histogram is before the gate, so a gate
        # that kept a stale sequence showed the same histogram as one that dropped it); None: none kept
        "max_staleness_kept": int(stale[kept].max()) if kept.any() else None,
        "tokens_per_version": dict(sorted(Counter(versions[m].tolist()).items())),
        "tokens": n,
    }


def merge_stats(parts: list[dict]) -> dict:
    """One statistics dict for a batch computed in parts (per micro-batch, per trainer rank):
    token-weighted means, sequence-weighted gate ratio, maxima, sums, summed histograms."""
    tokens = sum(p["tokens"] for p in parts)
    current = sum(p["tokens_current"] for p in parts)
    stale = sum(p["tokens_stale"] for p in parts)
    sequences = sum(p["sequences"] for p in parts)
    kept = sum(p["tokens_kept"] for p in parts)

    def wmean(k):
        return sum(p[k] * p["tokens"] for p in parts) / tokens if tokens else 0.0

    def add(k):
        out = Counter()
        for p in parts:
            out.update(p[k])
        return dict(sorted(out.items()))

    return {
        "gate_pass_ratio": sum(p["gate_pass_ratio"] * p["sequences"] for p in parts) / sequences if sequences else 1.0,
        "sequences": sequences,
        "stale_dropped": sum(p["stale_dropped"] for p in parts),
        "band_dropped": sum(p["band_dropped"] for p in parts),
        "veto_dropped": sum(p.get("veto_dropped", 0) for p in parts),
        "token_keep_ratio": wmean("token_keep_ratio"), "kl_k1": wmean("kl_k1"), "kl_k3": wmean("kl_k3"),
        "kl_k3_current": (sum(p["kl_k3_current"] * p["tokens_current"] for p in parts if p["tokens_current"]) / current
                          if current else None),
        "tokens_current": current,
        "kl_k3_stale": (sum(p["kl_k3_stale"] * p["tokens_stale"] for p in parts if p["tokens_stale"]) / stale
                        if stale else None),
        "tokens_stale": stale,
        # NaN wins (Python's max kept or dropped one by the parts' order: a NaN rank's hidden)
        "max_abs_delta_p": max((p["max_abs_delta_p"] for p in parts), key=lambda x: math.inf if math.isnan(x) else x),
        **{k: {"edges": parts[0][k]["edges"], "counts": [sum(c) for c in zip(*(p[k]["counts"] for p in parts))],
                   "nonfinite": sum(p[k].get("nonfinite", 0) for p in parts)}
           for k in ("is_weight_hist", "is_weight_hist_current")},
        "is_ess": effective_sample_size(sum(p["is_weight_sum"] for p in parts), sum(p["is_weight_sq_sum"] for p in parts), kept),
        "is_weight_sum": sum(p["is_weight_sum"] for p in parts), "is_weight_sq_sum": sum(p["is_weight_sq_sum"] for p in parts),
        "tokens_kept": kept, "is_bounded_fraction": sum(p["tokens_bounded"] for p in parts) / kept if kept else None,
        "tokens_bounded": sum(p["tokens_bounded"] for p in parts),
        "staleness_hist": add("staleness_hist"), "tokens_per_version": add("tokens_per_version"), "tokens": tokens,
        "max_staleness_kept": max((p["max_staleness_kept"] for p in parts if p.get("max_staleness_kept") is not None),
                                  default=None),
    }
