"""A trainer rank killed mid-run (issue 16, item 3 c): the run stops with a clear error instead
of hanging in a collective, and `connect(run_dir=..., resume=True)` continues from the last
checkpoint with every step recorded once."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import ray

import workbench
from workbench.loop import TrainerRankDied
from workbench.tokens import read_trajectories

LOOP = {"prompts_per_step": 2, "group_size": 2}


def prompts(path) -> list[tuple]:
    """The prompt ids of a step's episodes (what the step's data position gave it)."""
    out = set()
    for t in read_trajectories(path):
        seg = t.segments[0]
        out.add(tuple(seg.token_ids[:seg.loss_mask.index(1)]))
    return sorted(out)


def test_trainer_rank_killed_then_resumed(ray_local, tmp_path):
    """(c) Trainer rank 1 of 2 is SIGKILLed while step 2 trains (its trajectories are written).
    Survived: steps 0-1 (metrics, trajectories, the checkpoint after step 1); the driver, which
    gets TrainerRankDied naming rank 1 within seconds (the trainer group is killed so that rank 0
    does not wait in a collective); errors.jsonl says why and where the run stopped. A new session
    with resume=True continues at the checkpoint's step: steps 0..5 are each recorded once in
    metrics.jsonl and trajectories/, in order, with the policy version only increasing.
    Lost: step 2's training (it never finished); its rollout, recorded but never trained on, is
    moved to abandoned/ and step 2 is re-run with the same prompts. Nothing that was recorded is
    deleted."""
    run_dir = tmp_path / "run"
    # (lr 1e-4: at 1e-3 the 4-episode steps collapsed one toy build to reward 0, every group flat, and a
    # step with no update keeps its version: the check below read that as a version not increasing)
    wb = workbench.connect(backend="reference", run_dir=str(run_dir), loop=LOOP, trainer={"lr": 1e-4})
    try:
        pid = ray.get(wb._trainer.workers[1].__ray_call__.remote(lambda self: os.getpid()))
        killed: dict = {}

        def killer():
            while not (run_dir / "trajectories" / "step_00002.parquet").exists():
                time.sleep(0.005)
            os.kill(pid, signal.SIGKILL)
            killed["at"] = time.time()

        threading.Thread(target=killer, daemon=True).start()
        run = wb.run(6, progress=False, checkpoint_every=1)
        with pytest.raises(RuntimeError, match=r"trainer rank 1 of 2 \(actor [0-9a-f]+\) died"):
            run.wait(300)
        assert run.done and time.time() - killed["at"] < 60  # stopped, not hung in a collective
        assert isinstance(run.error, TrainerRankDied) and run.error.rank == 1
        done = [h["step"] for h in run.history]
        assert done in ([0, 1], [0, 1, 2])  # step 2 recorded only if the kill landed after its metrics line
        with pytest.raises(RuntimeError, match="trainer is gone.*resume=True"):
            wb.run(1)
        [error] = [json.loads(x) for x in (run_dir / "errors.jsonl").read_text().splitlines()]
        assert "TrainerRankDied" in error["error"] and error["next_step"] == len(done)
    finally:
        wb.shutdown()  # returns: the dead group is killed by its handles
    checkpointed = json.loads((run_dir / "checkpoint" / "run_state.json").read_text())["next_step"]
    assert checkpointed in (2, 3) and not (run_dir / "checkpoint.new").exists()
    abandoned_prompts = prompts(run_dir / "trajectories" / "step_00002.parquet") if checkpointed == 2 else None

    again = workbench.connect(backend="reference", run_dir=str(run_dir), resume=True, loop=LOOP)
    try:
        assert again.next_step == checkpointed and [h["step"] for h in again.history] == list(range(checkpointed))
        again.run(6 - again.next_step, background=False, progress=False, checkpoint_every=1)
    finally:
        again.shutdown()

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3, 4, 5]  # no step repeated, none skipped
    assert all(a["version"] < b["version"] for a, b in zip(lines, lines[1:]))
    files = sorted(p.name for p in (run_dir / "trajectories").iterdir())
    assert files == [f"step_{k:05d}.parquet" for k in range(6)]
    for m in lines:  # metrics and trajectories agree, step by step
        trajs = read_trajectories(run_dir / "trajectories" / f"step_{m['step']:05d}.parquet")
        assert len(trajs) == m["episodes"] + m["dropped_episodes"] == 4
    if checkpointed == 2:  # step 2's untrained rollout was set aside, and re-run at the same data position
        [aside] = list((run_dir / "abandoned").iterdir())
        assert sorted(p.name for p in (aside / "trajectories").iterdir()) == ["step_00002.parquet"]
        assert prompts(aside / "trajectories" / "step_00002.parquet") == abandoned_prompts
        assert prompts(run_dir / "trajectories" / "step_00002.parquet") == abandoned_prompts


class _FakeRay:
    """Ray as TrainerWatch sees it, each rank's ping answering from a script (a fault a test cannot
    cause: ActorUnavailableError is Ray's answer while a node is unreachable)."""

    exceptions = ray.exceptions

    def __init__(self, answers: dict):
        self.answers, self.killed = answers, []  # rank -> list of errors (None: answers), then answers

    def wait(self, refs, num_returns, timeout):
        return list(refs), []

    def get(self, ref):
        script = self.answers.get(ref)
        error = script.pop(0) if script else None
        if error is not None:
            raise error

    def kill(self, worker, no_restart=True):
        self.killed.append(worker.rank)


class _Rank:
    def __init__(self, rank):
        self.rank = rank
        self._actor_id = bytes([rank]) * 16
        self.__ray_ready__ = type("Ready", (), {"remote": lambda _: rank})()


def test_the_trainer_watch_waits_out_an_unavailable_rank(monkeypatch):
    """Ray's ActorUnavailableError is transient (a network blip between nodes): taken as a death,
    one blip killed every rank of a healthy trainer (ray.kill) and ended the run. A rank unavailable
    for a while, then answering, is left alone; one unavailable past the grace, or dead, is not."""
    import workbench.loop as loop

    unavailable = lambda: ray.exceptions.ActorUnavailableError("temporarily unavailable: RPC error", b"\0" * 16)  # noqa: E731
    trainer = type("T", (), {"workers": [_Rank(0), _Rank(1)]})()
    fake = _FakeRay({1: [unavailable() for _ in range(3)]})
    monkeypatch.setattr(loop, "ray", fake)
    with loop.TrainerWatch(trainer, interval=0.01, unavailable_grace_s=5) as watch:
        time.sleep(0.3)
    assert (watch.failure, fake.killed) == (None, [])
    fake = _FakeRay({1: [unavailable() for _ in range(10_000)]})
    monkeypatch.setattr(loop, "ray", fake)
    with loop.TrainerWatch(trainer, interval=0.01, unavailable_grace_s=0.1) as watch:
        time.sleep(0.5)
    assert isinstance(watch.failure, TrainerRankDied) and watch.failure.rank == 1 and fake.killed == [0, 1]
    fake = _FakeRay({0: [ray.exceptions.ActorDiedError()]})
    monkeypatch.setattr(loop, "ray", fake)
    with loop.TrainerWatch(trainer, interval=0.01, unavailable_grace_s=5) as watch:
        time.sleep(0.2)
    assert isinstance(watch.failure, TrainerRankDied) and watch.failure.rank == 0
