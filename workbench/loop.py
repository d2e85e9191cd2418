"""The RL loop: rollout -> training tensors -> advantages -> one trainer step -> weight sync
with the post-sync check, repeated. Metrics per step go to a list (and the caller's callback),
so a notebook or a script can plot them.

Two modes (LoopConfig.mode):
- "sync": the rollout of step k starts after step k-1 is trained and synced. Every token is
  sampled by the weights it is trained against (staleness 0).
- "async": a producer thread runs the rollout of step k+1 (up to `async_lag` steps ahead)
  while the trainer trains step k. Weight syncs land mid-episode (engines pause in keep mode),
  so an episode's tokens can span versions; each token keeps the version it was sampled by,
  and correction.py weights and gates them per token. Staleness is at most `async_lag`, so the
  trainer's max_staleness must allow it (checked up front).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

from .agents import Task
from .rollout.actor import sync_weights
from .rollout.engine import probe_ids
from .tokens import Trajectory, training_tensors
from .trainer.losses import ADVANTAGES, PER_TOKEN_ADVANTAGES, AdvantageInput, get_advantage

MODES = ("sync", "async")
# What a step does with an episode that failed (the agent raised or timed out, an engine died)
# or was truncated (its conversation outgrew the context): leave it out of the batch, keep it
# with the reward it got, or keep it with reward 0. Kept episodes count in their group's
# statistics and train on what they recorded.
EPISODE_RULES = ("drop", "keep", "zero")


@dataclass
class LoopConfig:
    steps: int = 10
    prompts_per_step: int = 16
    group_size: int = 8
    advantage: str = "grpo"
    sync_tol: float = 1e-3
    initial_sync: bool = True  # first make the engines serve the trainer's weights
    mode: str = "sync"
    async_lag: int = 1  # async: how many steps the rollout may run ahead of training
    # failed episodes carry no reward the agent computed (a crash or a timeout), so by default
    # they leave the batch; truncated ones ran and were scored, so they stay with their reward
    on_failed: str = "drop"
    on_truncated: str = "keep"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"LoopConfig.mode {self.mode!r} unknown; choose one of {MODES}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"LoopConfig.advantage {self.advantage!r} unknown; registered: {sorted(ADVANTAGES)}")
        if self.advantage in PER_TOKEN_ADVANTAGES:
            raise ValueError(f"LoopConfig.advantage {self.advantage!r} needs per-token teacher log-probs, which no part of "
                             f"the loop computes yet; use a reward-based estimator ({sorted(set(ADVANTAGES) - PER_TOKEN_ADVANTAGES)})")
        for name in ("on_failed", "on_truncated"):
            if getattr(self, name) not in EPISODE_RULES:
                raise ValueError(f"LoopConfig.{name} {getattr(self, name)!r} unknown; choose one of {EPISODE_RULES}")
        for name in ("steps", "prompts_per_step", "group_size", "async_lag"):
            if getattr(self, name) < (0 if name == "steps" else 1):
                raise ValueError(f"LoopConfig.{name} must be positive, got {getattr(self, name)}")


def batch_from_groups(groups: list[list[Trajectory]], advantage: str, pad_id: int = 0, on_failed: str = "drop",
                      on_truncated: str = "keep") -> tuple[dict, dict]:
    """Training tensors (one row per trainable segment) with advantages computed over EPISODES:
    the registered estimator sees one reward per episode and its group, and every segment of
    an episode gets that episode's advantage (an episode sealed into five segments weighs once
    in its group's statistics). `batch["episode_tokens"]` holds each row's episode's trainable
    tokens, so sequence-level aggregations average over episodes too. Failed and truncated
    episodes follow `on_failed` / `on_truncated` (EPISODE_RULES)."""
    segments, seg_episode, rewards, group_index = [], [], [], []
    info = {"episodes": 0, "segments": 0, "failed_episodes": 0, "truncated_episodes": 0, "dropped_episodes": 0,
            "sampling_overridden": 0}
    for gi, group in enumerate(groups):
        for t in group:
            failed = t.error is not None
            truncated = bool(getattr(t, "truncated", False)) and not failed
            info["failed_episodes"] += failed
            info["truncated_episodes"] += truncated
            info["sampling_overridden"] += sum(s.stats.get("sampling_overridden", 0) for s in t.segments)
            rule = on_failed if failed else on_truncated if truncated else "keep"
            if rule == "drop":
                info["dropped_episodes"] += 1
                continue
            for s in t.segments:
                if any(s.loss_mask):
                    segments.append(s)
                    seg_episode.append(len(rewards))
            rewards.append(0.0 if rule == "zero" else float(t.reward))
            group_index.append(gi)
    if not segments:
        raise RuntimeError(f"no trainable segment in this batch: every episode was dropped or sampled nothing ({info})")
    batch = training_tensors(segments, pad_id)
    # one row per episode (an episode without trainable tokens still counts in its group's baseline)
    x = AdvantageInput(torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_index),
                       torch.ones(len(rewards), 1))
    per_episode = get_advantage(advantage)(x).float()[:, 0]
    index = torch.tensor(seg_episode)
    batch["advantages"] = per_episode[index][:, None] * batch["loss_mask"]
    tokens = batch["loss_mask"].sum(-1)
    batch["episode_tokens"] = torch.zeros(len(rewards)).index_add_(0, index, tokens)[index]
    info.update(episodes=len(rewards), segments=len(segments))
    return batch, info


def engines_version(engines: list) -> int:
    """The newest policy version any engine serves."""
    import ray

    return max(i["version"] for i in ray.get([e.info.remote() for e in engines]))


def sync_engines(trainer, engines: list, tol: float) -> list:
    """Push the trainer's current weights to every engine under the trainer's version and check
    each engine's probe against the trainer's own log-probs. By NCCL broadcast once
    trainer.init_nccl_sync(engines) ran (GPU); else the CPU path (a state dict through Ray)."""
    expected = trainer.probe(probe_ids(trainer.vocab_size))
    if getattr(trainer, "nccl", None) is not None:
        return trainer.sync_weights_nccl(engines, trainer.version, expected, tol)
    return sync_weights(engines, trainer.state_dict(), version=trainer.version, expected_probe=expected, tol=tol)


def check_staleness(trainer, cfg: LoopConfig) -> None:
    max_staleness = trainer.cfg.correction.max_staleness
    # the gate applies even with correction disabled (correction_weights keeps only fresh rows)
    if cfg.mode == "async" and max_staleness is not None and cfg.async_lag > max_staleness:
        raise ValueError(f"async_lag={cfg.async_lag} lets tokens be {cfg.async_lag} versions stale, but the trainer's "
                         f"correction gate drops sequences older than max_staleness={max_staleness}: raise max_staleness "
                         f"or lower async_lag")


def check_sampling(rollout, trainer) -> None:
    """The rollout's policy sampling must be what the trainer's log-probs assume (the same
    temperature, a full-vocabulary distribution): CorrectionConfig.check_sampling."""
    sampling = getattr(rollout, "sampling", None)
    if sampling is None:
        return
    trainer.cfg.correction.check_sampling(top_p=sampling.top_p, temperature=sampling.temperature,
                                          trainer_temperature=trainer.cfg.temperature)


def run(rollout, trainer, engines: list, task_source: Callable[[int, int], list[Task]], cfg: LoopConfig,
        on_step: Callable[[dict], None] | None = None, progress: bool = True,
        checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        stop: threading.Event | None = None, on_groups: Callable[[int, list], None] | None = None,
        start_step: int = 0) -> list[dict]:
    """Run the loop in `cfg.mode`. `task_source(n, step)` gives the prompts of each step (so the
    data position is the step). With `checkpoint_dir`, a checkpoint found there is resumed from
    (the next step is the one after it: no step is repeated or skipped), and one is written
    every `checkpoint_every` steps. `stop` (an Event) ends the loop after the current step.
    `on_groups(step, groups)` sees each step's trajectories. `start_step`: the first step's
    index (a session continuing earlier steps). Returns one metrics dict per step."""
    from tqdm.auto import tqdm

    check_staleness(trainer, cfg)
    check_sampling(rollout, trainer)
    first = start_step
    if checkpoint_dir and os.path.isfile(os.path.join(checkpoint_dir, "run_state.json")):
        first = trainer.restore(checkpoint_dir)["next_step"]
    # one version counter for trainer and engines; it only ever increases
    trainer.version = max(engines_version(engines), trainer.version)
    if cfg.initial_sync:  # rollouts must come from the trainer's weights, not whatever the engines hold
        trainer.version += 1
        sync_engines(trainer, engines, cfg.sync_tol)

    stop = stop or threading.Event()
    # how many rollouts beyond the first may start before their predecessors are trained: 0 is
    # sync (the rollout of step k waits for step k-1's training and sync)
    trained = threading.Semaphore(cfg.async_lag if cfg.mode == "async" else 0)
    batches: queue.Queue = queue.Queue()

    def produce():
        for step in range(first, cfg.steps):
            if step > first:
                while not trained.acquire(timeout=0.5):
                    if stop.is_set():
                        return
            if stop.is_set():
                return
            try:
                t0 = time.time()
                groups = rollout.run_groups(task_source(cfg.prompts_per_step, step), cfg.group_size, progress=False)
                batches.put((step, groups, t0, time.time()))
            except BaseException as e:  # surfaced in the training thread
                batches.put((step, e, 0.0, 0.0))
                return

    producer = threading.Thread(target=produce, name="workbench-rollout", daemon=True)
    producer.start()
    history = []
    try:
        for step in tqdm(range(first, cfg.steps), desc=f"RL steps ({cfg.mode})", initial=first, total=cfg.steps,
                         disable=not progress):
            got_step, groups, r0, r1 = _next_batch(batches, stop, producer)
            if got_step is None:
                break
            if isinstance(groups, BaseException):
                raise RuntimeError(f"rollout of step {got_step} failed: {groups}") from groups
            if on_groups is not None:
                on_groups(step, groups)
            metrics = _train_on(trainer, engines, groups, cfg, step, r0, r1)
            trained.release()
            history.append(metrics)
            if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:
                trainer.save(checkpoint_dir, {"next_step": step + 1})
            if on_step is not None:
                on_step(metrics)
            if stop.is_set():
                break
    finally:
        stop.set()
        producer.join()  # an in-flight rollout finishes (episodes have timeouts); its batch is dropped
    return history


def _next_batch(batches: queue.Queue, stop: threading.Event, producer: threading.Thread):
    while True:
        try:
            return batches.get(timeout=0.5)
        except queue.Empty:
            if stop.is_set() or not producer.is_alive() and batches.empty():
                return None, None, 0.0, 0.0


def _train_on(trainer, engines, groups, cfg: LoopConfig, step: int, r0: float, r1: float) -> dict:
    t1 = time.time()
    ran = [t for g in groups for t in g if t.error is None]
    rewards = [t.reward for t in ran]
    correct = [bool(t.info["correct"]) for t in ran if "correct" in t.info]
    batch, info = batch_from_groups(groups, cfg.advantage, on_failed=cfg.on_failed, on_truncated=cfg.on_truncated)
    stats = trainer.train_step(batch)
    t2 = time.time()
    reports = sync_engines(trainer, engines, cfg.sync_tol)
    corr, replay = stats["correction"], stats["replay"]
    return {
        "step": step, "version": stats["version"], "mode": cfg.mode,
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "correct_rate": sum(correct) / len(correct) if correct else None,
        **info, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
        "gate_pass_ratio": corr["gate_pass_ratio"], "stale_dropped": corr["stale_dropped"], "band_dropped": corr["band_dropped"],
        "veto_dropped": corr.get("veto_dropped", 0),
        "kl_k1": corr["kl_k1"], "kl_k3": corr["kl_k3"], "max_abs_delta_p": corr["max_abs_delta_p"],
        "staleness_hist": corr["staleness_hist"], "tokens_per_version": corr["tokens_per_version"],
        "is_weight_hist": corr["is_weight_hist"],
        "replay_disagree_rate": replay["disagree_rate"], "replay_disagree_per_layer": replay["disagree_rate_per_layer"],
        "replay_fallback": sum(replay["fallback"]), "kl_k3_live": stats["kl_k3_live"], "kl_ref": stats["kl_ref"],
        "sync_max_abs_diff": max(r.probe_max_abs_diff for r in reports),
        "rollout_s": r1 - r0, "train_s": t2 - t1, "sync_s": time.time() - t2, "step_s": time.time() - min(r0, t1),
        "rollout_start": r0, "rollout_end": r1, "train_start": t1, "train_end": t2,
    }
