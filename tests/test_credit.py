"""Episodes, not segments, are the unit of credit: advantages and sequence-level aggregations
over episodes however many segments an episode sealed into; failed and truncated episodes
follow the loop's setting. Constructed trajectories, hand-computed values."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from workbench.loop import LoopConfig, batch_from_groups, zero_variance
from workbench.tokens import Segment, Trajectory
from workbench.trainer.losses import aggregate, aggregation_weights


def seg(n_prompt: int, n_sampled: int, tok: int = 7) -> Segment:
    return Segment([tok] * (n_prompt + n_sampled), [0] * n_prompt + [1] * n_sampled, [0.0] * n_prompt + [-1.0] * n_sampled,
                   [-1] * n_prompt + [0] * n_sampled)


def episode(reward: float, n_segments: int = 1, **kw) -> Trajectory:
    return Trajectory([seg(2, 2) for _ in range(n_segments)], reward, **kw)


def per_episode_advantage(batch, info):
    """The advantage of each row (its first trainable token's)."""
    return [float(a[m.bool()][0]) for a, m in zip(batch["advantages"], batch["loss_mask"])]


@pytest.mark.parametrize("estimator,expected", [("grpo", [-1.5, 0.5, 0.5, 0.5]), ("rloo", [-1.0, 1 / 3, 1 / 3, 1 / 3]),
                                                ("dr_grpo", [-0.75, 0.25, 0.25, 0.25])])
def test_an_episode_of_five_segments_weighs_once_in_its_group(estimator, expected):
    one_each = [[episode(0.0), episode(1.0), episode(1.0), episode(1.0)]]
    five = [[episode(0.0, n_segments=5), episode(1.0), episode(1.0), episode(1.0)]]
    b1, _ = batch_from_groups(one_each, estimator)
    b5, info = batch_from_groups(five, estimator)
    a1, a5 = per_episode_advantage(b1, None), per_episode_advantage(b5, None)
    assert a1 == pytest.approx(expected, abs=1e-5)
    # the five segments of episode 0 each carry episode 0's advantage; the others are unchanged
    # (before the fix: -0.725 and 1.208 for GRPO, the five-segment episode counted five times)
    assert a5 == pytest.approx([expected[0]] * 5 + expected[1:], abs=1e-5)
    assert info["episodes"] == 4 and info["segments"] == 8
    assert b5["episode_tokens"].tolist() == [10.0] * 5 + [2.0] * 3
    _, info = batch_from_groups(five + [[episode(1.0), episode(1.0)], [episode(0.0), episode(0.0)]], estimator)
    assert info["zero_variance_groups"] == 2  # the two of equal rewards teach nothing
    assert info["signal_tokens"] == 16  # the first group's 8 rows of 2 tokens; the others' advantages are 0
    _, info = batch_from_groups([[episode(1.0), episode(1.0)]], estimator)
    assert info["signal_tokens"] == 0


def test_several_updates_a_step_take_whole_episodes_not_runs_of_rows():
    """With updates_per_step > 1 the batch's rows were cut into runs of equal rows: an episode sealed
    into 6 segments filled most of one update alone, and with each update's mean over its own
    episodes it weighed 0.5 of the step against 0.167 for the others (0.25 each, one segment each).
    Each update now takes whole episodes, as many in each as can be."""
    import types

    from workbench.trainer.fsdp import Trainer
    from workbench.trainer.losses import episode_units

    groups = [[episode(1.0, n_segments=6, episode_id="e0"), *(episode(float(i % 2 == 0), episode_id=f"e{i}") for i in (1, 2, 3))],
              [episode(float(i % 2 == 0), episode_id=f"e{i}") for i in (4, 5, 6, 7)]]
    b, _ = batch_from_groups(groups, "grpo")
    for ranks in (1, 2):
        parts, _ = Trainer._split(types.SimpleNamespace(workers=[None] * ranks), b, updates=2)
        per = parts[0]["rows_per_update"]
        updates = [[p["episode_tokens"][u * per:(u + 1) * per] for p in parts] for u in range(2)]
        masks = [[p["loss_mask"][u * per:(u + 1) * per] for p in parts] for u in range(2)]
        # each update's episodes, counted as the trainer counts them (rows of one episode sum to 1)
        counts = [sum(float(episode_units(m, e).sum()) for m, e in zip(ms, es)) for ms, es in zip(masks, updates)]
        assert counts == pytest.approx([4.0, 4.0]), (ranks, counts)
    # trajectories built by hand share the id "": an episode starts where the segment index does not grow
    b, _ = batch_from_groups([[episode(1.0, n_segments=6), *(episode(float(i % 2 == 0)) for i in range(1, 8))]], "grpo")
    parts, _ = Trainer._split(types.SimpleNamespace(workers=[None]), b, updates=2)
    per = parts[0]["rows_per_update"]
    assert [float(episode_units(parts[0]["loss_mask"][u * per:(u + 1) * per], parts[0]["episode_tokens"][u * per:(u + 1) * per]).sum())
            for u in range(2)] == pytest.approx([4.0, 4.0])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "dr_grpo"])
