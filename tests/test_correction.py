"""Correction math against hand-computed cases, the staleness gate, and refused set-ups."""

import math

import pytest
import torch

from workbench.correction import CorrectionConfig, CorrectionConfigError, correction_weights, register_staleness_gate

LN = math.log


def batch():
    # two sequences, three positions; position 0 of each is a prompt token (mask 0)
    behav = torch.tensor([[0.0, LN(0.5), LN(0.5)], [0.0, LN(0.5), LN(0.4)]])
    old = torch.tensor([[0.0, LN(0.5), LN(0.6)], [0.0, LN(0.25), LN(0.4)]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1]])
    versions = torch.tensor([[-1, 5, 6], [-1, 1, 6]])
    return old, behav, mask, versions


def run(cfg, trainer_version=6):
    old, behav, mask, versions = batch()
    return correction_weights(old, behav, mask, versions, trainer_version, cfg)


def test_token_levels_and_modes():
    # token ratios: seq0 = [1.0, 1.2], seq1 = [0.5, 1.0]
    c = run(CorrectionConfig(level="token", mode="trunc", low=0.0, high=1.1, max_staleness=None))
    assert torch.allclose(c.weights, torch.tensor([[0, 1.0, 1.1], [0, 0.5, 1.0]]))
    # the kept weights' effective sample size, (sum w)^2 / (n sum w^2), and the share the cap bounded (1.2 -> 1.1)
    assert c.stats["is_ess"] == pytest.approx(3.6 ** 2 / (4 * (1 + 1.21 + 0.25 + 1)), abs=1e-6)
    assert c.stats["is_bounded_fraction"] == 0.25 and c.stats["tokens_bounded"] == 1
    c = run(CorrectionConfig(level="token", mode="clip", low=0.8, high=1.1, max_staleness=None))
    assert torch.allclose(c.weights, torch.tensor([[0, 1.0, 1.1], [0, 0.8, 1.0]]))
    assert c.stats["is_bounded_fraction"] == 0.5  # 1.2 -> 1.1 and 0.5 -> 0.8
    c = run(CorrectionConfig(level="token", mode="mask", low=0.8, high=1.1, max_staleness=None))
    assert torch.allclose(c.weights, torch.tensor([[0, 1.0, 0.0], [0, 0.0, 1.0]]))
    assert c.stats["is_bounded_fraction"] == 0.0 and c.stats["is_ess"] == 1.0  # a mask drops, never bounds
    assert c.stats["token_keep_ratio"] == 0.5 and c.stats["gate_pass_ratio"] == 1.0
    assert sum(c.stats["is_weight_hist"]["counts"]) == 2  # the kept tokens' weights, not the masked ones' zeros


def test_seq_and_geo_levels():
    # seq ratios: 1.2 and 0.5; geo ratios: sqrt(1.2) and sqrt(0.5)
    c = run(CorrectionConfig(level="seq", mode="trunc", low=0.0, high=1.1, max_staleness=None))
    assert torch.allclose(c.weights, torch.tensor([[0, 1.1, 1.1], [0, 0.5, 0.5]]))
    c = run(CorrectionConfig(level="geo", mode="clip", low=0.9, high=1.05, max_staleness=None))
    assert torch.allclose(c.weights, torch.tensor([[0, 1.05, 1.05], [0, 0.9, 0.9]]))
    # geo mask [0.7, 1.1]: seq0 (1.095) and seq1 (0.707) kept, each with its SEQUENCE weight
    # (never its tokens' own ratios 1.2 / 0.5, which the band did not bound)
    c = run(CorrectionConfig(level="geo", mode="mask", low=0.7, high=1.1, max_staleness=None))
    g0, g1 = math.sqrt(1.2), math.sqrt(0.5)
    assert torch.allclose(c.weights, torch.tensor([[0, g0, g0], [0, g1, g1]]))
    c = run(CorrectionConfig(level="geo", mode="mask", low=0.7, high=1.1, max_staleness=None, kept_weight="one"))
    assert torch.equal(c.weights, torch.tensor([[0, 1.0, 1.0], [0, 1.0, 1.0]]))
    # a tighter band drops the whole of seq1 and counts it
    c = run(CorrectionConfig(level="geo", mode="mask", low=0.9, high=1.1, max_staleness=None))
    assert c.keep.tolist() == [True, False] and c.weights[1].abs().sum() == 0
    assert c.stats["gate_pass_ratio"] == 0.5 and c.stats["band_dropped"] == 1


