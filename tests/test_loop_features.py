"""The research-loop features of issue 15 on constructed groups (no engine): overlong reward
shaping, dynamic sampling (zero-variance groups filtered and replaced up to a limit), the
unbiased pass@k estimator, evaluation episodes kept out of training batches, and the
TensorBoard / W&B-offline loggers. The same features on a live session (the toy model):
tests/test_loop_features.py::test_session_eval_data_position_and_loggers at the end."""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
import types
from math import comb

import pytest
import ray

from workbench.agents import Task
from workbench.data import TaskDataset
from workbench.evaluation import default_ks, pass_at_k, summarize
from workbench.loop import (LoopConfig, batch_from_groups, collect_groups, overlong_penalty, reward_statistics, sampled_tokens,
                            zero_variance)
from workbench.rollout.engine import SamplingConfig
from workbench.tokens import Segment, Trajectory


def episode(reward: float, sampled: int = 3, *, error: str | None = None, task: str = "t", eval: bool = False):
    """An episode with 2 prompt tokens and `sampled` policy tokens."""
    seg = Segment([1, 2] + [5] * sampled, [0, 0] + [1] * sampled, [0.0, 0.0] + [-1.0] * sampled,
                  [-1, -1] + [0] * sampled)
    info = {"task_id": task, **({"eval": True} if eval else {})}
    return Trajectory([seg], reward, f"g-{task}", f"e{id(seg)}", info, error)


# ----------------------------------------------------------------------------- overlong shaping
def test_overlong_penalty_band_hand_computed():
    # max 10 tokens, band 4: no penalty up to 6, then 0.25 per token, capped at coef beyond 10
    assert [overlong_penalty(L, 10, 4) for L in (0, 6, 7, 8, 10, 11, 50)] == [0, 0, 0.25, 0.5, 1, 1, 1]
    assert overlong_penalty(9, 10, 4, coef=0.5) == pytest.approx(0.375)
    with pytest.raises(ValueError, match="0 < overlong_band <= overlong_max_tokens"):
        LoopConfig(overlong_shaping=True, overlong_max_tokens=4, overlong_band=8)


def test_overlong_shaping_changes_the_advantages():
    # two episodes with reward 1: a short one (4 tokens) and one inside the band (9 of 10, band 4)
    groups = [[episode(1.0, 4), episode(1.0, 9)]]
    assert [sampled_tokens(t) for t in groups[0]] == [4, 9]
    off = LoopConfig(advantage="dr_grpo")
    on = LoopConfig(advantage="dr_grpo", overlong_shaping=True, overlong_max_tokens=10, overlong_band=4)
    batch, info = batch_from_groups(groups, off.advantage, overlong=off.overlong())
    assert batch["advantages"].abs().sum() == 0 and "overlong_penalized" not in info  # equal rewards: no signal
    batch, info = batch_from_groups(groups, on.advantage, overlong=on.overlong())
    # shaped rewards 1 and 1 - 0.75 = 0.25; Dr.GRPO: r - mean = +0.375 / -0.375 on every sampled token
    assert batch["advantages"][0, 2:6].tolist() == [0.375] * 4 and batch["advantages"][1, 2:11].tolist() == [-0.375] * 9
    assert info["overlong_penalized"] == 1 and info["overlong_penalty_mean"] == pytest.approx(0.375)
    assert groups[0][1].reward == 1.0  # the recorded reward stays the agent's
    # a zero-variance group under the raw reward has variance once shaped: dynamic sampling sees that
    assert zero_variance(groups[0]) and not zero_variance(groups[0], overlong=on.overlong())


def test_a_step_where_every_episode_failed_is_recorded_without_an_update(capsys):
    """Every episode of a step timed out and was dropped (on_failed="drop"): batch_from_groups
    found nothing to train and the whole run stopped (a dead runner's groups too, which run() says
    fail only their episodes). The step is recorded without an update or a sync."""
    from workbench.loop import _train_on

    class Trainer:
        version = 5

        def train_step(self, batch):
            raise AssertionError("nothing to train on: no update")

    groups = [[episode(0.0, error="episode timed out after 300 s") for _ in range(2)]]
    m, sync_error = _train_on(Trainer(), [], groups, LoopConfig(), 7, 0.0, 1.0)
    assert sync_error is None and m["step"] == 7 and m["version"] == 5 and m["updates_skipped"] == 1
    assert m["failed_episodes"] == 2 and m["dropped_episodes"] == 2 and math.isnan(m["reward_mean"])
    assert m["failure_reasons"] == {"episode timed out after 300 s": 2} and m["signal_tokens_trained"] == 0
    assert "step 7 had no trainable episode" in capsys.readouterr().err


def test_window_mean_skips_steps_that_measured_nothing():
    """The notebooks' summaries: a step where no episode finished (reward_mean NaN) made the mean
    NaN, written into results.json as a bare NaN (not JSON); it is left out, None when all are."""
    from workbench.loop import window_mean

    history = [{"reward_mean": math.nan}, {"reward_mean": 0.25, "correct_rate": None}, {"reward_mean": 0.75}]
    assert window_mean(history, "reward_mean") == 0.5
    assert window_mean(history[:1], "reward_mean") is None and window_mean(history, "correct_rate") is None


# ----------------------------------------------------------------------------- dynamic sampling
class ConstructedRollout:
    """Stands in for Rollout.run_groups: each task's label is the list of rewards its group gets."""

    def __init__(self):
        self.calls: list[list[str]] = []

    def run_groups(self, tasks, group_size, progress=False, stop=None):
        self.calls.append([t.id for t in tasks])
        out = [[episode(r, task=t.id) for r in t.label[:group_size]] for t in tasks]
        for t in (t for g in out for t in g):  # an exact answer earns 1 (as the agents report it)
            t.info["correct"] = t.reward == 1.0
        return out


def pool(rewards: list[list[float]]) -> TaskDataset:
    return TaskDataset([Task([{"role": "user", "content": str(i)}], label=r, id=f"t{i}") for i, r in enumerate(rewards)],
                       shuffle=False)


def test_dynamic_sampling_filters_and_replaces_up_to_the_limit():
    mixed, ones, zeros = [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]
    source = pool([ones, mixed, zeros, zeros, mixed, ones, mixed, zeros, zeros, zeros])
    cfg = LoopConfig(prompts_per_step=3, group_size=2, dynamic_sampling=True, dynamic_sampling_rounds=2)
    rollout = ConstructedRollout()
    groups, stats, nxt = collect_groups(rollout, source, cfg, position=0)
    # first draw t0 t1 t2 keeps t1; refill of 2 (t3 t4) keeps t4; refill of 1 (t5) keeps none: limit reached
    assert rollout.calls == [["t0", "t1", "t2"], ["t3", "t4"], ["t5"]]
    assert [g[0].info["task_id"] for g in groups] == ["t1", "t4"]
    # the groups filtered out go on with the step (counted, written to untrained/: untrained_statistics)
    assert [g[0].info["task_id"] for g in stats.pop("_untrained")] == ["t0", "t2", "t3", "t5"]
    # the sampled statistics are over every group rolled out (6 right of 12); correct_rate is over the
    # kept groups, from which the filter drops every all-right one (it fell as the policy got better)
    assert stats == {"ds_filtered_groups": 4, "ds_rounds": 2, "ds_kept_groups": 2, "ds_short": 1,
                     "ds_reward_mean_sampled": pytest.approx(6 / 12), "ds_correct_rate_sampled": pytest.approx(6 / 12)}
    assert reward_statistics(groups)["correct_rate"] == 0.5
    _, stats, _ = collect_groups(ConstructedRollout(), pool([ones, ones, ones, mixed]), cfg, position=0)
    assert stats["ds_correct_rate_sampled"] == pytest.approx(7 / 8)  # where the kept groups' rate is 1 of 2
    assert nxt == 6  # every drawn task advances the data position: the next step starts at t6
    groups, stats, nxt = collect_groups(ConstructedRollout(), source, cfg, position=nxt)
    # t6 t7 t8 keeps t6; refill t9 t0 (into the next epoch) keeps none; refill t1 t2 keeps t1
    assert [g[0].info["task_id"] for g in groups] == ["t6", "t1"] and stats["ds_filtered_groups"] == 5 and nxt == 13
    # no group with signal within the limit: the step trains on its first draw (all advantages 0)
    cfg0 = LoopConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, dynamic_sampling_rounds=0)
    groups, stats, _ = collect_groups(ConstructedRollout(), source, cfg0, position=8)
    assert [g[0].info["task_id"] for g in groups] == ["t8", "t9"] and stats["ds_kept_groups"] == 0
    assert stats["ds_filtered_groups"] == 0  # (the groups it trains are not filtered out: counted so, they were 2)
    assert batch_from_groups(groups, "grpo")[0]["advantages"].abs().sum() == 0
    # switched off: the first draw, whatever its variance, and no ds_ statistics
    groups, stats, nxt = collect_groups(ConstructedRollout(), source, LoopConfig(prompts_per_step=3, group_size=2), 0)
    assert len(groups) == 3 and stats == {} and nxt == 3
    # none kept: the step trains its first draw; the later rounds' groups are the untrained ones
    cfg1 = LoopConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True, dynamic_sampling_rounds=1)
    groups, stats, _ = collect_groups(ConstructedRollout(), pool([ones, zeros, ones, ones]), cfg1, 0)
    assert [g[0].info["task_id"] for g in groups] == ["t0", "t1"]
    assert [g[0].info["task_id"] for g in stats["_untrained"]] == ["t2", "t3"]
    assert stats["ds_filtered_groups"] == 2  # those two: trained and untrained add up to what rolled out
    # a finite positional source that runs out: an error naming it (sync steps trained fewer groups,
    # then recorded steps of nothing; the async loop raised 'pop from empty list')
    finite = types.SimpleNamespace(take=lambda position, n: pool([mixed] * 5).tasks[position: position + n])
    with pytest.raises(ValueError, match=r"take\(3, 3\) gave 2 task\(s\): take\(position, n\) must return n tasks"):
        collect_groups(ConstructedRollout(), finite, LoopConfig(prompts_per_step=3, group_size=2), 3)
    assert math.isnan(reward_statistics([])["reward_mean"])  # (no episode measured nothing: it read 0.0)
    # no episode finished (every one failed): the sampled mean measured nothing, NaN as reward_mean
    # (it read 0.0, a reward nobody earned, plotted beside reward_mean's gap)
    failing = types.SimpleNamespace(run_groups=lambda tasks, group_size, progress=False, stop=None: [
        [episode(0.0, error="timed out", task=t.id) for _ in range(group_size)] for t in tasks])
    _, stats, _ = collect_groups(failing, source, LoopConfig(prompts_per_step=2, group_size=2, dynamic_sampling=True,
                                                             dynamic_sampling_rounds=0, on_failed="zero"), 0)
    assert math.isnan(stats["ds_reward_mean_sampled"])



