"""Faults in the rollout half, survived mid-run (issue 16, item 3 a-b): a killed engine actor and
a killed rollout runner actor. One session (reference backend, 2 engines, 2 runners, a 4-turn
Env) on the test session's Ray; each fault is a real SIGKILL of the actor's process, at a moment
when it is serving requests of a running RL step."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray

import workbench
from workbench.rollout.runner import RunnersLost
from workbench.tokens import read_trajectories

AGENTS = Path(__file__).parent / "agents"


@pytest.fixture(scope="module")
def wb(ray_local, tmp_path_factory):
    tasks = [{"prompt": f"Say something about item {k}."} for k in range(16)]
    session = workbench.connect(backend="reference", num_engines=2, num_runners=2, agent=str(AGENTS / "long_env.py"),
                                tasks=tasks, trainer_ranks=1, run_dir=str(tmp_path_factory.mktemp("faults") / "run"),
                                loop={"prompts_per_step": 4, "group_size": 2})
    yield session
    session.shutdown()


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))


def kill_when(condition, pid: int, timeout: float = 300) -> dict:
    """SIGKILL `pid` from a thread as soon as condition() holds; returns a record of when."""
    record: dict = {}

    def watch():
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if condition():
                    os.kill(pid, signal.SIGKILL)
                    record["killed_at"] = time.time()
                    return
            except Exception as e:  # keep polling; report if it never fired
                record["last_error"] = repr(e)
            time.sleep(0.01)

    record["thread"] = threading.Thread(target=watch, daemon=True)
    record["thread"].start()
    return record


def sampled_runs(segment) -> int:
    m = segment.loss_mask
    return sum(1 for j in range(len(m)) if m[j] and (j == 0 or not m[j - 1]))


def metrics_lines(wb) -> list[dict]:
    return [json.loads(x) for x in (wb.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_engine_killed_mid_run(wb):
    """(a) One of two engine actors is SIGKILLed while it serves requests of step >= 1.
    Survived: the run (all 4 steps trained); every episode in flight on the dead engine, whose
    pending request was retried on the live engine (nothing had been recorded for it), so each
    episode of the kill step is complete (4 turns recorded, 4 sampled runs, one policy version)
    or, if it failed, it carries the reason and was dropped from the batch; the record of every
    step (metrics.jsonl and trajectories/ agree). Lost: nothing recorded; the dead engine's
    in-flight generations (never recorded, re-sampled on the other engine)."""
    assert len(wb.engines) == 2
    victim = wb.engines[1]
    pid = pid_of(victim)

    def serving_step_1():  # engine 1 has requests in flight, in a step after the first
        return wb.next_step >= 1 and any(s["router"]["outstanding"][1] > 0 for s in wb.rollout.stats())

    kill = kill_when(serving_step_1, pid)
    hist = wb.run(4, progress=False, checkpoint_every=1).wait(600)
    kill["thread"].join(5)
    assert "killed_at" in kill, f"the engine was never seen busy in step >= 1: {kill}"

    assert [h["step"] for h in hist] == [0, 1, 2, 3]
    hit = next(h for h in hist if h["engines_lost"])  # the step whose weight sync found it dead
    assert hit["step"] >= 1 and hit["engines"] == 1
    assert all(h["engines"] == 2 for h in hist if h["step"] < hit["step"]) and all(h["engines"] == 1 for h in hist[hit["step"]:])
    assert victim not in wb.engines and len(wb.engines) == 1
    routers = [s["router"] for s in wb.rollout.stats()]
    assert sum(r["failovers"] for r in routers) >= 1, routers  # a request in flight on it went to the other
    assert any(r["dead"] == [1] for r in routers)

    # the record: a line per step, a trajectory file per step, and they agree
    lines = metrics_lines(wb)
    assert [m["step"] for m in lines] == [0, 1, 2, 3]
    for m in lines:
        trajs = read_trajectories(wb.run_dir / "trajectories" / f"step_{m['step']:05d}.parquet")
        failed = [t for t in trajs if t.error is not None]
        assert len(trajs) == m["episodes"] + m["dropped_episodes"] == 8
        assert m["failed_episodes"] == len(failed) and m["dropped_episodes"] == len(failed)  # on_failed="drop"
        assert all("engine" in t.error for t in failed), [t.error for t in failed]
        for t in trajs:
            if t.error is None:  # what entered the batch is whole: every turn recorded, one version
                seg = t.segments[0]
                versions = {v for v, k in zip(seg.versions, seg.loss_mask) if k}
                assert t.info["turns"] == 4 and sampled_runs(seg) == 4 and len(versions) == 1
                assert all(lp <= 0 for lp, k in zip(seg.logprobs, seg.loss_mask) if k)


def test_runner_killed_mid_run(wb):
    """(b) One of two rollout runner actors is SIGKILLed while its episodes are running.
    Survived: the run (3 more steps trained), the groups on the live runner, every later step
    (all its groups on the live runner, none failed), the record of every step. Lost: the
    episodes the dead runner was running (their segments lived in its process): they come back as
    failed episodes with the reason (counted in failed_episodes and failure_reasons, dropped
    from the batch), not re-run (a task that kills its runner would kill every runner in turn).
    Nothing recorded is lost."""
    start = wb.next_step
    pid = wb.rollout.driver.info[1]["pid"]
    runner = wb.rollout.driver.runners[1]

    def busy():  # runner 1 has engine requests in flight, in the second step of this run
        return wb.next_step >= start + 1 and sum(ray.get(runner.stats.remote(), timeout=5)["router"]["outstanding"]) > 0

    kill = kill_when(busy, pid)
    hist = wb.run(3, progress=False, checkpoint_every=1).wait(600)
    kill["thread"].join(5)
    assert "killed_at" in kill, f"runner 1 was never seen busy: {kill}"

    assert [h["step"] for h in hist] == [start, start + 1, start + 2]
    hit = [h for h in hist if h["failed_episodes"]]
    assert len(hit) == 1 and hit[0]["step"] >= start + 1, [(h["step"], h["failed_episodes"]) for h in hist]
    hit = hit[0]
    # the dead runner had 2 of the step's 4 groups (2 episodes each) in flight; the other 2 trained
    assert hit["failed_episodes"] == hit["dropped_episodes"] == 4 and hit["episodes"] == 4
    [(reason, n)] = hit["failure_reasons"].items()
    assert n == 4 and reason.startswith(f"rollout runner 1 (pid {pid}) died while running this episode")
    assert len(wb.rollout.driver.runners) == 1 and len(wb.rollout.driver.lost) == 1
    assert all(h["failed_episodes"] == 0 and h["episodes"] == 8 for h in hist if h["step"] != hit["step"])
    lines = metrics_lines(wb)
    assert [m["step"] for m in lines] == list(range(start + 3))
    for m in lines:  # the trajectory file of each step holds the episodes that trained (failed ones without segments are not rows)
        trajs = read_trajectories(wb.run_dir / "trajectories" / f"step_{m['step']:05d}.parquet")
        assert sum(t.error is None for t in trajs) == m["episodes"]


def test_no_runner_left_is_a_clear_error(wb):
    """(b, the end) With the last runner killed, rolling out raises RunnersLost naming what died;
    it does not hang, and a run stops with it."""
    driver = wb.rollout.driver
    assert len(driver.runners) == 1
    os.kill(driver.info[0]["pid"], signal.SIGKILL)
    with pytest.raises(RunnersLost, match=r"every rollout runner died: .*rollout runner 0 \(pid \d+\) died"):
        wb.rollout.group()
    with pytest.raises(RunnersLost, match="no rollout runner left"):
        wb.rollout.group()
    run = wb.run(1, progress=False)
    with pytest.raises(RuntimeError, match="rollout of step .* failed: no rollout runner left"):
        run.wait(120)
