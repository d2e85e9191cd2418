"""A stopped continuous-async run records every finished group it did not train.

A step's worth of groups and more start ahead of the step that takes them; when the run stops
(wb.stop(), its last step), the finished ones no step took were thrown away uncounted (their
failures and identity counts unread, and in finish order their tasks never drawn again). They are
recorded as the last step's untrained groups. The rollout, trainer and engines are fakes: the
stop's timing against groups finishing is what the test needs to control."""

from __future__ import annotations

import threading
import time

import workbench.loop as loop
from workbench.agents import Task
from workbench.correction import CorrectionConfig, correction_weights, merge_stats
from workbench.tokens import Segment, Trajectory


class _Started:  # one group's rollout, finished by a thread after `delay`
    def __init__(self, task, group_size, delay):
        self.group, self.task = None, task

        def run():
            time.sleep(delay)
            eps = []
            for i in range(group_size):
                s = Segment()
                s.append([1, 2], False)
                s.append([3, 4, 5], True, [-1.0] * 3, [1] * 3)
                eps.append(Trajectory([s], reward=float(i % 2), group_id=task.id, episode_id=f"{task.id}-{i}"))
            self.group = eps

        threading.Thread(target=run, daemon=True).start()


class _Rollout:
    sampling = None

    def __init__(self):
        self.finished = []

    def submit_group(self, task, group_size):
        return _Started(task, group_size, 0.002), None

    def finish_group(self, ref, runner, task, group_size):
        self.finished.append(task.id)
        return ref.group

    def abandon_groups(self, *args):
        pass


class _Trainer:
    def __init__(self):
        self.version = 1
        self.cfg = type("Cfg", (), {"correction": CorrectionConfig(), "temperature": None})()

    def train_step(self, batch):
        c = correction_weights(batch["behaviour_logprobs"], batch["behaviour_logprobs"], batch["loss_mask"],
                               batch["versions"], self.version, self.cfg.correction)
        v, self.version = self.version, self.version  # (no update: no version to outrun)
        return {"version": v, "trained_version": v, "loss": 0.0, "grad_norm": 0.0, "correction": merge_stats([c.stats]),
                "replay": {"disagree_rate": None, "disagree_rate_per_layer": [], "fallback": [], "replayed": []},
                "signal_tokens_trained": 1, "updates": 1, "updates_skipped": 1, "kl_k3_live": None, "kl_ref": None}


def _wait(refs, num_returns=1, timeout=None):
    """ray.wait over _Started groups."""
    t0 = time.time()
    while True:
        done = [r for r in refs if r.group is not None]
        if done or time.time() - t0 > (timeout or 0):
            return done[:num_returns], [r for r in refs if r not in done]
        time.sleep(0.0005)


class _Tasks:
    def take(self, position, n):
        return [Task([{"role": "user", "content": "x"}], id=f"t{position + i}") for i in range(n)]


def test_a_stopped_async_run_records_the_finished_groups_no_step_took(monkeypatch):
    monkeypatch.setattr(loop.ray, "wait", _wait)
    monkeypatch.setattr(loop, "sync_engines", lambda *a, **k: [])
    for order in ("finish", "start"):
        rollout, stop, trained, untrained = _Rollout(), threading.Event(), [], []

        def on_step(m):
            if m["step"] == 0:
                time.sleep(0.3)  # the next groups finish meanwhile
            else:
                stop.set()

        cfg = loop.LoopConfig(mode="async", async_lag=1, async_order=order, steps=10, prompts_per_step=4, group_size=2)
        history = loop._run_async(rollout, _Trainer(), [], _Tasks(), cfg, on_step, False, None, 0, stop,
                                  lambda step, groups: trained.extend(g[0].group_id for g in groups), 0, 0, None, None,
                                  on_untrained=lambda step, groups: untrained.append((step, [g[0].group_id for g in groups])))
        assert [m["step"] for m in history] == [0, 1]
        # every group that finished is trained or recorded untrained (under the last step), once
        recorded = trained + [gid for _, ids in untrained for gid in ids]
        assert sorted(recorded) == sorted(rollout.finished) and len(rollout.finished) > 8, (order, recorded, rollout.finished)
        assert untrained[-1][0] == 1


class _SyncRollout:
    """Rollout.run_groups for the sync loop: groups finish one by one; a set `stop` ends the wait
    (RolloutStopped with those finished), as the real one does."""
    sampling = None

    def __init__(self):
        self.finished, self.stopped = [], 0

    def run_groups(self, tasks, group_size, progress=False, stop=None):
        out = []
        for task in tasks:
            if stop is not None and stop.is_set():
                self.stopped += 1
                raise loop.RolloutStopped(out)
            time.sleep(0.05)
            started = _Started(task, group_size, 0.0)
            while started.group is None:
                time.sleep(0.001)
            self.finished.append(task.id)
            out.append(started.group)
        return out