def test_rewards_equal_in_float64_but_not_in_float32_have_no_advantage(estimator):
    """Rewards 6e-10 apart (one value to zero_variance, within 1e-9) that straddle a float32
    rounding point: cast to float32 before the advantage they were one float32 step apart, and
    grpo gave the group +-0.029 while zero_variance_groups counted it as flat."""
    a = float(np.float32(0.7))
    mid = (a + float(np.nextafter(np.float32(0.7), np.float32(1)))) / 2
    group = [episode(mid + d) for d in (-3e-10, 3e-10, -3e-10, 3e-10)]
    batch, info = batch_from_groups([group], estimator)
    assert info["zero_variance_groups"] == 1 and info["signal_tokens"] == 0
    assert batch["advantages"].abs().max() == 0


def test_steps_without_learning_signal_are_reported_once_a_streak(capsys):
    from workbench.loop import NO_SIGNAL_STEPS, warn_no_signal

    silent = {"signal_tokens": 0, "reward_mean": 0.0}
    history, printed = [], []
    for step in range(3 * NO_SIGNAL_STEPS):
        # a step with signal in the middle ends the first streak; a second one is reported again
        history.append({**silent, "step": step} if step != NO_SIGNAL_STEPS + 1 else {**silent, "signal_tokens": 12})
        printed.append(warn_no_signal(history))
    assert [i for i, p in enumerate(printed) if p] == [NO_SIGNAL_STEPS - 1, 2 * NO_SIGNAL_STEPS + 1]
    assert "had no learning signal" in capsys.readouterr().err
    # the trainer's count decides where there is one: a batch with advantages that the gate dropped whole
    gated = {"signal_tokens": 40, "signal_tokens_trained": 0, "reward_mean": 0.5}
    assert warn_no_signal([{**gated, "step": s} for s in range(NO_SIGNAL_STEPS)])
    # each cause named as it is (all three read "every group's rewards were equal" and advised the gate)
    assert "the correction's gate dropped every row that had an advantage" in capsys.readouterr().err
    failed = {"signal_tokens": 0, "signal_tokens_trained": 0, "episodes": 0, "failed_episodes": 32, "updates_skipped": 1}
    assert warn_no_signal([{**failed, "step": s} for s in range(NO_SIGNAL_STEPS)])
    assert "every episode failed (32 in the last step" in capsys.readouterr().err
    assert warn_no_signal([{**silent, "step": s} for s in range(NO_SIGNAL_STEPS)])
    assert "every group's rewards were equal" in capsys.readouterr().err
    # every episode truncated and masked (rewards 0 and 1): the step's record, from batch_from_groups'
    # refusal, counted no episodes, and the warning said "every group's rewards were equal"
    from workbench.loop import NothingToTrain

    truncated = [episode(r) for r in (0.0, 1.0, 0.0, 1.0)]
    for t in truncated:
        t.truncated = True
    with pytest.raises(NothingToTrain) as refused:
        batch_from_groups([truncated], "grpo", on_truncated="mask")
    masked = {**refused.value.info, "signal_tokens": 0, "signal_tokens_trained": 0, "updates_skipped": 1, "reward_mean": 0.5}
    assert masked["episodes"] == 4 and masked["masked_episodes"] == 4
    assert warn_no_signal([{**masked, "step": s} for s in range(NO_SIGNAL_STEPS)])
    assert "every episode kept was masked (4 in the last step; 4 truncated" in capsys.readouterr().err
    with pytest.raises(NothingToTrain) as refused:  # ... and dropped: "no episode reached the batch"
        batch_from_groups([truncated], "grpo", on_truncated="drop")
    dropped = {**refused.value.info, "signal_tokens": 0, "signal_tokens_trained": 0, "updates_skipped": 1, "reward_mean": 0.5}
    assert warn_no_signal([{**dropped, "step": s} for s in range(NO_SIGNAL_STEPS)])
    assert "no episode reached the batch (4 dropped in the last step, 4 of them truncated" in capsys.readouterr().err
    # every episode failed before its first turn (no segments) and kept or zeroed by on_failed: counted as
    # episodes, and read as "every group's rewards were equal"
    for rule in ("zero", "keep"):
        crashed = [Trajectory([], 0.0, "g", f"e{i}", {}, "ConnectionError: no server") for i in range(4)]
        with pytest.raises(NothingToTrain) as refused:
            batch_from_groups([crashed], "grpo", on_failed=rule)
        rec = {**refused.value.info, "signal_tokens": 0, "signal_tokens_trained": 0, "updates_skipped": 1, "reward_mean": 0.0}
        assert warn_no_signal([{**rec, "step": s} for s in range(NO_SIGNAL_STEPS)])
        assert "every episode failed (4 in the last step" in capsys.readouterr().err, rule
    # a non-finite gradient skipped every update: it blamed the gate, beside a gate_pass_ratio of 1.0
    nan = {"signal_tokens": 120, "signal_tokens_trained": 0, "grad_norm": float("nan"), "gate_pass_ratio": 1.0,
           "updates_skipped": 1, "episodes": 8, "segments": 8}
    assert warn_no_signal([{**nan, "step": s} for s in range(NO_SIGNAL_STEPS)])
    assert "the gradient was not finite (grad_norm nan)" in capsys.readouterr().err