class FakeStream:
    """What _async_batch reads of a GroupStream: finished groups in order, replacements asked."""
    unstarted, _lock = 9, threading.Lock()

    def __init__(self, groups):
        self.items, self.allowed = [(g, i, 0.0, 1.0, None) for i, g in enumerate(groups)], 0

    def take(self):
        return self.items.pop(0) if self.items else None

    def allow(self, replace=0):
        self.allowed += replace

    def data_next(self):
        return self.unstarted


def test_groups_filtered_or_stale_count_with_their_step(tmp_path):
    """Dynamic sampling filters a group whose episodes all failed (zero variance under
    on_failed="drop") and one all right whose record is broken (identity_mismatch): every count
    was taken over the trained groups, so an agent crashing on a third of the tasks logged no
    failure and the audit read the step clean, and the trajectories were lost. They count with
    the step now (failure_reasons, untrained_failed_episodes, identity_mismatch), go to
    untrained/ in a session, and the audit reads them there; the async gate's stale groups too."""
    from workbench.loop import _async_batch, _train_on
    from workbench.tokens import write_trajectories
    from workbench.widgets.audit import Thresholds, audit_html, step_values

    class Trainer:  # (its step's own statistics are not what this checks: stopped there, the record is written)
        version = 3

        def train_step(self, batch):
            raise KeyboardInterrupt

    crashed = [episode(0.0, error="ValueError: the agent crashed", task="t0") for _ in range(2)]
    right = [episode(1.0, task="t2") for _ in range(2)]
    right[0].segments[0].stats["identity_mismatch"] = 3  # a broken record in a group the filter drops
    tasks = {"t0": crashed, "t1": [episode(0.0, task="t1"), episode(1.0, task="t1")], "t2": right}
    rollout = types.SimpleNamespace(run_groups=lambda ts, n, progress=False, stop=None: [tasks[t.id] for t in ts])
    source = TaskDataset([Task([{"role": "user", "content": i}], id=i) for i in tasks], shuffle=False)
    cfg = LoopConfig(prompts_per_step=3, group_size=2, dynamic_sampling=True, dynamic_sampling_rounds=0)
    groups, stats, _ = collect_groups(rollout, source, cfg, 0)
    untrained = stats.pop("_untrained")
    assert groups == [tasks["t1"]] and untrained == [crashed, right]
    m, _ = _train_on(Trainer(), [], groups, cfg, 0, 0.0, 1.0, untrained=untrained)
    m = {**m, **stats}
    assert m["failed_episodes"] == 0 and m["untrained_failed_episodes"] == 2 and m["untrained_episodes"] == 4
    assert m["failure_reasons"] == {"ValueError: the agent crashed": 2} and m["identity_mismatch"] == 3
    without, _ = _train_on(Trainer(), [], groups, cfg, 0, 0.0, 1.0)  # (what was logged before)
    assert without["identity_mismatch"] == 0 and without["failure_reasons"] == {}
    # the audit: from the step's line alone, and from the run directory's files (untrained/ read)
    assert step_values(m, [])[0]["failed_rate"] == 2 / 6 and step_values(m, [])[0]["identity_mismatch"] == 3
    # truncations likewise: counted on both sides of the rate (the denominator alone diluted it)
    assert step_values({**m, "truncated_episodes": 1, "untrained_truncated_episodes": 2}, [])[0]["truncated_rate"] == 3 / 6
    run = tmp_path / "run"
    write_trajectories(groups[0], run / "trajectories" / "step_00000.parquet")
    write_trajectories([t for g in untrained for t in g], run / "untrained" / "step_00000.parquet")
    (run / "metrics.jsonl").write_text(json.dumps({k: v for k, v in m.items() if not k.startswith("rollout")}) + "\n")
    page = audit_html(run, thresholds=Thresholds(max_staleness=None))
    assert "step 0: <a href='#stat-identity_mismatch'>" in page and "step 0: <a href='#stat-failed_rate'>" in page
    assert page.count("not trained: its group was filtered") == 3  # the offending episodes' views: 2 crashed, 1 broken
    # async: a group too stale for the gate is counted the same way
    old = [episode(0.0, error="TimeoutError", task="t9"), episode(1.0, task="t9")]
    for t in old:
        t.segments[0].versions = [-1, -1, 0, 0, 0]
    fresh = [episode(0.0, task="t8"), episode(1.0, task="t8")]
    for t in fresh:
        t.segments[0].versions = [-1, -1, 5, 5, 5]
    got, _, _, extra, _ = _async_batch(FakeStream([old, fresh]), LoopConfig(prompts_per_step=1, group_size=2, mode="async"),
                                       version=5)
    assert got == [fresh] and extra["_untrained"] == [old] and extra["groups_dropped_stale"] == 1
    # and in what the step rolled out: its first data position (0, the stale group's: it read 1, where a
    # sync step records its draw's start) and the sampled rewards (the stale group's 1.0 was left out)
    assert extra["data_position"] == 0
    flat = [episode(1.0, task="t7"), episode(1.0, task="t7")]
    for t in flat:
        t.segments[0].versions = [-1, -1, 5, 5, 5]
    _, _, _, extra, _ = _async_batch(FakeStream([flat, old, fresh]),
                                     LoopConfig(prompts_per_step=1, group_size=2, mode="async", dynamic_sampling=True),
                                     version=5)
    assert extra["ds_filtered_groups"] == 1 and extra["ds_reward_mean_sampled"] == pytest.approx(4 / 5)  # (the failed one not scored)


def test_groups_an_async_step_took_before_the_rollout_failed_are_kept_as_leftovers():
    """The rollout thread failed (every runner dead) after the step had taken some groups: they were
    referenced nowhere, not recorded with the run's end as a stop's are."""
    from workbench.loop import _async_batch

    class Failing(FakeStream):
        def __init__(self, groups):
            super().__init__(groups)
            self.items.append(RuntimeError("RunnersLost: every rollout runner died"))

    first, second, flat = [episode(0.0), episode(1.0)], [episode(1.0), episode(0.0)], [episode(1.0), episode(1.0)]
    leftover: list = []
    with pytest.raises(RuntimeError, match="the rollout failed: RunnersLost"):
        _async_batch(Failing([first, flat, second]), LoopConfig(prompts_per_step=3, group_size=2, mode="async",
                                                                dynamic_sampling=True), version=0, leftover=leftover)
    assert leftover == [first, second, flat]
    # the audit page's label: taken by no step; the filtered one keeps its own
    assert all(t.info.get("untaken") for t in first + second) and not any(t.info.get("untaken") for t in flat)


def test_async_dynamic_sampling_past_its_budget_trains_what_a_sync_step_trains():
    """Past the filter's budget a sync step trains only the groups it kept (ds_short counts the
    rest); an async step admitted the zero-variance groups to fill its count, and under
    token_mean their tokens diluted the signal 4x against the same groups in sync mode. Now both
    train the kept ones, and a step with none kept trains what it took (every advantage 0)."""
    from workbench.loop import _async_batch

    mixed = lambda: [episode(0.0), episode(1.0)]  # noqa: E731
    flat = lambda: [episode(1.0), episode(1.0)]  # noqa: E731
    cfg = LoopConfig(prompts_per_step=3, group_size=2, dynamic_sampling=True, dynamic_sampling_rounds=0)
    signal = mixed()
    groups, _, _, extra, _ = _async_batch(FakeStream([signal, flat(), flat()]), cfg, version=0)
    assert groups == [signal] and (extra["ds_kept_groups"], extra["ds_short"]) == (1, 2)
    sync_groups, stats, _ = collect_groups(ConstructedRollout(), pool([[0.0, 1.0], [1.0, 1.0], [1.0, 1.0]]), cfg, 0)
    assert len(sync_groups) == 1 and (stats["ds_kept_groups"], stats["ds_short"]) == (1, 2)
    none = [flat(), flat(), flat()]
    groups, _, _, extra, _ = _async_batch(FakeStream(none), cfg, version=0)
    assert groups == none and extra["ds_kept_groups"] == 0