def test_a_stopped_sync_run_stops_waiting_and_records_the_next_rollouts_groups(monkeypatch):
    """The sync loop starts step k+1's rollout once step k is synced, while step k is recorded
    (evaluation, on_step, a checkpoint). A stop then waited out that whole rollout (up to its
    episodes' timeouts) and threw it away unrecorded. The wait ends at the stop, and the groups
    finished by then are recorded with the last step's untrained ones."""
    monkeypatch.setattr(loop, "sync_engines", lambda *a, **k: [])
    monkeypatch.setattr(loop, "engines_version", lambda engines, lost=None, newest=True: 1)
    rollout, stop, trained, untrained = _SyncRollout(), threading.Event(), [], []

    def on_step(m):  # wb.stop() while step 0 is recorded: step 1's rollout runs meanwhile
        time.sleep(0.3)
        stop.set()

    cfg = loop.LoopConfig(steps=5, prompts_per_step=40, group_size=2)
    history = loop._run(rollout, _Trainer(), [], _Tasks(), cfg, on_step, False, None, 0, stop,
                        lambda step, groups: trained.extend(g[0].group_id for g in groups), 0,
                        on_untrained=lambda step, groups: untrained.append((step, [g[0].group_id for g in groups])))
    assert [m["step"] for m in history] == [0]
    assert rollout.stopped == 1  # step 1's rollout stopped waiting (its 40 groups take 2 s)
    assert len(trained) == 40 and 40 < len(rollout.finished) < 80
    # every group that finished is trained or recorded untrained (under step 0), once
    assert untrained and {step for step, _ in untrained} == {0}
    assert sorted(trained + [gid for _, ids in untrained for gid in ids]) == sorted(rollout.finished)


def test_a_run_ending_on_an_error_still_records_the_finished_groups_no_step_took(monkeypatch):
    """The groups recorded at a stop were lost when the run ended on an error instead (a failed
    sync, an evaluation's, a rank's): recorded in the run's `finally`, the error still raised."""
    import pytest

    monkeypatch.setattr(loop.ray, "wait", _wait)
    monkeypatch.setattr(loop, "sync_engines", lambda *a, **k: [])
    monkeypatch.setattr(loop, "engines_version", lambda engines, lost=None, newest=True: 1)

    def on_step(m):
        time.sleep(0.3)  # the next groups finish meanwhile
        raise RuntimeError("the step's evaluation failed")

    for mode, rollout in (("async", _Rollout()), ("sync", _SyncRollout())):
        trained, untrained = [], []
        cfg = loop.LoopConfig(mode=mode, async_lag=1, steps=10, prompts_per_step=40 if mode == "sync" else 4, group_size=2)
        with pytest.raises(RuntimeError, match="evaluation failed"):
            loop._run(rollout, _Trainer(), [], _Tasks(), cfg, on_step, False, None, 0, threading.Event(),
                      lambda step, groups: trained.extend(g[0].group_id for g in groups), 0,
                      on_untrained=lambda step, groups: untrained.append((step, [g[0].group_id for g in groups])))
        recorded = trained + [gid for _, ids in untrained for gid in ids]
        assert untrained and sorted(recorded) == sorted(rollout.finished) and len(rollout.finished) > len(trained), mode


def test_leftovers_of_a_run_whose_training_raised_go_to_the_last_recorded_step(monkeypatch):
    """A step whose training raised (a rank died) is not recorded, and the next run retries it,
    replacing its untrained/ file: the finished groups no step took were filed there and deleted.
    They go with the last step recorded."""
    import pytest

    class Dying(_Trainer):
        steps = 0

        def train_step(self, batch):
            Dying.steps += 1
            if Dying.steps == 2:
                time.sleep(0.3)  # the next groups finish meanwhile
                raise RuntimeError("a trainer rank died")
            return super().train_step(batch)

    monkeypatch.setattr(loop.ray, "wait", _wait)
    monkeypatch.setattr(loop, "sync_engines", lambda *a, **k: [])
    monkeypatch.setattr(loop, "engines_version", lambda engines, lost=None, newest=True: 1)
    # (async: groups run ahead of training; a sync run's next rollout starts once a step has trained)
    untrained, untaken = [], []
    cfg = loop.LoopConfig(mode="async", async_lag=1, steps=10, prompts_per_step=4, group_size=2)
    with pytest.raises(RuntimeError, match="rank died"):
        loop._run(_Rollout(), Dying(), [], _Tasks(), cfg, None, False, None, 0, threading.Event(), None, 0,
                  on_untrained=lambda step, groups: (untrained.append(step), untaken.extend(
                      t.info.get("untaken") for g in groups for t in g)))
    assert untrained and set(untrained) == {0}, untrained
    # marked as taken by no step (the audit page said "filtered or stale" of them)
    assert untaken and all(untaken), untaken