def test_a_streak_without_signal_spans_runs(capsys, monkeypatch):
    """A notebook calling wb.run(2) again and again: each run's own history never held 5 steps,
    so the warning never fired. run() reads the steps before it (`earlier`) with its own, and
    returns its own only. (The loop's collaborators are stood in for: the window is the point.)"""
    import contextlib

    from workbench import loop

    silent = {"signal_tokens_trained": 0, "reward_mean": 0.0}
    for name in ("check_staleness", "check_sampling", "check_teacher"):
        monkeypatch.setattr(loop, name, lambda *a: None)
    monkeypatch.setattr(loop, "TrainerWatch", lambda trainer: contextlib.nullcontext())

    def one_silent_step(*args, **kwargs):
        history = args[-1]
        loop._after_step(None, loop.LoopConfig(), 9, {**silent, "step": 9}, history, None, None, None, 0,
                         threading.Event())
        return history

    monkeypatch.setattr(loop, "_run", one_silent_step)
    earlier = [{**silent, "step": s} for s in range(5, 9)]  # four silent steps in earlier runs
    assert loop.run(None, None, [], None, loop.LoopConfig(), earlier=earlier) == [{**silent, "step": 9}]
    assert "the last 5 steps (to step 9) had no learning signal" in capsys.readouterr().err
    assert loop.run(None, None, [], None, loop.LoopConfig()) == [{**silent, "step": 9}]  # alone: no streak yet
    assert "no learning signal" not in capsys.readouterr().err


def test_a_policy_moving_too_far_for_its_stale_tokens_is_reported_once_a_streak(capsys):
    from workbench.loop import STALE_KL_LIMIT, warn_policy_outran_correction

    kls = [None, 0.3, 2 * STALE_KL_LIMIT, 3 * STALE_KL_LIMIT, 0.5, 1.5 * STALE_KL_LIMIT]
    history, printed = [], []
    for step, kl in enumerate(kls):  # None: no stale token (a sync step), nothing measured
        history.append({"step": step, "kl_k3_stale": kl})
        printed.append(warn_policy_outran_correction(history))
    assert [i for i, p in enumerate(printed) if p] == [2, 5]
    assert "step 2's stale tokens were sampled 2.00 nats" in capsys.readouterr().err


def test_sequence_level_aggregations_average_over_episodes():
    groups = [[episode(0.0, n_segments=5), episode(1.0), episode(1.0), episode(1.0)]]
    b, _ = batch_from_groups(groups, "grpo")
    m, et = b["loss_mask"], b["episode_tokens"]
    # every episode's weights sum to 1/4, however many segments and tokens it has
    w = aggregation_weights(m, "seq_mean_token_mean", episode_tokens=et)
    per_row = w.sum(-1)
    assert float(per_row[:5].sum()) == pytest.approx(0.25) and per_row[5:].tolist() == pytest.approx([0.25] * 3)
    # a token loss of 1 on episode 0 only: its mean is 1, the mean over episodes 1/4
    losses = torch.zeros_like(m)
    losses[:5] = 1.0
    assert float(aggregate(losses, m, "seq_mean_token_mean", episode_tokens=et)) == pytest.approx(0.25)
    # constant (Dr.GRPO): sum / (episodes x a FIXED length), whatever the padded width
    c = float(aggregate(losses * m, m, "constant", max_len=16, episode_tokens=et))
    assert c == pytest.approx(10 / (4 * 16))
    wide = torch.nn.functional.pad(m, (0, 9))
    assert float(aggregate(torch.nn.functional.pad(losses * m, (0, 9)), wide, "constant", max_len=16, episode_tokens=et)) == pytest.approx(c)
    with pytest.raises(ValueError, match="fixed length"):
        aggregation_weights(m, "constant")
    from workbench.trainer.fsdp import TrainerConfig

    with pytest.raises(ValueError, match="constant_len"):
        TrainerConfig(aggregation="constant")