def test_async_admission_judges_the_episodes_the_batch_trains_on():
    """A group of episodes sampled at version 5 and one timed-out episode holding tokens of
    versions 3-5 (a failed episode keeps its segments; on_failed='drop' removes it from the
    batch). At version 5 with async_lag 1 the group is admitted: it rejected the whole group, so
    the long, hard prompts where timeouts cluster were filtered out of training. With
    on_failed='zero' the old episode is trained on, and the group is refused."""
    from workbench.loop import _async_batch

    def at(*versions, error=None):
        t = episode(1.0 if error is None else 0.0, len(versions), error=error)
        t.segments[0].versions = [-1, -1, *versions]
        return t

    Stream = FakeStream
    group = [at(5, 5), at(5, 5), at(3, 4, 5, error="episode timed out")]
    taken = _async_batch(Stream([group]), LoopConfig(prompts_per_step=1, group_size=3, async_lag=1), version=5)
    groups, _, _, extra, _ = taken
    assert groups == [group] and extra["groups_dropped_stale"] == 0
    assert extra["groups_per_version"] == {5: 1} and extra["episodes_spanning_versions"] == 0
    stream = Stream([group])
    cfg = LoopConfig(prompts_per_step=1, group_size=3, async_lag=1, on_failed="zero")
    assert _async_batch(stream, cfg, version=5) is None and stream.allowed == 1  # refused, one replacement asked
    # masked: its reward in the group's statistics, none of its (old) tokens trained: admitted
    masked = _async_batch(Stream([group]), LoopConfig(prompts_per_step=1, group_size=3, async_lag=1, on_failed="mask"),
                          version=5)
    assert masked[0] == [group] and masked[3]["groups_per_version"] == {5: 1}


def test_a_step_whose_sync_failed_is_recorded_before_the_error():
    """The step trained, then its weight sync failed: it is recorded (history, metrics, the
    callback that advances wb.next_step) before the error is raised, and not evaluated on engines
    that did not take its weights. It was not recorded, so the next wb.run() trained the same
    step again on the same tasks, over weights that already held its update."""

    from workbench.loop import _after_step
    from workbench.rollout.engine import WeightSyncError

    history, seen, evaluated = [], [], []
    error = WeightSyncError("the engine's probe differs")
    cfg = LoopConfig(eval_every=1)
    with pytest.raises(WeightSyncError):
        _after_step(None, cfg, 3, {"step": 3, "sync_error": str(error), "data_next": 8}, history,
                    lambda step: evaluated.append(step) or {}, seen.append, None, 0, threading.Event(), error)
    assert [m["step"] for m in history] == [m["step"] for m in seen] == [3] and evaluated == []


def test_a_step_whose_evaluation_failed_is_recorded_before_the_error():
    """The step trained and synced, then its evaluation raised (a greedy rollout that failed to
    start, an agent's error): it is recorded, with the error, before the error is raised. It
    left the function before the record, so wb.next_step stayed and the next wb.run() trained
    the step again over weights that held its update."""

    from workbench.loop import _after_step

    def evaluate(step):
        raise ValueError("the greedy rollout failed")

    history, seen = [], []
    with pytest.raises(ValueError, match="greedy rollout failed"):
        _after_step(None, LoopConfig(eval_every=1), 3, {"step": 3, "data_next": 8}, history, evaluate, seen.append,
                    None, 0, threading.Event())
    assert [m["step"] for m in history] == [m["step"] for m in seen] == [3]
    assert seen[0]["eval_error"] == "ValueError: the greedy rollout failed"


def test_a_ctrl_c_after_the_update_began_records_the_step_before_it_stops_the_run(monkeypatch):
    """Ctrl-C while the ranks update, sync or the step is evaluated: the ranks finish the update,
    but the step was not recorded (only an Exception was caught), so the next wb.run() trained it
    again over weights that held its update; and in the trainer the version stayed behind, so
    the next sync was skipped and the engines served old weights labelled as new."""
    from workbench.loop import _after_step, _train_on

    groups = [[episode(1.0, task="a"), episode(0.0, task="a")]]

    class Interrupted:
        version = 5

        def train_step(self, batch):
            self.version += 1  # (Trainer.train_step moves its version whatever ray.get does)
            raise KeyboardInterrupt

    m, error = _train_on(Interrupted(), [], groups, LoopConfig(), 7, 0.0, 1.0)
    assert isinstance(error, KeyboardInterrupt) and m["train_interrupted"] == "KeyboardInterrupt" and m["version"] == 6

    class SyncInterrupted:
        version = 5

        def train_step(self, batch):
            self.version += 1
            return {"version": self.version, "loss": 0.0, "grad_norm": 0.0, "correction": {}, "replay": {},
                    "signal_tokens_trained": 3, "updates": 1, "updates_skipped": 0}

        nccl, vocab_size = None, 64

        def weights_and_probe(self, *a, **k):
            raise KeyboardInterrupt

    import workbench.loop as loop_mod

    monkeypatch.setattr(loop_mod, "step_statistics", lambda stats: {})  # (the fake's stats hold none)
    m, error = _train_on(SyncInterrupted(), [object()], groups, LoopConfig(), 7, 0.0, 1.0)
    assert isinstance(error, KeyboardInterrupt) and m["sync_error"] == "KeyboardInterrupt: "
    for interrupted_at in ("sync", "evaluate"):
        history, seen = [], []

        def evaluate(step):
            raise KeyboardInterrupt

        with pytest.raises(KeyboardInterrupt):
            _after_step(None, LoopConfig(eval_every=1), 7, {"step": 7, "data_next": 8}, history, evaluate, seen.append,
                        None, 0, threading.Event(), error if interrupted_at == "sync" else None)
        assert [m["step"] for m in seen] == [7], interrupted_at


def test_a_step_whose_every_update_was_skipped_is_not_synced(monkeypatch):
    """Every update skipped (a zero or non-finite gradient): the weights and the version stayed,
    so the engines, which hold them, are not synced again (a full state-dict transfer and probe
    check of the same weights, under a new number that made every earlier token read stale). The
    step records the version it trained from, which the audit and wb.revisit read."""
    import workbench.loop as loop_mod
    from workbench.loop import _train_on

    groups = [[episode(1.0, task="a"), episode(0.0, task="a")]]
    synced = []
    monkeypatch.setattr(loop_mod, "sync_engines", lambda *a, **k: synced.append(a) or [])
    monkeypatch.setattr(loop_mod, "step_statistics", lambda stats: {})  # (the fake's stats hold none)

    class Trainer:
        version = 5

        def __init__(self, skipped):
            self.skipped = skipped

        def train_step(self, batch):  # as Trainer.train_step: the version moves with the weights only
            trained = self.version
            self.version += self.skipped == 0
            return {"version": self.version, "trained_version": trained, "updates": 1, "updates_skipped": self.skipped}

    m, error = _train_on(Trainer(skipped=1), [object()], groups, LoopConfig(), 7, 0.0, 1.0)
    assert error is None and not synced and (m["version"], m["trained_version"]) == (5, 5)
    m, error = _train_on(Trainer(skipped=0), [object()], groups, LoopConfig(), 7, 0.0, 1.0)
    assert error is None and len(synced) == 1 and (m["version"], m["trained_version"]) == (6, 5)


def test_the_trainers_version_moves_with_an_interrupted_update_only(monkeypatch):
    """Trainer.train_step: a Ctrl-C in ray.get leaves the ranks updating, so the version moves (left
    behind, the next sync was skipped and the engines served old weights under the new label); a
    rank's own error (an OOM before the optimizer step) updated nothing, so it stays."""
    import types

    import workbench.trainer.fsdp as fsdp

    trainer = object.__new__(fsdp.Trainer)
    trainer.cfg = types.SimpleNamespace(updates_per_step=1, measure_live_routing=0)
    trainer.version, trainer.steps_done = 5, 0
    trainer.workers = [types.SimpleNamespace(train_step=types.SimpleNamespace(remote=lambda *a: "ref"))]
    monkeypatch.setattr(trainer, "_split", lambda batch, updates: ([batch], None), raising=False)
    for error, version in ((KeyboardInterrupt(), 6), (RuntimeError("CUDA out of memory"), 6)):
        def get(refs, error=error):
            raise error

        monkeypatch.setattr(fsdp.ray, "get", get)
        # (every rank raised: the group stays in step, the error is the caller's)
        monkeypatch.setattr(fsdp.ray, "wait", lambda refs, num_returns, timeout: (list(refs), []))
        with pytest.raises(type(error)):
            trainer.train_step({})
        assert trainer.version == version, error