def test_staleness_gate_drops_sequences_with_an_old_token():
    # seq1's oldest token is version 1: 5 behind trainer version 6
    c = run(CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=4))
    assert c.keep.tolist() == [True, False] and c.weights[1].abs().sum() == 0
    assert c.stats["stale_dropped"] == 1 and c.stats["staleness_hist"] == {0: 2, 1: 1, 5: 1}
    assert c.stats["tokens_per_version"] == {1: 1, 5: 1, 6: 2}
    assert run(CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=5)).keep.all()


def test_a_registered_staleness_gate_is_the_one_correction_weights_applies():
    # the workshop's broken gate: a sequence as fresh as its freshest token keeps seq1 (5 behind)
    cfg = CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=4)
    register_staleness_gate(lambda staleness, mask, k: staleness.masked_fill(~mask, 99).min(-1).values <= k)
    try:
        c = run(cfg)
        assert c.keep.tolist() == [True, True] and c.stats["stale_dropped"] == 0 and c.weights[1].abs().sum() > 0
    finally:
        register_staleness_gate(None)
    good = run(cfg)
    assert good.keep.tolist() == [True, False]
    # the statistic that tells them apart (the audit's staleness): the oldest token trained on. The
    # histogram is before the gate: the same for both
    assert (c.stats["max_staleness_kept"], good.stats["max_staleness_kept"]) == (5, 1)
    assert c.stats["staleness_hist"] == good.stats["staleness_hist"]


def test_kl_estimators_and_delta_p():
    c = run(CorrectionConfig(level="geo", mode="mask", low=0.9, high=1.1, max_staleness=None))
    log_r = torch.tensor([0.0, LN(1.2), LN(0.5), 0.0])
    assert c.stats["kl_k1"] == pytest.approx(float((-log_r).mean()), abs=1e-6)
    assert c.stats["kl_k3"] == pytest.approx(float((log_r.exp() - 1 - log_r).mean()), abs=1e-6)
    assert c.stats["max_abs_delta_p"] == pytest.approx(0.25, abs=1e-6)
    assert sum(c.stats["is_weight_hist"]["counts"]) == 2  # seq1 dropped by the band: its tokens not counted


def test_statistics_of_a_broken_engine_stay_finite_and_count_what_the_gate_kept():
    """An engine far off the trainer (a broken sync): k1 came from log(exp(log r)) in float32,
    inf past ~88 nats where the exact mean is 60; and a TIS weight min(r, 2) that underflowed to 0
    counted as a dropped token in token_keep_ratio and the IS-weight histogram, while the gate
    kept it (its KL term applies, it counts in signal_tokens_trained)."""
    behav = torch.tensor([[0.0, -120.0, -1.0, -1.0]])
    trainer = torch.tensor([[0.0, -0.01, -1.0, -1.0]])
    for a, b, k1 in ((trainer, behav, 119.99 / 3), (behav, trainer, -119.99 / 3)):
        c = correction_weights(a, b, torch.tensor([[0, 1, 1, 1]]), torch.zeros(1, 4, dtype=torch.long), 0,
                               CorrectionConfig.tis())
        assert c.stats["kl_k1"] == pytest.approx(-k1, rel=1e-6), c.stats["kl_k1"]
        assert bool(c.token_keep[0, 1:].all()) and c.stats["token_keep_ratio"] == 1.0
        assert sum(c.stats["is_weight_hist"]["counts"]) == 3
    # a NaN log-prob (a broken engine's) makes the weights' ESS NaN, not None ("nothing measured"),
    # and is no bounded weight (NaN != NaN read as one)
    nan = torch.tensor([[0.0, float("nan"), -1.0, -1.0]])
    c = correction_weights(nan, trainer, torch.tensor([[0, 1, 1, 1]]), torch.zeros(1, 4, dtype=torch.long), 0,
                           CorrectionConfig(level="token", mode="clip", low=0.5, high=2.0, max_staleness=None))
    assert math.isnan(c.stats["is_ess"]) and c.stats["tokens_bounded"] == 0
    from workbench.correction import merge_stats
    merged = merge_stats([c.stats, correction_weights(trainer, trainer, torch.tensor([[0, 1, 1, 1]]), torch.zeros(
        1, 4, dtype=torch.long), 0, CorrectionConfig.tis()).stats])
    assert math.isnan(merged["is_ess"])
    # the NaN weight is in no bin of the histogram (the panel read clean): counted beside it, and outside
    # the audit's band
    from workbench.widgets.audit import _hist_outside

    assert (sum(c.stats["is_weight_hist"]["counts"]), c.stats["is_weight_hist"]["nonfinite"]) == (2, 1)
    assert merged["is_weight_hist"]["nonfinite"] == 1 and _hist_outside(c.stats["is_weight_hist"]) >= 1 / 3