def test_failed_and_truncated_episodes_follow_the_setting():
    def groups():
        return [[episode(1.0), episode(0.0), episode(0.6, truncated=True), episode(0.0, error="boom")]]

    def rewards_seen(**kw):
        b, info = batch_from_groups(groups(), "dr_grpo", **kw)  # dr_grpo: a = r - group mean
        return per_episode_advantage(b, info), info

    a, info = rewards_seen()  # defaults: failed dropped, truncated kept with its reward
    assert info["failed_episodes"] == 1 and info["truncated_episodes"] == 1 and info["dropped_episodes"] == 1
    assert info["episodes"] == 3 and a == pytest.approx([1 - 1.6 / 3, -1.6 / 3, 0.6 - 1.6 / 3])
    a, info = rewards_seen(on_truncated="drop")
    assert info["episodes"] == 2 and a == pytest.approx([0.5, -0.5])
    a, info = rewards_seen(on_truncated="zero", on_failed="zero")
    assert info["episodes"] == 4 and a == pytest.approx([0.75, -0.25, -0.25, -0.25])
    a, info = rewards_seen(on_failed="keep")
    assert info["episodes"] == 4 and len(a) == 4
    # "mask" (DAPO's overlong filtering, TRL's mask_truncated_completions): the truncated episode's
    # reward counts in its group's baseline, none of its tokens trains (two rows, not three)
    a, info = rewards_seen(on_truncated="mask")
    assert info["masked_episodes"] == 1 and info["episodes"] == 3 and a == pytest.approx([1 - 1.6 / 3, -1.6 / 3])
    # one success among truncated run-ons: "drop" read it as zero variance (one reward left), "mask"
    # keeps its signal against the run-ons' rewards
    runons = [[episode(1.0)] + [episode(0.0, truncated=True) for _ in range(3)]]
    assert zero_variance(runons[0], on_truncated="drop") and not zero_variance(runons[0], on_truncated="mask")
    b, info = batch_from_groups(runons, "dr_grpo", on_truncated="mask")
    assert per_episode_advantage(b, info) == pytest.approx([0.75]) and b["input_ids"].shape[0] == 1
    # a batch-wide scale (reinforce_pp_baseline's std) is over the tokens trained: masked run-ons,
    # no token of theirs, are in their group's mean only (in the std they inflated every advantage 1.3x)
    b, info = batch_from_groups([[episode(1.0), episode(0.0)] + [episode(0.0, truncated=True) for _ in range(6)],
                                 [episode(1.0), episode(0.0)]], "reinforce_pp_baseline", on_truncated="mask")
    centred = torch.tensor([0.875, -0.125, 0.5, -0.5])
    assert per_episode_advantage(b, info) == pytest.approx((centred / centred.pow(2).mean().sqrt()).tolist(), abs=1e-5)
    # but a group whose trained episodes all sit at its mean teaches nothing, whatever the masked
    # rewards' spread: only masked run-ons (no row), or the one trained episode at the mean
    for group in ([episode(r, truncated=True) for r in (0.0, 0.5, 1.0, 0.0)],
                  [episode(1.0, truncated=True), episode(0.0, truncated=True), episode(0.5)]):
        assert zero_variance(group, on_truncated="mask") and not zero_variance(group, on_truncated="keep")
    with pytest.raises(ValueError, match="on_truncated"):
        LoopConfig(on_truncated="clip")


def test_distillation_without_teacher_logprobs_is_refused_up_front():
    with pytest.raises(ValueError, match="teacher log-probs"):
        LoopConfig(advantage="distill")