def test_async_continues_a_callable_source_from_its_data_position():
    """A callable source (the agent's tasks(n, seed)) is drawn by the continuous async loop a
    chunk of prompts_per_step at a time, seeded per chunk. A run continued from a data position
    (data_next: the next task not started, mid-chunk) goes on in that chunk; seeded by the step,
    it drew again tasks an earlier run had trained."""

    from workbench.loop import GroupStream

    class Full:  # every runner full (the stream is stopped before its producer starts any)
        def submit_group(self, task, n):
            return None

    def source(n, seed):
        return [Task([{"role": "user", "content": f"{seed}-{i}"}], id=f"{seed}-{i}") for i in range(n)]

    stop = threading.Event()
    stop.set()
    cfg = LoopConfig(steps=10, prompts_per_step=4, group_size=2, mode="async")
    stream = GroupStream(Full(), source, cfg, first=2, position=9, stop=stop)
    stream.thread.join()
    got = [stream._next_task() for _ in range(5)]  # the rest of the chunk seeded 8, then the one seeded 12
    assert [(t.id, at) for t, at in got] == [("8-1", 9), ("8-2", 10), ("8-3", 11), ("12-0", 12), ("12-1", 13)]
    fresh = GroupStream(Full(), source, cfg, first=2, position=8, stop=stop)  # a new run from step 2
    fresh.thread.join()
    task, at = fresh._next_task()
    assert (task.id, at) == ("8-0", 8)


def test_async_data_next_is_the_first_task_not_started(ray_local):
    """data_next (where a continued run starts) moves past a task once it has started, under the
    stream's lock: it was read from the queue, where a task taken but not yet started (or put
    back: every runner full) was missing."""

    from workbench.loop import GroupStream

    class OneSlot:  # one group starts; then every runner is full
        def __init__(self):
            self.started = []

        def submit_group(self, task, n):
            if self.started:
                return None
            self.started.append(task.id)
            return ray.put(1), "runner"

        def finish_group(self, ref, runner, task, n):
            return [task]

        def abandon_groups(self, started, n):
            self.abandoned = [ref for ref, _ in started]

    def source(n, seed):
        return [Task([{"role": "user", "content": f"{seed}-{i}"}], id=f"{seed}-{i}") for i in range(n)]

    stop, rollout = threading.Event(), OneSlot()
    stream = GroupStream(rollout, source, LoopConfig(steps=10, prompts_per_step=4, group_size=2, mode="async"),
                         2, 9, stop)
    try:
        group, at, *_ = stream.take()
        assert rollout.started == ["8-1"] and at == 9 and group[0].id == "8-1"
        with stream._lock:
            assert stream.unstarted == 10  # the next task, 8-2 at 10, never started (put back, taken again, ...)
    finally:
        stop.set()
        stream.thread.join()
    # two started, one taken: a run continued now starts at the second (in flight, not trained): the
    # first task not started skipped it (up to prompts_per_step x async_lag tasks at every stop)
    class TwoSlots(OneSlot):
        def submit_group(self, task, n):
            if len(self.started) == 2:
                return None
            self.started.append(task.id)
            return ray.put(len(self.started)), "runner"

    stop, rollout = threading.Event(), TwoSlots()
    stream = GroupStream(rollout, source, LoopConfig(steps=10, prompts_per_step=4, group_size=2, mode="async"),
                         2, 9, stop)
    try:
        group, at, *_ = stream.take()
        deadline = time.time() + 10
        while len(rollout.started) < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert rollout.started == ["8-1", "8-2"] and at == 9 and stream.data_next() == 10 and stream.unstarted == 11
        stream.take()
        assert stream.data_next() == 11
    finally:
        stop.set()
        stream.thread.join()

def test_a_stopped_async_stream_leaves_its_groups_in_flight_unwaited(ray_local):
    """A stop (wb.stop(), an error) waited for every group in flight, up to the episode timeout
    (300 s by default), only to throw them away: they are handed to the rollout as abandoned,
    which gives their runners' slots back when they finish."""
    from workbench.loop import GroupStream

    @ray.remote(num_cpus=0)
    def slow_group():
        time.sleep(30)

    class Hanging:
        abandoned: list = []
        submitted = 0

        def submit_group(self, task, n):
            self.submitted += 1
            return slow_group.remote(), "runner"  # (the stream starts prompts_per_step x (1 + async_lag): 2)

        def finish_group(self, ref, runner, task, n):
            return ray.get(ref)

        def abandon_groups(self, started, n):
            self.abandoned = [ref for ref, _ in started]

    def source(n, seed):
        return [Task([{"role": "user", "content": f"{seed}-{i}"}], id=f"{seed}-{i}") for i in range(n)]

    stop, rollout = threading.Event(), Hanging()
    stream = GroupStream(rollout, source, LoopConfig(steps=10, prompts_per_step=1, group_size=2, mode="async"), 0, 0, stop)
    deadline = time.time() + 20
    while rollout.submitted < 2 and time.time() < deadline:
        time.sleep(0.05)
    t0 = time.time()
    stop.set()
    stream.thread.join(10)
    assert not stream.thread.is_alive() and time.time() - t0 < 5 and len(rollout.abandoned) == 2
    for ref in rollout.abandoned:
        ray.cancel(ref, force=True)


def test_zero_variance_follows_the_episode_rules():
    group = [episode(1.0), episode(0.0, error="boom")]
    assert zero_variance(group)  # the failed episode is dropped (on_failed="drop"): one reward left
    assert not zero_variance(group, on_failed="zero") and zero_variance([episode(0.5), episode(0.5)])
    # the only reward off the mean is a kept episode's without a token to train (a runner that died
    # before its first turn), the other masked (a run-on): no row carries an advantage. It read as signal
    truncated, died = episode(1.0), episode(0.5, error="runner died")
    truncated.truncated, died.segments = True, []
    assert zero_variance([truncated, died], on_failed="keep", on_truncated="mask")
    assert not zero_variance([episode(1.0), died], on_failed="keep")  # (the trainable one's advantage is +0.25)


def test_plain_callable_sources_are_one_stream_of_chunks():
    """A plain source(n, seed) is one stream of prompts_per_step-task chunks (chunk k seeded k):
    any window of positions draws the same tasks, however the draws cut it. Sync steps were seeded
    by the step and refills by a range of their own, while the async loop drew by position: a
    sync run after an async one (dynamic sampling put its positions ahead of its steps) drew
    again tasks the async steps had trained."""

    from workbench.loop import GroupStream, draw_tasks

    seen = []

    def source(n, seed):
        seen.append((n, seed))
        return [Task([{"role": "user", "content": "x"}], label=[1.0, 1.0], id=f"{seed}-{i}") for i in range(n)]

    drawn, nxt = draw_tasks(source, 12, 0, 4)
    whole = [t.id for _, t in drawn]
    assert whole == [f"{s}-{i}" for s in (0, 4, 8) for i in range(4)] and [p for p, _ in drawn] == list(range(12))
    for position, n in [(0, 4), (5, 3), (9, 2), (3, 6)]:
        drawn, nxt = draw_tasks(source, n, position, 4)
        assert [t.id for _, t in drawn] == whole[position:position + n] and nxt == position + n
    # a sync step at position 10 (an async run's data_next, say: past step 2's chunk) and its refill
    seen.clear()
    cfg = LoopConfig(prompts_per_step=4, group_size=2, dynamic_sampling=True, dynamic_sampling_rounds=1)
    groups, _, nxt = collect_groups(ConstructedRollout(), source, cfg, position=10)
    assert [g[0].info["task_id"] for g in groups] == ["8-2", "8-3", "12-0", "12-1"]  # every group flat: the first draw
    assert nxt == 18 and seen == [(4, 8), (4, 12), (4, 12), (4, 16)]  # the refill took positions 14-17
    # the async loop goes on from there
    stop = threading.Event()
    stop.set()
    stream = GroupStream(None, source, LoopConfig(steps=10, prompts_per_step=4, group_size=2, mode="async"), 2, nxt, stop)
    stream.thread.join()
    assert stream._next_task()[0].id == "16-2"
    # another chunk size later (prompts_per_step 4 -> 8 from position 8): no seed drawn again
    seen.clear()
    draw_tasks(source, 8, 8, 8)
    assert seen == [(8, 8)]
    # a source that gives fewer than asked: the missing positions hold no task, the draw goes on
    def short(n, seed):
        return source(n - 1, seed)

    drawn, nxt = draw_tasks(short, 5, 1, 4)
    assert [(p, t.id) for p, t in drawn] == [(1, "0-1"), (2, "0-2"), (4, "4-0"), (5, "4-1"), (6, "4-2")] and nxt == 8
    with pytest.raises(ValueError, match="gave no task"):
        draw_tasks(lambda n, seed: [], 2, 0, 4)