def test_non_finite_log_probs_off_the_trained_tokens_and_an_impossible_token():
    """Masking by multiplying made inf * 0 = NaN at a position that is not trained: its row was
    dropped under the geo mask (its only trained token has ratio 1) and its weight NaN under TIS
    (the update skipped). A token the engine gave -inf has an infinite k3 (inf - inf was NaN, and
    a NaN kl_k3_stale never warned: NaN > 1 is False)."""
    from workbench.loop import warn_policy_outran_correction

    behav, trainer = torch.tensor([[0.0, -math.inf, -1.0]]), torch.tensor([[0.0, -2.0, -1.0]])
    mask, versions = torch.tensor([[0, 0, 1]]), torch.zeros(1, 3, dtype=torch.long)
    for cfg in (CorrectionConfig(level="geo", mode="mask"), CorrectionConfig.tis(), CorrectionConfig(level="token", mode="clip")):
        c = correction_weights(trainer, behav, mask, versions, 0, cfg)
        assert c.weights.tolist() == [[0.0, 0.0, 1.0]] and bool(c.keep[0]), (cfg, c.weights)
    c = correction_weights(trainer, behav, torch.tensor([[0, 1, 1]]), torch.tensor([[0, 0, 1]]), 1, CorrectionConfig.tis())
    assert c.stats["kl_k3"] == math.inf and c.stats["kl_k3_stale"] == math.inf
    assert warn_policy_outran_correction([{"step": 3, "kl_k3_stale": math.nan}])


def test_on_policy_batch_is_untouched():
    old, _, mask, versions = batch()
    c = correction_weights(old, old.clone(), mask, versions, 6, CorrectionConfig(max_staleness=None))
    assert torch.equal(c.weights, mask.float()) and c.stats["kl_k1"] == 0 and c.stats["kl_k3"] == 0


@pytest.mark.parametrize("kwargs,match", [
    ({"level": "tok"}, "level 'tok' unknown"),
    ({"mode": "cut"}, "mode 'cut' unknown"),
    ({"low": 1.2, "high": 1.1}, "low <= high"),
    ({"low": 1.01, "high": 1.05}, "excludes 1.0"),
    ({"max_staleness": -1}, "max_staleness"),
    ({"mode": "trunc", "low": 0.0, "high": 0.8}, "trunc cap of 0.8 \\(< 1\\)"),
])
def test_meaningless_configs_are_refused(kwargs, match):
    with pytest.raises(CorrectionConfigError, match=match):
        CorrectionConfig(**kwargs)


def test_correction_refuses_renormalized_behaviour_logprobs():
    cfg = CorrectionConfig()
    with pytest.raises(CorrectionConfigError, match="top_p=0.9"):
        cfg.check_sampling(top_p=0.9)
    with pytest.raises(CorrectionConfigError, match="processed log-probs"):
        cfg.check_sampling(logprobs_mode="raw_logprobs")
    cfg.check_sampling(top_p=1.0)
    CorrectionConfig(enabled=False).check_sampling(top_p=0.9)  # no correction, nothing to refuse
    # ... unless a veto reads the ratios: it applies with correction off, and raw log-probs at temperature
    # 0.6 put 45% of on-policy tokens outside [0.5, 2] (every sequence vetoed)
    veto = CorrectionConfig(enabled=False, veto_low=0.5, veto_high=2.0)
    with pytest.raises(CorrectionConfigError, match="the token veto"):
        veto.check_sampling(top_p=0.5)
    with pytest.raises(CorrectionConfigError, match="the token veto"):
        veto.check_sampling(logprobs_mode="raw_logprobs")
    veto.check_sampling()
    assert CorrectionConfig.tis().mode == "trunc" and CorrectionConfig.tis().high == 2.0


