"""The RL loop (sync mode): rollout -> training tensors -> advantages -> one trainer step ->
weight sync with the post-sync check, repeated. Metrics per step go to a list (and the
caller's callback), so a notebook or a script can plot them.

Async mode (rollout of step k+1 overlapping training of step k, bounded by max_staleness)
builds on the same pieces and is not here yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from .agents import Task
from .rollout.actor import sync_weights
from .rollout.engine import probe_ids
from .tokens import Trajectory, training_tensors
from .trainer.losses import AdvantageInput, get_advantage


@dataclass
class LoopConfig:
    steps: int = 10
    prompts_per_step: int = 16
    group_size: int = 8
    advantage: str = "grpo"
    sync_tol: float = 1e-3
    initial_sync: bool = True  # first make the engines serve the trainer's weights


def batch_from_groups(groups: list[list[Trajectory]], advantage: str, pad_id: int = 0) -> tuple[dict, dict]:
    """Training tensors for every segment of every trajectory that ran without error, with
    advantages from the registered estimator (each segment gets its episode's reward)."""
    segments, rewards, group_index = [], [], []
    for gi, group in enumerate(groups):
        for t in group:
            if t.error is not None:
                continue
            for s in t.segments:
                if any(s.loss_mask):
                    segments.append(s)
                    rewards.append(t.reward)
                    group_index.append(gi)
    if not segments:
        raise RuntimeError("no trainable segment in this batch: every episode failed or sampled nothing")
    batch = training_tensors(segments, pad_id)
    x = AdvantageInput(torch.tensor(rewards, dtype=torch.float32), torch.tensor(group_index), batch["loss_mask"])
    batch["advantages"] = get_advantage(advantage)(x).float()
    failed = sum(t.error is not None for g in groups for t in g)
    return batch, {"segments": len(segments), "failed_episodes": failed}


def run_sync(rollout, trainer, engines: list, task_source: Callable[[int, int], list[Task]], cfg: LoopConfig,
             on_step: Callable[[dict], None] | None = None, progress: bool = True,
             checkpoint_dir: str | None = None, checkpoint_every: int = 0) -> list[dict]:
    """`task_source(n, step)` gives the prompts of each step (so the data position is the step).
    With `checkpoint_dir`, a checkpoint found there is resumed from (the next step is the one
    after it: no step is repeated or skipped), and one is written every `checkpoint_every`
    steps. Returns one metrics dict per step run."""
    import os

    import ray
    from tqdm.auto import tqdm

    history, first = [], 0
    if checkpoint_dir and os.path.isfile(os.path.join(checkpoint_dir, "run_state.json")):
        first = trainer.restore(checkpoint_dir)["next_step"]
    # one version counter for trainer and engines; it only ever increases
    engine_version = max(i["version"] for i in ray.get([e.info.remote() for e in engines]))
    trainer.version = max(engine_version, trainer.version)
    if cfg.initial_sync:  # rollouts must come from the trainer's weights, not whatever the engines hold
        trainer.version += 1
        sync_weights(engines, trainer.state_dict(), version=trainer.version,
                     expected_probe=trainer.probe(probe_ids(trainer.vocab_size)), tol=cfg.sync_tol)
    for step in tqdm(range(first, cfg.steps), desc="RL steps", initial=first, total=cfg.steps, disable=not progress):
        t0 = time.perf_counter()
        groups = rollout.run_groups(task_source(cfg.prompts_per_step, step), cfg.group_size, progress=False)
        t_rollout = time.perf_counter() - t0
        ran = [t for g in groups for t in g if t.error is None]
        rewards = [t.reward for t in ran]
        correct = [bool(t.info["correct"]) for t in ran if "correct" in t.info]
        batch, info = batch_from_groups(groups, cfg.advantage)
        t1 = time.perf_counter()
        stats = trainer.train_step(batch)
        t_train = time.perf_counter() - t1
        sd = trainer.state_dict()
        reports = sync_weights(engines, sd, version=stats["version"], expected_probe=trainer.probe(probe_ids(trainer.vocab_size)),
                               tol=cfg.sync_tol)
        corr = stats["correction"]
        metrics = {
            "step": step, "version": stats["version"], "reward_mean": sum(rewards) / max(len(rewards), 1),
            "correct_rate": sum(correct) / len(correct) if correct else None,
            "episodes": len(rewards), **info, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
            "gate_pass_ratio": corr["gate_pass_ratio"], "kl_k3": corr["kl_k3"], "max_abs_delta_p": corr["max_abs_delta_p"],
            "replay_disagree": stats["replay_disagree"], "sync_max_abs_diff": max(r.probe_max_abs_diff for r in reports),
            "rollout_s": t_rollout, "train_s": t_train, "step_s": time.perf_counter() - t0,
        }
        history.append(metrics)
        if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0:
            trainer.save(checkpoint_dir, {"next_step": step + 1})
        if on_step is not None:
            on_step(metrics)
    return history