def test_rewards_the_advantages_cannot_hold_are_refused_by_name():
    """A reward past MAX_ABS_REWARD made float32 advantages inf (dr_grpo: one of 1e39 in a group)
    or NaN, or silently 0; an int past float's range raised OverflowError without naming the
    reward; an Env's True was summed silently. Each is a clear error now (the runner fails the
    episode with it: test_rollout's NaN agent). numpy's real numbers are rewards, as Gymnasium's
    SupportsFloat (a reward model's float32 scores failed every episode); its bool is not."""
    from workbench.agents import MAX_ABS_REWARD, as_reward, reward_value
    from workbench.trainer.losses import AdvantageInput, get_advantage

    x = AdvantageInput(torch.tensor([1e39, 0, 0, 0], dtype=torch.float64), torch.zeros(4, dtype=torch.long), torch.ones(4, 1))
    assert not torch.isfinite(get_advantage("dr_grpo")(x).float()).all()  # why the bound
    for bad, match in ((1e39, "beyond"), (10**400, "past a float's range"), (float("nan"), "finite"),
                       (True, "must be a number"), (np.bool_(True), "must be a number"), ("0.75", "must be a number")):
        with pytest.raises((TypeError, ValueError), match=match):
            reward_value(bad, "the reward MyEnv.step returned at turn 2")
    assert reward_value(np.float64(0.5)) == 0.5 and reward_value(-MAX_ABS_REWARD) == -MAX_ABS_REWARD
    assert [type(reward_value(r)) for r in (np.float32(0.5), np.int64(2))] == [float, float]
    assert as_reward((np.float32(0.25), {})) == (0.25, {})
    assert as_reward((3, {"a": 1})) == (3.0, {"a": 1})
    with pytest.raises(ValueError, match="the episode's reward is 1e\\+39"):
        as_reward(1e39)


