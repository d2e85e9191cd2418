"""The continuous async loop (LoopConfig(mode="async"), loop.GroupStream) on real Ray, real
reference engines (2) and a real trainer rank: the rollout keeps groups in flight while the
trainer trains, each step takes the next groups in the order they started (or, in finish order,
the first to finish), a group older than async_lag versions is never trained, and groups go to the runner with the fewest outstanding episodes
over every caller. (The vLLM path of async mode: tests/test_trainer.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from workbench.agents import Task
from workbench.correction import CorrectionConfig
from workbench.loop import LoopConfig, run
from workbench.rollout.engine import SamplingConfig
from workbench.rollout.runner import Rollout
from workbench.tokens import read_trajectories, write_trajectories
from workbench.trainer.fsdp import Trainer, TrainerConfig

ARITHMETIC = "workbench/examples/arithmetic_env.py"


def arithmetic(n: int, seed: int) -> list[Task]:
    from workbench.examples.arithmetic_env import tasks as draw

    return draw(n, seed=seed)


@pytest.fixture(scope="module")
def trainer(ray_local, reference_engines, moe_path):
    """One trainer rank (the loop's bound is checked against its gate: max_staleness 4, above
    the loop's async_lag of 1, so that only the loop's admission keeps older groups out).
    The engines get their original weights back afterwards."""
    from workbench.rollout.actor import sync_weights
    from workbench.toy.models import load_hf_model

    original = load_hf_model(moe_path).state_dict()
    t = Trainer(str(moe_path), world_size=1, cfg=TrainerConfig(lr=1e-3, micro_batch_size=64,
                                                               correction=CorrectionConfig.tis(max_staleness=4)))
    yield t
    t.shutdown()
    sync_weights(reference_engines, original)


def token_versions(t) -> set[int]:
    return {v for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m}


def held_first_task(gate, held: list):
    """A task source whose very first task waits for the file `gate` between its turns
    (tests/agents/waiting_env.py); its id goes to `held`."""
    def source(n, seed):
        drawn = arithmetic(n, seed)
        if not held:
            drawn[0].info["wait_for"] = str(gate)
            held.append(drawn[0].id)
        return drawn
    return source


def test_continuous_async_trains_within_the_bound_and_keeps_per_token_versions(trainer, reference_engines, moe_path,
                                                                               tmp_path):
    """The first group's episodes wait between their two turns until step 0 is trained and
    synced, so their turns are sampled by two versions; the other groups keep the steps going
    meanwhile (no barrier). Every step's tokens are at most async_lag (2) versions behind the
    version it trains from, the held episodes are trained with both versions, and their record
    keeps both."""
    gate, held, trained = tmp_path / "release", [], []
    rollout = Rollout("tests/agents/waiting_env.py", reference_engines, str(moe_path), num_runners=2,
                      sampling=SamplingConfig(max_tokens=8))
    try:
        t0 = time.time()
        hist = run(rollout, trainer, reference_engines, held_first_task(gate, held),
                   # "finish": step 0 trains the groups that overtook the held one (in start order it waits for it)
                   LoopConfig(steps=3, prompts_per_step=2, group_size=2, mode="async", async_lag=2, async_order="finish"),
                   progress=False,
                   on_step=lambda m: m["step"] == 0 and gate.touch(),
                   on_groups=lambda step, groups: trained.extend((step, t) for g in groups for t in g))
        wall = time.time() - t0
        per_runner = [s["server"]["sampled_tokens"] for s in rollout.stats()]
    finally:
        rollout.shutdown()
    assert [h["step"] for h in hist] == [0, 1, 2] and all(h["failed_episodes"] == 0 for h in hist)
    # the steps follow one another: their step_s add up to at most the run (from their groups' starts, they overlapped)
    assert sum(h["step_s"] for h in hist) <= wall
    for h in hist:
        version = h["trained_version"]  # the version the step trained from
        assert set(h["tokens_per_version"]) <= set(range(version - 2, version + 1)), h["tokens_per_version"]
        assert max(h["staleness_hist"]) <= 2 and h["stale_dropped"] == 0 and h["gate_pass_ratio"] == 1.0
        assert sum(h["groups_per_version"].values()) == 2 and h["groups_dropped_stale"] == 0
    first = hist[0]["trained_version"]
    spanning = [(step, t) for step, t in trained if t.info["task_id"] == held[0]]
    assert len(spanning) == 2
    for step, t in spanning:
        # the first turn at the first version; the second after step 0's sync: first + 1, or later
        # where step 1 trained and synced before (or while) the released turn was sampled (its
        # groups can be ready when step 0 ends), but never newer than the step trained from
        versions = [v for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m]
        assert step > 0 and versions[0] == first and len(set(versions)) >= 2, (step, versions)
        assert first < versions[-1] <= hist[step]["trained_version"] and versions == sorted(versions), (step, versions)
    assert sum(h["episodes_spanning_versions"] for h in hist) >= 2
    # data_next (where a continued run starts): past every task the step trained, never moving back
    assert all(h["data_next"] >= 2 * (h["step"] + 1) for h in hist)
    assert [h["data_next"] for h in hist] == sorted(h["data_next"] for h in hist)
    # a group holding an episode that spans versions mixes versions too (counted with every group's)
    assert all(h["groups_mixing_versions"] >= min(h["episodes_spanning_versions"], 1) for h in hist)
    episodes = [t for _, t in spanning]
    recorded = {t.episode_id: t for t in read_trajectories(write_trajectories(episodes, tmp_path / "t.parquet"))}
    assert all(recorded[t.episode_id].segments[0].versions == t.segments[0].versions for t in episodes)
    assert all(n > 0 for n in per_runner)  # both runners ran episodes


def test_a_group_older_than_the_bound_is_never_trained(trainer, reference_engines, moe_path, tmp_path):
    """The first group is held back (its first turn sampled at the first version, then it waits
    for a file the test writes after step 1) while the other groups overtake it. It finishes
    at least 2 versions old and is not admitted (groups_dropped_stale), though the trainer's own
    gate (max_staleness 4) would have let it through: every trained token is at most 1 behind."""
    gate, held, trained_tasks = tmp_path / "release", [], []
    rollout = Rollout("tests/agents/waiting_env.py", reference_engines, str(moe_path), num_runners=2,
                      sampling=SamplingConfig(max_tokens=8))
    try:
        hist = run(rollout, trainer, reference_engines, held_first_task(gate, held),
                   LoopConfig(steps=4, prompts_per_step=2, group_size=2, mode="async", async_lag=1, async_order="finish"),
                   progress=False,
                   on_step=lambda m: m["step"] == 1 and gate.touch(),
                   on_groups=lambda step, groups: trained_tasks.extend(g[0].info["task_id"] for g in groups))
    finally:
        rollout.shutdown()
    assert len(hist) == 4 and sum(h["groups_dropped_stale"] for h in hist) == 1
    assert held[0] not in trained_tasks and len(trained_tasks) == 8
    for h in hist:
        assert max(h["staleness_hist"]) <= 1 and h["stale_dropped"] == 0
        assert min(h["groups_per_version"]) >= h["trained_version"] - 1


def test_in_start_order_a_slow_group_holds_its_step_and_is_trained(trainer, reference_engines, moe_path, tmp_path):
    """async_order "start" (the default): the first group is held between its turns until the three
    groups started after it have finished (overtaking it). It still trains first: step 0 waits
    for it, no group is dropped, and every token is within async_lag. In finish order the groups
    that overtook it train first and a held group is dropped once past the bound (the test above):
    the long episodes drop out of training, a bias toward short replies."""
    gate, held, trained_tasks, done = tmp_path / "release", [], [], tmp_path / "done"
    done.mkdir()

    def release():  # once the 3 other groups' 6 episodes have ended (at most 60 s)
        deadline = time.monotonic() + 60
        while len(list(done.iterdir())) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        gate.touch()

    def source(n, seed):
        drawn = held_first_task(gate, held)(n, seed)
        for t in drawn:
            t.info["done_dir"] = str(done)
        return drawn

    releaser = threading.Thread(target=release, daemon=True)
    rollout = Rollout("tests/agents/waiting_env.py", reference_engines, str(moe_path), num_runners=2,
                      sampling=SamplingConfig(max_tokens=8))
    try:
        releaser.start()
        hist = run(rollout, trainer, reference_engines, source,
                   LoopConfig(steps=3, prompts_per_step=2, group_size=2, mode="async", async_lag=1), progress=False,
                   on_groups=lambda step, groups: trained_tasks.append([g[0].info["task_id"] for g in groups]))
    finally:
        gate.touch()
        rollout.shutdown()
    assert trained_tasks[0][0] == held[0]  # step 0 trains the first group started, the held one, first
    assert sum(h["groups_dropped_stale"] for h in hist) == 0 and sum(map(len, trained_tasks)) == 6
    for h in hist:
        assert max(h["staleness_hist"]) <= 1


def test_groups_go_to_the_runner_with_the_fewest_outstanding_episodes(reference_engines, moe_path):
    """One count of outstanding episodes per runner, shared by every caller: groups of 2, 1, 1
    episodes go to runners a, b, b (by episodes, not round robin by groups); a full runner takes
    none; another caller's run_groups sees the same counts; all return to 0."""
    rollout = Rollout(ARITHMETIC, reference_engines, str(moe_path), num_runners=2,
                      sampling=SamplingConfig(max_tokens=8), max_concurrent_episodes=4)
    a, b = rollout.runners
    todo = arithmetic(6, seed=3)
    try:
        started = [rollout.submit_group(todo[0], 2), rollout.submit_group(todo[1], 1), rollout.submit_group(todo[2], 1)]
        assert [r for _, r in started] == [a, b, b] and rollout.outstanding == {id(a): 2, id(b): 2}
        started.append(rollout.submit_group(todo[3], 2))  # a tie: the first runner, now full
        assert started[-1][1] is a and rollout.outstanding == {id(a): 4, id(b): 2}
        assert rollout.submit_group(todo[4], 3) is None  # room for 3 nowhere (4 slots each)
        # another caller (run_groups): a is full, so its group goes to b
        groups = rollout.run_groups([todo[5]], 2, progress=False)
        assert len(groups[0]) == 2 and all(t.error is None for t in groups[0])
        done = [rollout.finish_group(ref, r, task, n) for (ref, r), task, n in zip(started, todo, (2, 1, 1, 2))]
        assert [len(g) for g in done] == [2, 1, 1, 2] and all(t.error is None for g in done for t in g)
        assert rollout.outstanding == {id(a): 0, id(b): 0}
        assert all(s["server"]["sampled_tokens"] > 0 for s in rollout.stats())
    finally:
        rollout.shutdown()