# ----------------------------------------------------------------------------- evaluation
def test_pass_at_k_is_the_unbiased_estimator():
    for n, c in itertools.product(range(1, 7), range(0, 7)):
        if c > n:
            continue
        for k in range(1, n + 1):
            # the chance that a k-subset of the n samples holds a correct one, by enumeration
            subsets = list(itertools.combinations([1] * c + [0] * (n - c), k))
            assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 1, 2) == 0.5 and pass_at_k(4, 0, 4) == 0
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6] and default_ks(1) == [1]
    # two tasks: 1 of 4 correct and 3 of 4 correct (info["correct"] wins over the reward)
    groups = [[episode(1.0), episode(0.0), episode(0.0), episode(0.0)], [episode(0.2)] * 3 + [episode(0.0)]]
    for t in groups[1][:3]:
        t.info = {"correct": True}
    m = summarize(groups)
    assert m["eval_pass@1"] == pytest.approx((0.25 + 0.75) / 2) and m["eval_pass@2"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["eval_pass@4"] == 1.0 and m["eval_tasks"] == 2 and m["eval_n"] == 4
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= n = 4 samples per task; got k = \[8\]"):
        summarize(groups, ks=[8])
    # checked before any episode runs (after them, the evaluation was lost): no rollout is touched
    from workbench.evaluation import evaluate

    with pytest.raises(ValueError, match=r"got k = \[0\]"):
        evaluate(None, [object()], n=4, ks=[1, 0])
    for bad in ("1", None, float("nan"), True):  # text failed after every episode had run; NaN scored all wrong
        with pytest.raises(ValueError, match=r"success_reward is the reward an episode must reach"):
            evaluate(None, [object()], n=4, success_reward=bad)
    # a reward nobody earned is no measured 0: every episode failed, the mean is None
    failed = [[episode(0.0, error="boom"), episode(0.0, error="boom")]]
    assert summarize(failed)["eval_reward_mean"] is None and summarize(failed)["eval_failed"] == 2


def test_a_failed_episode_counts_as_a_wrong_answer_in_the_steps_correct_rate():
    """1 right answer and 3 timed-out episodes: correct_rate read 1.0 (a run timing out more and
    more looked like one answering better); evaluation already counted failures as wrong."""
    from workbench.loop import reward_statistics

    right = episode(1.0)
    right.info["correct"] = True
    stats = reward_statistics([[right] + [episode(0.0, error="episode timed out") for _ in range(3)]])
    assert stats == {"reward_mean": 1.0, "correct_rate": 0.25}
    assert reward_statistics([[episode(0.5)]]) == {"reward_mean": 0.5, "correct_rate": None}  # no agent reports it
    # a finished episode without the key (an Env episode cut by max_turns or the context never reached the
    # step that sets it) is wrong, as evaluation scores it: left out, 1 right and 3 cut read 1.0; scored
    # by its reward, a shaped reward summed over its looping turns (2.0) read correct, the answers wrong
    cut = [episode(0.0) for _ in range(3)]
    assert reward_statistics([[right] + cut]) == {"reward_mean": 0.25, "correct_rate": 0.25}
    wrong = [episode(0.5) for _ in range(3)]
    for t in wrong:
        t.info["correct"] = False
    assert reward_statistics([wrong + [episode(2.0)]])["correct_rate"] == 0.0
    from workbench.evaluation import summarize

    assert summarize([wrong + [episode(2.0)]])["eval_pass@4"] == 0.0  # (it read 1.0: pass@1 0.25)
    assert summarize([[episode(2.0), episode(0.0)]])["eval_pass@1"] == 0.5  # none reports it: the reward decides
    looped = episode(2.0)
    looped.truncated = True  # ... but an episode cut short (a greedy evaluation looping on every task) answered nothing
    assert summarize([[looped, looped]])["eval_pass@1"] == 0.0
    # nothing finished: nothing measured (reward_mean read 0.0, correct_rate None and the notebooks' sums raised)
    nothing = reward_statistics([[episode(0.0, error="episode timed out") for _ in range(4)]])
    assert math.isnan(nothing["reward_mean"]) and math.isnan(nothing["correct_rate"])
    assert math.isnan(sum([0.5, nothing["correct_rate"]]))  # a sum over the history does not raise
    # a step of two tasks, one whose agent reports it (right, wrong) and one graded by its reward (1, 1):
    # decided per group as evaluation decides it per task, 3 of 4 right (the reward-graded ones read
    # wrong beside the other task's reports: 0.25, where pass@1 said 0.75)
    two = [[right, wrong[0]], [episode(1.0), episode(1.0)]]
    assert reward_statistics(two)["correct_rate"] == 0.75 == summarize(two)["eval_pass@1"]
    # tasks with different sample counts: each task's own (cut to the fewest, a task's 2 right of 4,
    # written last, were thrown away: pass@1 0.5 where it is (0.5 + 1) / 2)
    ok = [episode(1.0) for _ in range(4)]
    for t in ok:
        t.info["correct"] = True
    uneven = [[wrong[0], wrong[1], ok[0], ok[1]], [ok[2], ok[3]]]
    m = summarize(uneven)
    assert m["eval_pass@1"] == 0.75 and m["eval_n"] == 2 and m["eval_pass@2"] == pytest.approx((5 / 6 + 1) / 2)


def test_evaluation_episodes_never_enter_a_training_batch():
    groups = [[episode(1.0), episode(0.0, eval=True)]]
    with pytest.raises(ValueError, match="is an evaluation episode .* never enter a training batch"):
        batch_from_groups(groups, "grpo")
    with pytest.raises(ValueError, match="evaluation episode"):
        zero_variance(groups[0])


# ----------------------------------------------------------------------------- tracking
def test_tensorboard_event_file_reads_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from workbench.tracking import TensorBoardLogger, make_loggers, scalars

    assert scalars({"step": 3, "loss": 0.5, "ok": True, "mode": "sync", "x": None, "h": {"0": 2, "1": 1}, "l": [1]}) == \
        {"step": 3.0, "loss": 0.5, "ok": 1.0, "h/0": 2.0, "h/1": 1.0}
    # dicts keyed by what changes every step (a policy version, an error's text) made a new metric
    # each step: 10,000 tags after 10,000 steps. Left to metrics.jsonl
    assert scalars({"tokens_per_version": {"7": 40}, "groups_per_version": {"7": 2},
                    "failure_reasons": {"RuntimeError: pid 4121": 1}, "staleness_hist": {"0": 40}}) == {"staleness_hist/0": 40.0}
    tb = TensorBoardLogger(tmp_path / "tensorboard")
    for step, loss in enumerate([0.9, 0.7, 0.4]):
        tb.on_step({"step": step, "loss": loss, "eval_pass@1": 0.1 * step, "staleness_hist": {"0": 8}})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert {"loss", "eval_pass@1", "staleness_hist/0"} <= set(acc.Tags()["scalars"])
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("loss")] == [(0, 0.9), (1, 0.7), (2, 0.4)]
    # a run resumed (or restored) at step 1 trains steps 1 and 2 again: the abandoned ones are hidden
    # (TensorBoard showed both branches, one over the other)
    tb = make_loggers(["tensorboard"], tmp_path, next_step=1)[0]
    tb.on_step({"step": 1, "loss": 0.5})
    tb.purge_from(1)  # (an in-session wb.restore() to step 1 after it)
    tb.on_step({"step": 1, "loss": 0.6})
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("loss")] == [(0, 0.9), (1, 0.6)]
    with pytest.raises(ValueError, match="unknown logger 'mlflow'"):
        make_loggers(["mlflow"], tmp_path)


def test_wandb_offline_run_is_written(tmp_path, monkeypatch):
    from workbench.tracking import WandbLogger

    monkeypatch.setenv("WANDB_API_KEY", "")  # no account: offline needs none
    w = WandbLogger(tmp_path, {"lr": 1e-3}, name="t")
    w.log({"step": -1, "eval_pass@1": 0.125}, -1)  # wb.eval() before the first step
    w.on_step({"step": 0, "reward_mean": 0.25})
    w.on_step({"step": 1, "reward_mean": 0.5})
    w.on_step({"step": 1, "reward_mean": 0.75})  # step 1 again, after a wb.restore()
    w.close()
    [run] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    data = run.read_bytes()
    assert b"reward_mean" in data and b"0.5" in data  # the history records, as `wandb sync` would upload them
    # W&B keeps only increasing steps of its own: the evaluation at step -1 and the re-run step were dropped
    assert b"eval_pass@1" in data and b"0.125" in data and b"0.75" in data and b"rl_step" in data
    # closing a logger leaves the process's other W&B runs alive (its teardown of the wandb service
    # broke the user's own run at its next log, and another session's logger)
    import wandb

    user = wandb.init(mode="offline", dir=str(tmp_path / "user"), project="mine", settings=wandb.Settings(silent=True))
    a, b = WandbLogger(tmp_path / "a", name="a"), WandbLogger(tmp_path / "b", name="b")
    a.on_step({"step": 0, "reward_mean": 0.25})
    a.close()
    b.on_step({"step": 0, "reward_mean": 0.5})
    user.log({"mine": 1.0})
    b.close()
    user.log({"mine": 2.0})
    user.finish()
    wandb.teardown()