def test_the_shipped_graders_survive_what_a_policy_writes():
    """The calculator tool and the answer readers take the policy's text: "-" * 6000 + "1" raised
    MemoryError out of the calculator, 5,000 nines a ValueError out of int(), each failing (so
    dropping) the episode, a way out of a low reward. Now a tool error and "no answer"."""
    import asyncio

    from workbench.examples.arithmetic_env import ArithmeticEnv
    from workbench.examples.tools import calc, answer_number

    assert calc("2+3*4") == "14" and calc("-" * 6000 + "1").startswith("error") and calc("~" * 6000 + "1").startswith("error")
    assert answer_number("so 41 or 42") == 42 and answer_number("9" * 5000) is None and answer_number("no number") is None
    # as a model writes numbers: right answers read wrong ("9,801" was 801, "12.0" was 0)
    assert (answer_number("The answer is 9,801."), answer_number("12.0"), answer_number("12.5"), answer_number("1,2,3")) == \
        (9801, 12, None, 3)
    # the marked answer first, then the last number (each of these read a wrong number before)
    for text, want in (("The answer is 18. Check: 20 - 2 = 18 and 18 / 2 = 9", 18), ("Answer: 18 (9 x 2)", 18),
                       ("The area is 18 m^2.", 18), ("\\boxed{1{,}234}", 1234), ("1\\,234 apples", 1234),
                       ("It takes 2-3 days", 3), ("x = -3", -3), ("#### 72", 72), ("so the answer is \u221212", -12),
                       # the marked sentence's result, not its first operand; a fraction or a power is no whole number
                       ("The answer is 48 + 24 = 72.", 72), ("answer: 2^{10} = 1024", 1024), ("The answer is 3/4.", None),
                       ("The answer is \\boxed{\\frac{1}{2}}", None), ("answer is 1e5", None),
                       # the answer on the marker's next line, or an earlier marker's (each read None: scored 0)
                       ("The answer is:\n408", 408), ("**Answer:**\n408", 408),
                       ("\\boxed{408}. I hope this answer is helpful.", 408), ("The answer is unknown.", None),
                       # a correction on the same line is the answer (the first marker hid it: a wrong
                       # correction of a right guess earned the reward), and a fraction is none ("3/4" read 4)
                       ("The answer is 71. Wait, I made an error: the answer is 72.", 72),
                       ("I first thought the answer is 71, but the final answer is 72.", 72),
                       ("The answer is 71. Answer: 72", 72), ("3/4", None), ("The result is 72/1", None),
                       # a dash written as a minus (an en dash read 48: a wrong sign paid), an equation's
                       # result side (the trailing working's operand was read), a marked expression without
                       # a result is no answer, "isn't" is no marker, powers, an invisible or no-break space
                       ("The answer is \u201348", -48), ("The answer is \uff0d48", -48), ("It takes 2\u20133 days", 3),
                       ("Answer: 18 = 9 * 2", 18), ("The answer is 1665\n\nNote: answer = 37*45", 1665),
                       ("Answer = 37 * 45", None), ("the answer isn't 5, it's 6", 6), ("The answer is 7\u00b2", None),
                       ("2**3", None), ("7\u200b2", 72), ("1\u00a0665", 1665),
                       # LaTeX and dot operators, and a power, are working too (the operand was read)
                       ("The answer is $36 = 12 \\times 3$", 36), ("Answer: 35 = 5 \\cdot 7", 35), ("Answer: 35 = 5\u00b77", 35),
                       ("Answer: 36 = 6\u00b2", 36), ("The answer is 12 \\times 3", None),
                       # a markdown heading is no GSM8K marker ("#### Step 2: Verify", "#### 2. Check" were the
                       # answer 2); a negation before the marked number, or a hedge or correction joining two, is no
                       # one answer (the first number was paid), but a clarification or a conversion is; nor is an
                       # exponent's digits; a correction after a boxed answer is the answer
                       ("#### Step 1: Multiply\n37 x 45 = 1665. The answer is 1665.\n\n#### Step 2: Verify\n1665 / 45 = 37", 1665),
                       ("#### 1. Compute the total\n3 boxes x 6 = 18 eggs.\n\n#### 2. Check\n18 / 6 = 3.\n\nThe answer is 18.", 18),
                       ("#### Final Answer\n1665", 1665), ("#### -5", -5), ("#### $1,234", 1234),
                       ("The answer is not 1665; it is 1664.", None), ("The answer is 1665, no wait, 1664.", None),
                       ("Answer: 18 or 19", None), ("The answer is 18, not 20.", 18), ("The answer is 3 hours, or 180 minutes.", 3),
                       ("Final answer: the mean is 85", 85), ("The answer is 42 (no remainder when 84 is divided by 2)", 42),
                       ("\\boxed{17}. Wait, I made an error: the answer is 18.", 18),
                       ("The result is 1.665e3", None), ("18e0", None), ("1e-5 and 7", 7),
                       # a check of the answer after it is no answer (it was: checking one's work scored 0); a
                       # "####" line ending in a full stop is a marker; a marker without a number leaves the
                       # last number (read None); "which equals" is an "="; a minus apart from its number or
                       # before a currency sign keeps its sign; a restatement is no hedge, a list, a range
                       # or a hedge in brackets is
                       ("\\boxed{72}\nTo double-check the answer: 9 * 8 = 72 and 72 - 2 = 70.", 72),
                       ("#### 72\nCheck answer: 72 - 67 = 5", 72), ("The answer is 72.\nLet's verify the answer: 72 / 8 = 9.", 72),
                       ("The answer is probably 70 apples.\n#### 72.", 72),
                       ("Answer: Let's think step by step.\n8 * 9 = 72\nShe has 72 apples.", 72),
                       ("I'm not sure what the answer is. 72", 72), ("The answer is 8 times 9, which equals 72.", 72),
                       ("The answer is 72, which equals 8 times 9.", 72), ("The answer is \u2212 5", -5), ("The answer is -$5", -5),
                       ("The answer is 72, or 72 apples in total.", 72), ("The answer is 72 (or 73).", None),
                       ("Answer: 72 or possibly 73", None), ("Answer: 72, 73, 74", None), ("The answer is 70 to 75", None),
                       ("The answer is between 70 and 75", None), ("The answer is 72 and 73.", None),
                       ("The answer is 72 and 72 apples.", 72), ("The answer is 72 and the remainder is 2.", 72),
                       # a correction after a check is the answer (not the first guess); an en dash with spaces
                       # is punctuation; "which makes" a conversion, no "="; a hedge after a marker without a number
                       ("Initially I thought the answer is 71.\nAfter checking my work, the answer is 72.", 72),
                       ("The answer is 71.\nDouble-checking the arithmetic, I confirm the answer is 72.", 72),
                       ("Final answer \u2013 72", 72), ("The answer is 24 eggs, which makes 2 dozen.", 24),
                       ("Answer: I cannot say; maybe 71, maybe 72 (or 73).", None),
                       # markdown around a marker, a heading (the last number, a check's, was read: a right answer
                       # 0, a wrong one paid), \dfrac (read its numerator), a decimal part alone (".5" read 5),
                       # more hedges between two numbers (each paid its first)
                       ("**Final Answer**: 18\n\nVerification: 18 / 2 = 9 eggs.", 18), ("**Final Answer**: 17\n\nCheck: 9 * 2 = 18", 17),
                       ("### Final Answer\n18\n\nCheck: 18 / 2 = 9.", 18), ("__Answer__: 1665\n\nCheck: 1665 / 45 = 37", 1665),
                       ("\\boxed{\\dfrac{18}{5}}", None), ("The answer is \\tfrac{36}{2}", None), ("The answer is .5", None),
                       ("The answer is 72 | 73", None), ("The answer is 72 vs 73", None), ("The answer is 72 \u00b1 1", None),
                       ("The answer is 72 through 75", None), ("Answer: 71 (alternatively 72)", None),
                       ("\\boxed{71 \\text{ or } 72}", None), ("The answer is 2**10", None),
                       # an expression's result in words or an arrow (read None: the right answer 0, under a
                       # wrong one's partial credit); a later "not 6" rules out 6, not an earlier boxed 5,
                       # unless it is the number ruled out; a correction worked out after a check word is
                       # the answer (a check's arithmetic holds the number it checks)
                       ("The answer is 7 - 2, which is 5.", 5), ("So the answer is 7 - 2 \u2192 5.", 5),
                       ("The answer is 7 - 2, so 5 cards.", 5), ("The answer is 7 - 2, i.e. 5.", 5),
                       ("The answer is 24 eggs, which is 2 dozen.", 24), ("The answer is 5, which is 2 more than 3.", 5),
                       ("\\boxed{5}\n\n(Note: the answer is not 6.)", 5), ("#### 5\nThe answer is not 9.", 5),
                       ("\\boxed{13}. The answer is not 13; it is 12", None),
                       ("The answer is 4. After double-checking, the answer is 7 - 2 = 5.", 5),
                       ("The answer is 11. Let me check again: the answer is 3 + 9 = 12", 12),
                       # ... but a result already written stands, a conversion or comparison after it is no "="
                       # (each read its second number), and a check's rounded result holds the number it checks
                       ("The answer is 5 * 3 = 15, which is 3 more than 12.", 15), ("The answer is 4 * 6 = 24 eggs, giving 2 dozen.", 24),
                       ("Answer: 180 / 3 = 60 minutes, i.e. 1 hour.", 60), ("The answer is 3 * 4 = 12, so 2 boxes are left over.", 12),
                       ("The answer is 3 x 8 = 24 hours -> 1 day.", 24), ("The answer is (3 + 4) * 2, which is 14 apples", 14),
                       ("The answer is 33. To check the answer: 100 / 3 = 33.33", 33)):
        assert answer_number(text) == want, text
    # the math recipe's reward reads the same way; a list of numbers is no one number ("3,4,5" read 345)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks" / "recipes" / "agents"))
    from math_answer import reward

    assert reward("The sides are 3,4,5.", "345")[1] is False
    assert reward("The answer is 18. Check: 18 / 2 = 9", "18") == (1.0, True)
    assert reward("\\boxed{1{,}234}", "1234") == (1.0, True) and reward("no number", "3") == (0.0, False)
    # commas only as thousands groups in a label ("1,5" read 15 here and 5 by label_number)
    from workbench.examples.tools import label_number

    for bad in ("1,5", "12,34", "1,2,3"):
        with pytest.raises(ValueError, match="no number"):
            reward("The answer is 15", bad)
        with pytest.raises(ValueError, match="no whole number"):
            label_number(bad)
    assert reward("The answer is 1234", "1,234") == (1.0, True) and label_number("9,801") == 9801
    env = ArithmeticEnv()
    asyncio.run(env.reset(type("T", (), {"label": 7, "messages": []})()))
    for text, reward in (("7", 1.0), ("9" * 5000, 0.0), ("8", 0.45)):
        assert asyncio.run(env.step({"role": "assistant", "content": text}))[1] == pytest.approx(reward), text