def test_stats_of_a_split_batch_merge_to_the_whole():
    from workbench.correction import merge_stats

    old, behav, mask, versions = batch()
    cfg = CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=None)
    whole = correction_weights(old, behav, mask, versions, 6, cfg).stats
    parts = [correction_weights(old[i:i + 1], behav[i:i + 1], mask[i:i + 1], versions[i:i + 1], 6, cfg).stats for i in range(2)]
    merged = merge_stats(parts)
    for k in ("kl_k1", "kl_k3", "kl_k3_current", "max_abs_delta_p", "gate_pass_ratio", "token_keep_ratio"):
        assert merged[k] == pytest.approx(whole[k], abs=1e-6), k
    # k3 on the trainer's own version's tokens only (version 6: r = 1.2 and 1.0): staleness excluded
    assert merged["tokens_current"] == whole["tokens_current"] == 2
    assert whole["kl_k3_current"] == pytest.approx((1.2 - 1 - math.log(1.2)) / 2, abs=1e-6)
    assert merged["is_weight_hist"] == whole["is_weight_hist"] and merged["tokens_per_version"] == whole["tokens_per_version"]
    # the IS weights of the trainer's own version's tokens apart (the audit's band holds those: a stale
    # token's weight is its staleness corrected, and counted in, healthy async steps were flagged)
    assert merged["is_weight_hist_current"] == whole["is_weight_hist_current"] and sum(whole["is_weight_hist_current"]["counts"]) == 2
    from workbench.widgets.audit import step_values

    outside = lambda h: step_values({"is_weight_hist": whole["is_weight_hist"], **h}, [])[0]["is_weight_outside"]  # noqa: E731
    assert outside({"is_weight_hist_current": whole["is_weight_hist_current"]}) == 0.0 and outside({}) > 0  # (runs before it: all)
    for k in ("is_ess", "is_bounded_fraction"):  # from sums, so the parts' merge is the whole's
        assert merged[k] == pytest.approx(whole[k], abs=1e-9) and whole[k] is not None, k
    # a batch without a token of the trainer's version measures nothing there: None, not 0
    later = correction_weights(old, behav, mask, versions, 9, cfg).stats
    assert later["tokens_current"] == 0 and later["kl_k3_current"] is None
    assert merge_stats([later, whole])["kl_k3_current"] == pytest.approx(whole["kl_k3_current"], abs=1e-12)
    # ... and k3 on the stale tokens only (versions 5 and 1 under trainer version 6: r = 1.0 and 0.5)
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert whole["kl_k3_stale"] == pytest.approx((k3(1.0) + k3(0.5)) / 2, abs=1e-6)
    assert merged["kl_k3_stale"] == pytest.approx(whole["kl_k3_stale"], abs=1e-9)
    assert later["kl_k3_stale"] == pytest.approx(later["kl_k3"], abs=1e-12)  # every token stale
    # a token newer than the trainer (after a restore to older weights) is neither current nor stale
    restored = correction_weights(old, behav, mask, versions, 4, cfg).stats
    assert restored["tokens_stale"] == 1 and restored["kl_k3_stale"] == pytest.approx(k3(0.5), abs=1e-6)
    on_time = correction_weights(old, behav, mask, torch.where(mask.bool(), 6, -1), 6, cfg).stats
    assert on_time["kl_k3_stale"] is None and merge_stats([on_time, whole])["kl_k3_stale"] == pytest.approx(whole["kl_k3_stale"])
    # a NaN part's max |delta p| stays NaN whatever the order (max(0.0, nan) is 0.0: a NaN rank hidden)
    nan = {**whole, "max_abs_delta_p": math.nan}
    assert all(math.isnan(merge_stats(ps)["max_abs_delta_p"]) for ps in ([whole, nan], [nan, whole]))


def test_gate_ratio_ignores_padding_rows_and_merges_over_unequal_parts():
    """Trainer ranks pad with all-masked rows and micro-batches differ in size: neither may
    move the gate pass ratio."""
    from workbench.correction import merge_stats

    old, behav, mask, versions = batch()
    cfg = CorrectionConfig(level="geo", mode="mask", low=0.99, high=1.01, max_staleness=1)
    whole = correction_weights(old, behav, mask, versions, 6, cfg).stats
    pad = lambda t: torch.cat([t, torch.zeros_like(t[:1])])  # noqa: E731
    padded = correction_weights(pad(old), pad(behav), pad(mask), pad(versions), 6, cfg).stats
    assert padded["gate_pass_ratio"] == whole["gate_pass_ratio"] and padded["sequences"] == whole["sequences"] == 2
    assert padded["stale_dropped"] + padded["band_dropped"] == whole["stale_dropped"] + whole["band_dropped"]
    parts = [correction_weights(pad(old[:1]), pad(behav[:1]), pad(mask[:1]), pad(versions[:1]), 6, cfg).stats,
             correction_weights(old[1:], behav[1:], mask[1:], versions[1:], 6, cfg).stats]
    assert merge_stats(parts)["gate_pass_ratio"] == pytest.approx(whole["gate_pass_ratio"])