def test_a_resumed_session_writes_the_same_wandb_run(tmp_path, monkeypatch):
    """Each session of one run directory made a W&B run of its own: after `wandb sync` a resumed
    run's later steps were a second run. The run directory keeps the id; a resume continues it."""
    from workbench.tracking import make_loggers

    monkeypatch.setenv("WANDB_API_KEY", "")
    ids = []
    for steps in ((0, 1), (2, 3)):  # the first session, then the resumed one
        [w] = make_loggers(["wandb"], tmp_path, {"lr": 1e-3}, next_step=steps[0])
        for s in steps:
            w.on_step({"step": s, "reward_mean": 0.1 * s})
        ids.append(w.run.id)
        w.close()
    assert ids[0] == ids[1] == (tmp_path / "wandb" / "workbench_run_id").read_text().strip()
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.split("-")[3] == ids[0] for r in runs)  # one run, written twice
    # W&B keeps an abandoned branch's steps: each step logs its branch, a new one wherever a step already
    # logged is trained again (a wb.restore(), a resume from an earlier checkpoint), kept across sessions
    assert ids and w.branch == 0  # (sessions 1 and 2 went on from each other's last step)
    [w] = make_loggers(["wandb"], tmp_path, {"lr": 1e-3}, next_step=2)  # a resume re-running steps 2 and 3
    assert w.branch == 1
    w.purge_from(5)  # a restore to a step not logged yet: the same branch
    assert w.branch == 1
    w.on_step({"step": 2, "reward_mean": 0.5})
    w.purge_from(1)  # a wb.restore() to step 1
    w.on_step({"step": 1, "reward_mean": 0.5})
    w.close()
    assert w.branch == 2 and any(b"branch" in r.read_bytes() for r in (tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    [w] = make_loggers(["wandb"], tmp_path, {"lr": 1e-3}, next_step=2)  # the next session, from step 2
    assert w.branch == 2
    # the branch file is replaced whole: a write cut part-way (a kill) left the previous one, not an
    # empty file read as a fresh run's (branch 0, last step -1: no new branch for steps trained again)
    kept = (tmp_path / "wandb" / "workbench_branch.json").read_text()
    import os

    def cut(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", cut)
    with pytest.raises(KeyboardInterrupt):
        w.purge_from(1)
    monkeypatch.undo()
    w.close()
    assert (tmp_path / "wandb" / "workbench_branch.json").read_text() == kept


def test_a_config_files_numbers_are_numbers(monkeypatch):
    """PyYAML reads 3e-4 (no dot) as the string '3e-4': a config file's lr was accepted as text, and
    kl_coef failed with "'>' not supported between 'str' and 'int'". Number fields read such strings
    as numbers, and refuse any other string naming the field."""
    import yaml

    from workbench.session import ConfigError, WorkbenchConfig

    d = yaml.safe_load("trainer: {lr: 3e-4, kl_coef: 1e-3}\nloop: {sync_tol: 1e-2, steps: 1e2}")
    assert isinstance(d["trainer"]["lr"], str)  # (what YAML gives)
    c = WorkbenchConfig.from_dict(d)
    assert (c.trainer.lr, c.trainer.kl_coef, c.loop.sync_tol, c.loop.steps) == (3e-4, 1e-3, 1e-2, 100)
    with pytest.raises(ConfigError, match="trainer.lr must be a number, got 'fast'"):
        WorkbenchConfig.from_dict({"trainer": {"lr": "fast"}})
    with pytest.raises(ConfigError, match="loop.steps must be an integer, got '1.5'"):
        WorkbenchConfig.from_dict({"loop": {"steps": "1.5"}})
    # a bool as a bool: the text "false" was a true value (correction stayed on); a count as an
    # integer (8.5 was accepted; True is 1); a dict field as a dict (an empty YAML key's None failed
    # after Ray started, naming nothing)
    assert WorkbenchConfig.from_dict(yaml.safe_load('trainer: {correction: {enabled: "false"}}')).trainer.correction.enabled is False
    assert WorkbenchConfig.from_dict({"loop": {"group_size": 8.0}}).loop.group_size == 8
    for bad, message in (({"trainer": {"correction": {"enabled": "nope"}}}, "trainer.correction.enabled must be true or false"),
                         ({"temperature": True}, "temperature must be a number, got True"),
                         ({"trainer": {"micro_batch_size": 8.5}}, "micro_batch_size must be an integer, got 8.5"),
                         (yaml.safe_load("engine_kwargs:\n"), "engine_kwargs must be dict, got None")):
        with pytest.raises(ConfigError, match=message):
            WorkbenchConfig.from_dict(bad)
    # connect(config=<a WorkbenchConfig>, loop={...}): the dict changes the config's own fields (it was
    # refused with an error saying a dict was fine)
    import workbench.session as session

    monkeypatch.setattr(session, "Workbench", lambda cfg, address=None: cfg)
    from workbench.trainer.fsdp import TrainerConfig

    got = session.connect(config=WorkbenchConfig(trainer=TrainerConfig(lr=3e-4)), loop={"on_truncated": "zero"},
                          trainer={"kl_coef": 0.1})
    assert (got.loop.on_truncated, got.trainer.lr, got.trainer.kl_coef, got.trainer.micro_batch_size) == ("zero", 3e-4, 0.1, 8)
    # the trainer computes log-probs at the session's temperature: one of its own was replaced silently
    with pytest.raises(ConfigError, match="trainer.temperature=0.7 differs from temperature=1.0"):
        WorkbenchConfig.from_dict({"trainer": {"temperature": 0.7}})
    assert WorkbenchConfig.from_dict({"temperature": 0.7, "trainer": {"temperature": 0.7}}).temperature == 0.7


def test_config_refuses_unknown_loggers():
    from workbench.session import ConfigError, WorkbenchConfig

    with pytest.raises(ConfigError, match=r"loggers: 'neptune' unknown; known: \('tensorboard', 'wandb'\)"):
        WorkbenchConfig(loggers=["neptune"])
    with pytest.raises(ConfigError, match="LoopConfig.eval_n must be >= 1, got 0"):
        WorkbenchConfig.from_dict({"loop": {"eval_n": 0}})


# ----------------------------------------------------------------------------- on a live session
def test_greedy_evaluation_of_a_strict_session_runs_greedy(ray_local, tmp_path):
    """sampling="strict" refuses a recorded turn whose sent temperature is not the policy's. An
    agent that sends the training temperature is legal in training; the greedy evaluation's
    runners (policy temperature 0) refused every one of its turns, and every greedy episode failed
    and read as wrong (eval_greedy_pass@1 0, the failures in no metric). They override instead."""
    import workbench
    from workbench.examples.arithmetic_env import tasks as arithmetic_tasks

    agent = tmp_path / "sends_temperature.py"
    agent.write_text(
        "from workbench.agents import ChatAgent\n"
        "from workbench.examples.arithmetic_env import tasks  # noqa: F401\n\n\n"
        "class AgentRunner(ChatAgent):\n"
        "    async def run(self, ctx):\n"
        "        r = await ctx.openai().chat.completions.create(model=ctx.model, messages=list(ctx.messages),\n"
        "                                                       max_tokens=8, temperature=1.0)\n"
        "        return float((r.choices[0].message.content or '').strip() == str(ctx.label))\n")
    wb = workbench.connect(backend="reference", trainer_ranks=1, run_dir=str(tmp_path / "run"), agent=str(agent),
                           sampling="strict", eval_tasks=arithmetic_tasks(2, seed=99))
    try:
        m = wb.eval(n=1)
        assert m["eval_failed"] == 0 and m["eval_greedy_failed"] == 0, m
        assert m["eval_greedy_reward_mean"] is not None and m["eval_reward_mean"] is not None
    finally:
        wb.shutdown()


def test_session_eval_data_position_and_loggers(ray_local, dense_path, tmp_path, monkeypatch):
    """The toy model on the reference backend: wb.eval (sampled and greedy), eval_every in the
    run, dynamic sampling and overlong shaping switched on, the data position recorded per step
    and in the checkpoint (a restored run draws from there), the TensorBoard record, and no
    evaluation episode in any training batch; then one on-policy distillation step (student: the
    tiny MoE, teacher: the tiny dense model on its own reference engine) whose distill_reverse_kl
    equals the reverse KL recomputed from the recorded student tokens and the teacher checkpoint."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import workbench
    from workbench.examples.arithmetic_env import tasks as arithmetic_tasks
    from workbench.loop import engines_version
    from workbench.rollout.engine import expected_probe_logprobs
    from workbench.session import ConfigError
    from workbench.tokens import read_trajectories
    from workbench.toy.models import load_hf_model

    run_dir = tmp_path / "run"
    train = TaskDataset(arithmetic_tasks(24, seed=0), seed=3)
    wb = workbench.connect(backend="reference", trainer_ranks=1, run_dir=str(run_dir), tasks=train,
                           eval_tasks=arithmetic_tasks(3, seed=99), loggers=["tensorboard"],
                           loop={"prompts_per_step": 2, "group_size": 4, "eval_every": 1, "eval_n": 4,
                                 "dynamic_sampling": True, "dynamic_sampling_rounds": 1,
                                 "overlong_shaping": True, "overlong_max_tokens": 8, "overlong_band": 4})
    try:
        with pytest.raises(ConfigError, match="wb.eval: n is the samples a task, an integer >= 1, got 0"):
            wb.eval(n=0)  # (it ran loop.eval_n unsaid)
        # wb.run's loop settings are read and checked as connect()'s: text as its number, a bad value named
        with pytest.raises(ConfigError, match="wb.run: LoopConfig.group_size 1: advantage 'grpo'"):
            wb.run(1, group_size="1")
        before = wb.eval(n=2)
        assert before["step"] == -1 and before["eval_tasks"] == 3 and before["eval_n"] == 2
        assert 0 <= before["eval_pass@1"] <= before["eval_pass@2"] <= 1 and "eval_greedy_pass@1" in before
        wb._trainer.version += 1  # as after wb.trainer.step() without a wb.sync(): the engines serve an older version
        again = wb.eval(n=2)  # synced first (the same weights here): greedy episodes are the same (temperature 0)
        assert again["version"] == wb._trainer.version == engines_version(wb.engines, newest=False)
        assert again["eval_greedy_reward_mean"] == before["eval_greedy_reward_mean"]
        # (every 5 steps: a run's last step is checkpointed too, or the restore below went back to nothing)
        [m0] = wb.run(1, background=False, progress=False, checkpoint_every=5).history
        [m1] = wb.run(1, background=False, progress=False).history
        for m in (m0, m1):
            assert 0 <= m["eval_pass@1"] <= m["eval_pass@2"] <= m["eval_pass@4"] <= 1 and m["eval_n"] == 4
            assert {"eval_greedy_pass@1", "ds_filtered_groups", "ds_kept_groups", "overlong_penalized"} <= set(m)
            assert m["max_staleness_gate"] == wb.cfg.trainer.correction.max_staleness  # (the audit's cap for the step)
            # 2 tasks, plus one refill of the filtered ones (at most 2) when any was filtered
            drawn = m["data_next"] - m["data_position"]
            assert 2 <= drawn <= 4 and (drawn == 2) == (m["ds_rounds"] == 0) == (m["ds_filtered_groups"] == 0)
            # the groups filtered out and not trained are kept apart (untrained/), counted with the step
            untrained = run_dir / "untrained" / f"step_{m['step']:05d}.parquet"
            kept = read_trajectories(untrained) if untrained.is_file() else []
            assert len(kept) == m.get("untrained_episodes", 0) and (m["ds_filtered_groups"] == 0) <= (not kept)
            trained_here = {t.episode_id for t in read_trajectories(run_dir / "trajectories" / f"step_{m['step']:05d}.parquet")}
            assert not trained_here & {t.episode_id for t in kept}
        assert m0["data_position"] == 0 and m1["data_position"] == m0["data_next"]
        # the checkpoint (after step 0) recorded the data position; a restored run draws from it
        assert wb.restore()["data_position"] == m0["data_next"] and wb.next_position == m0["data_next"]
        [redo] = wb.run(1, background=False, progress=False).history
        assert redo["step"] == 1 and redo["data_position"] == m0["data_next"]
        # every evaluation's episodes are kept (only their counts were), the abandoned step's set aside
        assert sorted(p.name for p in (run_dir / "eval").iterdir()) == [
            "step_-0001-2.parquet", "step_-0001.parquet", "step_00000.parquet", "step_00001.parquet"]
        evaluated = read_trajectories(run_dir / "eval" / "step_00000.parquet")
        assert len(evaluated) == 3 * 4 + 3 and sum(bool(t.info.get("eval_greedy")) for t in evaluated) == 3  # 3 tasks x 4, greedy x 1
        assert [p.name for p in (run_dir / "abandoned").glob("*/eval/*")] == ["step_00001.parquet"]
        assert len(list((run_dir / "abandoned").glob("*/untrained/step_00001.parquet"))) == (m1.get("untrained_episodes", 0) > 0)
        window = {t.id for t in train.take(redo["data_position"], redo["data_next"] - redo["data_position"])}
        trained = read_trajectories(run_dir / "trajectories" / "step_00001.parquet")
        assert {t.info["task_id"] for t in trained} <= window
        # no evaluation episode in any step's batch (the kept steps and the abandoned one)
        files = list(run_dir.glob("trajectories/*.parquet")) + list(run_dir.glob("abandoned/*/trajectories/*.parquet"))
        assert len(files) == 3
        trained_ids = {t.episode_id for f in files for t in read_trajectories(f)}
        evaluated_ids = {t.episode_id for f in run_dir.glob("**/eval/*.parquet") for t in read_trajectories(f)}
        assert wb.eval_episodes == len(evaluated_ids) == 2 * 3 * (2 + 1) + 3 * 3 * (4 + 1) and not trained_ids & evaluated_ids
        lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in lines] == [0, 1] and lines[1]["eval_pass@1"] == redo["eval_pass@1"]
        assert len((run_dir / "eval.jsonl").read_text().splitlines()) == 2
        # on-policy distillation on the same session: teacher = the tiny dense model (same tokenizer)
        [d] = wb.run(1, background=False, progress=False, advantage="distill", teacher="dense", eval_every=0,
                     dynamic_sampling=False, overlong_shaping=False, keep_policy_every=1).history
        assert wb._teacher[0] == "dense" and len(wb.engines) == 1  # its own engine, not a rollout engine
        # step time travel on a distillation step: the teacher scores the recorded tokens again (it
        # raised: revisit built the batch without the teacher's log-probs)
        rv = wb.revisit(step=d["step"])
        assert rv.differences() == {}, rv.differences()
        # a teacher whose context is shorter than the policy's is refused before it starts (it scores
        # whole segments, up to the policy's context: a longer one failed the rollout)
        wb.cfg.frozen_engine_kwargs = {"max_model_len": 512}
        with pytest.raises(ConfigError, match="shorter than the policy's context.*the teacher reads"):
            wb._frozen_engine("dense", "loop.teacher", 0)
        # ... and so is a judge's (the side route holds its prompts to the policy's context: one the judge's
        # engine then refused failed the episode, dropped, and an answer rambling to the cap escaped its 0)
        with pytest.raises(ConfigError, match="shorter than the policy's context.*the judge reads"):
            wb._frozen_engine("dense", "judge", 0)
        wb.cfg.frozen_engine_kwargs = {}
        # on a GPU cluster a teacher first named in wb.run(teacher=...) is checked on every node before its
        # engine starts, as connect() checks the ones it is given (a node-local cache failed late there).
        # A fake check: this machine has no second node to lack the checkpoint
        import workbench.cluster as cluster_mod

        def lacking(paths):
            raise cluster_mod.SharedPathError(f"node sim1 has no {paths}")

        monkeypatch.setattr(cluster_mod, "check_checkpoints_everywhere", lacking)
        wb.placement, engines_before = object(), len(wb.engines)
        try:
            with pytest.raises(cluster_mod.SharedPathError, match="loop.teacher"):
                wb._frozen_engine("dense", "loop.teacher", 0)
        finally:
            wb.placement = None
        assert len(wb.engines) == engines_before
    finally:
        wb.shutdown()
    # the step's reverse KL, recomputed from the recorded student tokens and the teacher checkpoint's own forward
    teacher = load_hf_model(dense_path)
    diff, tokens = 0.0, 0
    for t in read_trajectories(run_dir / "trajectories" / f"step_{d['step']:05d}.parquet"):
        for seg in t.segments:
            lp = [0.0] + expected_probe_logprobs(teacher, seg.token_ids)
            for i, keep in enumerate(seg.loss_mask):
                if keep:
                    diff, tokens = diff + seg.logprobs[i] - lp[i], tokens + 1
    assert tokens > 0 and d["distill_reverse_kl"] == pytest.approx(diff / tokens, abs=1e-4)
    assert abs(d["distill_reverse_kl"]) > 0.05  # two different models: the teacher's scores are its own
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    # step 1 once: its redo (the abandoned one, logged before wb.restore(), is hidden: it showed both)
    assert [e.step for e in acc.Scalars("eval_pass@4")] == [0, 1]
    assert [e.step for e in acc.Scalars("eval_pass@1")] == [-1, -1, 0, 1]
    assert [e.step for e in acc.Scalars("reward_mean")] == [0, 1, 2]
    assert acc.Scalars("reward_mean")[1].value == pytest.approx(redo["reward_mean"])
    assert acc.Scalars("distill_reverse_kl")[0].value == pytest.approx(d["distill_reverse_kl"])


def test_reward_monitor_plots_evaluation_beside_training_reward():
    from workbench.widgets import RewardMonitor

    history = [{"step": 0, "reward_mean": 0.2}, {"step": 1, "reward_mean": 0.3, "eval_pass@1": 0.5},
               {"step": 2, "reward_mean": 0.4}, {"step": 3, "reward_mean": 0.5, "eval_pass@1": 0.75}]
    m = RewardMonitor(history)
    assert list(m.trace("reward_mean").y) == [0.2, 0.3, 0.4, 0.5]
    evals = m.trace("eval_pass@1")
    assert [y for y in evals.y if y == y and y is not None] == [0.5, 0.75] and evals.connectgaps


# ----------------------------------------------------------------------------- on-policy distillation
def test_distillation_advantage_and_reverse_kl_hand_computed():
    from workbench.loop import check_teacher

    # two episodes; the student sampled 2 and 1 tokens with these log-probs, the teacher scores them
    a, b = episode(1.0, 2), episode(0.0, 1)
    a.segments[0].logprobs = [0.0, 0.0, -0.5, -2.0]
    b.segments[0].logprobs = [0.0, 0.0, -1.0]
    teacher = {id(a.segments[0]): [0.0, -3.0, -1.5, -0.5], id(b.segments[0]): [0.0, -9.0, -1.0]}
    with pytest.raises(ValueError, match="needs per-token teacher log-probs: set LoopConfig.teacher"):
        LoopConfig(advantage="distill")
    with pytest.raises(ValueError, match="turn dynamic_sampling off"):  # it filters by rewards, distill ignores them
        LoopConfig(advantage="distill", teacher="dense", dynamic_sampling=True)
    with pytest.raises(ValueError, match="turn overlong_shaping off"):  # it shapes rewards, distill ignores them
        LoopConfig(advantage="distill", teacher="dense", overlong_shaping=True)
    cfg = LoopConfig(advantage="distill", teacher="dense")
    batch, info = batch_from_groups([[a, b]], cfg.advantage, teacher=teacher)
    # advantage = log p_teacher - log p_student on sampled tokens only (prompt tokens: 0, whatever the teacher says)
    assert batch["advantages"].tolist() == [[0.0, 0.0, -1.0, 1.5], [0.0, 0.0, 0.0, 0.0]]
    # reverse KL estimate: mean over the 3 sampled tokens of log p_student - log p_teacher = (1 - 1.5 + 0) / 3
    assert info["distill_reverse_kl"] == pytest.approx(-0.5 / 3)
    with pytest.raises(ValueError, match="needs the teacher's log-probs of every trainable segment"):
        batch_from_groups([[a, b]], "distill", teacher={id(a.segments[0]): teacher[id(a.segments[0])]})
    with pytest.raises(ValueError, match="needs a teacher engine"):
        check_teacher(None, cfg, None)
    # the student's log-probs must be of its whole unscaled distribution, as the teacher's are: a
    # batch built outside a run (wb.trainer.step / batch) is refused too, by the trainer's
    # temperature or the one a segment was sampled at (the loopback server stamps it)
    with pytest.raises(ValueError, match="at temperature 1; the policy samples at temperature 0.7"):
        batch_from_groups([[a, b]], "distill", teacher=teacher, temperature=0.7)
    a.segments[0].stats["temperatures"] = [0.7]
    with pytest.raises(ValueError, match="samples at temperature 0.7"):
        batch_from_groups([[a, b]], "distill", teacher=teacher)
    a.segments[0].stats["temperatures"] = [1.0]
    assert batch_from_groups([[a, b]], "distill", teacher=teacher, temperature=1.0)[1]["episodes"] == 2
    a.segments[0].stats["top_ps"] = [0.9]  # (stamped by the loopback server beside the temperature)
    with pytest.raises(ValueError, match="top_p=0.9"):
        batch_from_groups([[a, b]], "distill", teacher=teacher, temperature=1.0)
    a.segments[0].stats["top_ps"] = [1.0]
    # top_p < 1: renormalized over the kept tokens, whether or not the importance correction is on
    rollout = types.SimpleNamespace(sampling=SamplingConfig(top_p=0.9))
    with pytest.raises(ValueError, match="top_p=0.9"):
        check_teacher(rollout, cfg, ["a teacher engine"])
    check_teacher(types.SimpleNamespace(sampling=SamplingConfig()), cfg, ["a teacher engine"])
    # the teacher scores the segments the batch trains on: not a dropped or masked episode's
    from workbench.loop import teacher_segments

    cut, failed = episode(0.0, 3), episode(0.0, 3, error="boom")
    cut.truncated = True
    masking = LoopConfig(advantage="distill", teacher="dense", on_truncated="mask")
    assert teacher_segments([[a, b, cut, failed]], masking) == [a.segments[0], b.segments[0]]
    assert teacher_segments([[a, cut]], cfg) == [a.segments[0], cut.segments[0]]  # on_truncated="keep": it trains


def test_engines_are_judged_by_the_oldest_version_and_a_dropped_engine_stops_serving(ray_local):
    """After a sync that failed part-way one engine serves v+1, another v: the newest version
    (the counter's) said no sync was needed, the oldest says one is. An engine dropped from the
    synced list (a RayActorError, which includes ActorUnavailableError, possibly transient) is
    killed too: alive, it went on serving the runners' routers ever older weights."""
    import ray

    from workbench.loop import drop_dead_engines, engines_version

    @ray.remote(num_cpus=0)
    class Engine:
        def __init__(self, version):
            self.version = version

        def info(self):
            return {"version": self.version}

    a, b = Engine.remote(5), Engine.remote(4)
    engines = [a, b]
    assert engines_version(engines) == 5 and engines_version(engines, newest=False) == 4
    drop_dead_engines(engines, [(b, ray.exceptions.ActorUnavailableError("a network blip", None))])
    assert engines == [a]
    # ray.kill is asynchronous: a call sent at once may still be served (seen once in CI), so the
    # engine must stop serving within seconds, not at the next call
    import time

    deadline = time.monotonic() + 30
    with pytest.raises(ray.exceptions.RayActorError):
        while time.monotonic() < deadline:
            ray.get(b.info.remote(), timeout=30)
            time.sleep(0.1)
    ray.kill(a)


def test_an_engine_failing_before_the_nccl_broadcast_is_raised_not_waited_on(ray_local, monkeypatch):
    """The NCCL sync's driver: an engine that fails before joining the broadcast (e.g. 'policy
    version must increase') leaves trainer rank 0 blocked in it, NCCL has no timeout. The driver
    waited on the senders first and hung for ever; it raises the first failure of either side."""
    import time
    from types import SimpleNamespace

    import ray

    from workbench.rollout import nccl_sync
    from workbench.trainer.fsdp import Trainer, WeightSyncBroken

    @ray.remote(num_cpus=0)
    class Rank0:
        def weight_meta(self, wire):
            return {}

        def send_weights_nccl(self, meta):
            time.sleep(3600)  # blocked in a broadcast no engine joins

    @ray.remote(num_cpus=0)
    class Engine:
        def info(self):
            return {"version": 3}

        def update_weights_nccl(self, *args):
            raise RuntimeError("policy version must increase")

    monkeypatch.setattr(nccl_sync, "TransferMeta", lambda **kw: None)
    monkeypatch.setattr(nccl_sync, "check_meta", lambda *a: None)
    monkeypatch.setattr(nccl_sync, "hf_meta", lambda path: None)
    rank0, engine = Rank0.remote(), Engine.remote()
    driver = SimpleNamespace(workers=[rank0], nccl=SimpleNamespace(wire_dtype="bfloat16", packed=False), model_path="m",
                             nccl_broken=None, nccl_blocked=False, _nccl_engines=[engine])
    t0 = time.monotonic()
    # (rank 0 stays inside the broadcast: the group is broken for good, WeightSyncBroken says so)
    with pytest.raises(WeightSyncBroken, match="policy version must increase"):
        Trainer.sync_weights_nccl(driver, [engine], 3)
    assert time.monotonic() - t0 < 30 and driver.nccl_blocked
    ray.kill(rank0)
    ray.kill(engine)


def test_a_restored_run_syncs_under_its_checkpoints_version(ray_local, monkeypatch):
    """loop.run's first sync labels the trainer's weights with the trainer's own version where the
    engines are behind it (a restored checkpoint's weights on fresh engines), else one past the
    newest engine's (Workbench.sync's rule): it always added one, so a restored run's steps were
    labelled one past an uninterrupted run's. (A fake trainer and engine: the rule is the loop's.)"""

    from workbench.loop import _run
    from workbench.rollout.engine import WeightSyncReport

    @ray.remote(num_cpus=0)
    class Engine:
        def __init__(self, version):
            self.version = self.verified = version

        def info(self):
            return {"version": self.version, "verified_version": self.verified}

        def update_weights(self, weights, version, expected, path, tol):
            self.version = self.verified = version
            return WeightSyncReport(version, 0.0, 0, 0.0, True)

    class Trainer:
        vocab_size, nccl = 64, None

        def __init__(self, version):
            self.version = version

        def weights_and_probe(self, ids):
            return ray.put({}), ray.put([0.0] * len(ids)), []

    for restored, engine_at, synced in ((5, 0, 5), (0, 0, 1), (5, 7, 8)):
        trainer, engine = Trainer(restored), Engine.remote(engine_at)
        assert _run(None, trainer, [engine], None, LoopConfig(steps=0), None, False, None, 0, threading.Event(),
                    None, 0) == []
        assert trainer.version == ray.get(engine.info.remote())["version"] == synced, (restored, engine_at)
        ray.kill(engine)
    # a checkpoint restored by the loop itself replaced the trainer's weights: synced even where the
    # caller turned the initial sync off (the engines served the weights from before the restore;
    # the first resumed step sampled the base model, every token V versions stale)
    trainer, engine = Trainer(0), Engine.remote(0)
    trainer.restore = lambda path: (setattr(trainer, "version", 5) or {"next_step": 3, "data_position": 12})
    monkeypatch.setattr("workbench.loop.recover_checkpoint", lambda path: True)
    _run(None, trainer, [engine], None, LoopConfig(steps=3, initial_sync=False), None, False, "ckpt", 0,
         threading.Event(), None, 0)
    assert trainer.version == ray.get(engine.info.remote())["version"] == 5
    ray.kill(engine)
    # an engine behind the trainer's verified weights (its last sync failed its probe check, or a load tore
    # its weights) is synced whatever initial_sync says: it sampled on under the trainer's version
    trainer, engine = Trainer(6), Engine.remote(6)
    ray.get(engine.__ray_call__.remote(lambda e: setattr(e, "verified", 5)))
    _run(None, trainer, [engine], None, LoopConfig(steps=0, initial_sync=False), None, False, None, 0,
         threading.Event(), None, 0)
    assert trainer.version == ray.get(engine.info.remote())["version"] == 7
    ray.kill(engine)