def test_groups_sampled_at_another_temperature_than_the_trainers_are_refused():
    """Each segment carries the temperature its turns were sampled at (the loopback server stamps
    it): groups from another Rollout (a greedy one, one at 0.7) reaching a trainer at 1.0 through
    wb.trainer.step or the loop are refused by name; nothing checked them (the run's own check
    reads only its own rollout's sampling)."""
    groups = [[episode(1.0), episode(0.0)]]
    for t in groups[0]:
        t.segments[0].stats["temperatures"] = [0.7]
    with pytest.raises(ValueError, match=r"sampled at temperature \[0.7\], but the trainer computes log-probs at 1.0"):
        batch_from_groups(groups, "grpo", temperature=1.0)
    batch_from_groups(groups, "grpo", temperature=0.7)
    batch_from_groups([[episode(1.0), episode(0.0)]], "grpo", temperature=1.0)  # no stamp (older records): not checked
    # top_p < 1 likewise (the engine reports log-probs renormalized over the kept tokens): refused where
    # the trainer's correction needs full-vocabulary log-probs, as a run refuses its own rollout's sampling
    from workbench.correction import CorrectionConfig, CorrectionConfigError

    for t in groups[0]:
        t.segments[0].stats.update(temperatures=[1.0], top_ps=[0.9])
    with pytest.raises(CorrectionConfigError, match="top_p"):
        batch_from_groups(groups, "grpo", temperature=1.0, correction=CorrectionConfig.tis())
    batch_from_groups(groups, "grpo", temperature=1.0, correction=CorrectionConfig(enabled=False))