def test_a_kept_sequence_never_carries_an_unbounded_token_weight():
    """The review's case: 20 tokens whose geometric-mean ratio is exactly 1, one of them with
    r = 20.1. The geo mask keeps the sequence; before the fix that token was weighted 20.1."""
    n = 20
    log_r = torch.full((1, n), -math.log(20.1) / (n - 1))
    log_r[0, 7] = math.log(20.1)  # sum 0: geometric mean exactly 1
    behav = torch.full((1, n), -2.0)
    old = behav + log_r
    mask, versions = torch.ones(1, n), torch.zeros(1, n, dtype=torch.long)
    c = correction_weights(old, behav, mask, versions, 0, CorrectionConfig(level="geo", mode="mask"))
    assert c.keep.tolist() == [True]
    assert torch.allclose(c.weights, torch.ones(1, n), atol=1e-5) and float(c.weights.max()) < 1.01
    # seq level: the unit is the product of the ratios, also exactly 1
    c = correction_weights(old, behav, mask, versions, 0, CorrectionConfig(level="seq", mode="mask"))
    assert c.keep.tolist() == [True] and float(c.weights.max()) < 1.01
    # the token veto rejects the sequence that holds the outlier, and counts it
    c = correction_weights(old, behav, mask, versions, 0, CorrectionConfig(level="geo", mode="mask", veto_high=10.0))
    assert c.keep.tolist() == [False] and c.weights.abs().sum() == 0 and not c.token_keep.any()
    assert c.stats["veto_dropped"] == 1 and c.stats["band_dropped"] == 0 and c.stats["gate_pass_ratio"] == 0.0


def test_the_token_veto_drops_a_sequence_with_a_nan_ratio():
    """A NaN log-prob on a trained token: both of the veto's comparisons were False, the sequence
    was kept with a NaN weight (the whole update skipped) and the gate read as passing everything."""
    behav = torch.tensor([[-1.0, -1.0, float("nan")], [-1.0, -1.0, -1.0]])
    old, mask = torch.full((2, 3), -1.0), torch.tensor([[0.0, 1, 1], [0, 1, 1]])
    c = correction_weights(old, behav, mask, torch.zeros(2, 3, dtype=torch.long), 0,
                           CorrectionConfig(level="token", mode="trunc", high=2.0, max_staleness=None, veto_low=1e-4))
    assert c.keep.tolist() == [False, True] and torch.isfinite(c.weights).all()
    assert c.stats["veto_dropped"] == 1 and c.stats["gate_pass_ratio"] == 0.5


def test_token_veto_by_hand():
    # token ratios: seq0 = [1.0, 1.2], seq1 = [0.5, 1.0]; TIS keeps both unless vetoed
    c = run(CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=None, veto_low=0.6))
    assert c.keep.tolist() == [True, False] and torch.allclose(c.weights[0], torch.tensor([0, 1.0, 1.2]))
    assert c.stats["veto_dropped"] == 1
    c = run(CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=None, veto_high=1.1))
    assert c.keep.tolist() == [False, True] and torch.allclose(c.weights[1], torch.tensor([0, 0.5, 1.0]))
    # the veto is a gate: with the correction's weights off (every kept token weighs 1) it still drops
    c = run(CorrectionConfig(level="token", mode="trunc", low=0.0, high=2.0, max_staleness=None, veto_low=0.6, enabled=False))
    assert c.keep.tolist() == [True, False] and c.weights[1].sum() == 0 and c.stats["veto_dropped"] == 1
    # token mask: a rejected token is out of every loss term (token_keep), a kept one in
    c = run(CorrectionConfig(level="token", mode="mask", low=0.8, high=1.1, max_staleness=None))
    assert c.token_keep.tolist() == [[False, True, False], [False, False, True]]
    for bad in ({"veto_low": 0.0}, {"veto_low": 1.5}, {"veto_high": 0.5}, {"kept_weight": "unit"}):
        with pytest.raises(CorrectionConfigError):
            CorrectionConfig(**bad)


def test_sampling_check_refuses_a_temperature_the_trainer_does_not_use():
    cfg = CorrectionConfig()
    with pytest.raises(CorrectionConfigError, match="temperature 0.7 but the trainer computes log-probs at 1.0"):
        cfg.check_sampling(temperature=0.7, trainer_temperature=1.0)
    with pytest.raises(CorrectionConfigError, match="greedy"):
        cfg.check_sampling(temperature=0.0, trainer_temperature=0.0)
    cfg.check_sampling(temperature=0.7, trainer_temperature=0.7)
    # vLLM samples 0.005 at 0.01 (the recorded log-probs 0.3 nat off a trainer at 0.005) and refuses 2.5
    for t in (0.005, 2.5):
        with pytest.raises(CorrectionConfigError, match=r"in \[0.01, 2\]"):
            cfg.check_sampling(temperature=t, trainer_temperature=t)
    cfg.check_sampling(temperature=0.01, trainer_temperature=0.01)