def test_a_reply_of_spaces_is_parsed_in_linear_time():
    """The answer and verdict parsers read the policy's (and the judge's) text with the GIL held.
    Two \\s* around an optional character tried every split of a run of spaces before a failed match:
    "\\boxed{" and 255 of Qwen3's 128-space tokens took 11 s, the runner, its loopback server and
    every episode's timeout frozen (a 1024-token reply: minutes). 100k characters each, in a process
    given 60 s (quadratic, they took minutes)."""
    import subprocess
    import sys

    code = ("from workbench.examples.tools import answer_text\n"
            "from workbench.examples.judge_agent import parse_score\n"
            "n = 100_000\n"
            "assert answer_text('\\\\boxed{' + ' ' * n) is None and answer_text('The answer is 12 =' + ' ' * n + 'x') is None\n"
            "assert answer_text('Answer:\\r' + '\\x0b' * n + 'x') is None\n"
            # the hedge check ("18 or 19"): its spaces around an optional comma, 16,000 spaces 11 s
            "assert answer_text('The answer is 5' + ' ' * n + '.') == '5' and answer_text('answer: 1' + '\\t' * n + 'x') == '1'\n"
            "assert answer_text('The answer is ' + '5,' * n) is not None\n"
            # "which equals" read as "=": a leading ",?\\s*" tried every start in a run of spaces (40 s at 50k)
            "assert answer_text('Answer: 1' + ' ' * n + ', x') == '1' and answer_text('Answer: 1' + ' ' * n + 'equals 2') == '2'\n"
            # the check-of-the-answer look back, from each of many markers on one line (20 s at 100k)
            "assert answer_text('answer is ' * (n // 10)) is None and answer_text('answer: ' * (n // 8)) is None\n"
            # a check's numbers against every earlier marker's (marker by marker: quadratic)
            "assert answer_text(''.join(f'Check the answer: {i} + 1 = {i + 1}. ' for i in range(n // 25))) is not None\n"
            "assert answer_text('The answer is 7 - 2' + ' ' * n + 'so 5') == '5'\n"
            "assert parse_score('score' + ' ' * n + 'x') is None and parse_score('7' + ' ' * n + 'x') is None\n"
            "assert parse_score('<t>' + ' ' * n + 'x', tag='t') is None and parse_score('t score: 7' + ' ' * n, tag='t') == 0.7\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_shipped_agents_grade_a_data_files_text_labels():
    """gsm8k's final answers and CSV cells are text ("18"): the calculator and code agents compared
    their int answer with it (every right answer scored 0, groups flat, nothing learned) and the
    arithmetic Env and the judge's `correct` subtracted it (TypeError: every reply with a number
    failed, dropped). A label is read as the whole number it names; one that names none is refused."""
    from workbench.examples.arithmetic_env import reward
    from workbench.examples.tools import is_answer, label_number

    import numpy as np

    assert is_answer("The answer is 18.", "18") and is_answer("9801", "9,801") and is_answer("So 18.", 18)
    assert is_answer("18", np.int64(18)) and is_answer("18", 18.0)  # (a DataFrame's row; a float column)
    assert not is_answer("The answer is 17.", "18") and not is_answer("no number", "18")
    assert reward("7", "7") == (1.0, True) and reward("6", "7") == reward("6", 7) == (0.45, False)
    for not_a_number in ("", "twelve", "3/4", "12.5", True, None, 12.5, float("nan")):
        with pytest.raises(ValueError, match="no whole number"):
            label_number(not_a_number)
    # the math recipe's reward on labels a CSV or a field mapping writes (float("1,234") raised: every
    # episode of the task failed, dropped unscored), and the tool recipes' text labels (compared with
    # ==, '19' against 19: every right answer 0)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "notebooks" / "recipes" / "agents"))
    import search_calc_openai
    from math_answer import reward as math_reward

    assert math_reward("The answer is 1234.", "1,234") == math_reward("The answer is $18.", "$18") == (1.0, True)
    # labels float() reads as before (".5" read as 5 paid a wrong answer; "1e3" was refused)
    assert math_reward("The answer is 0.5", ".5") == (1.0, True) and math_reward("The answer is 5", ".5")[1] is False
    assert math_reward("The answer is 1000", "1e3") == (1.0, True)
    with pytest.raises(ValueError, match="label 'twelve' is no number"):
        math_reward("12", "twelve")
    assert search_calc_openai.is_answer("The answer is 19.", "19")
