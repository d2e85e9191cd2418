"""The RL loop: rollout -> training tensors -> advantages -> one trainer step -> weight sync
with the post-sync check, repeated. Metrics per step go to a list (and the caller's callback),
so a notebook or a script can plot them.

Two modes (LoopConfig.mode):
- "sync": the rollout of step k starts after step k-1 is trained and synced. Every token is
  sampled by the weights it is trained against (staleness 0).
- "async" (continuous): a rollout thread keeps groups in flight on every runner while the
  trainer trains (GroupStream), group by group, with no per-step barrier: a step trains on the
  next prompts_per_step groups in the order they started (async_order "start"; "finish": the
  first to finish, where long episodes are overtaken and drop out). Weight syncs land
  mid-episode (engines pause in keep mode), so an episode's tokens can span versions; each
  token keeps the version it was sampled by, and correction.py weights and gates them per token. A group whose oldest token is more
  than `async_lag` versions behind the trainer is not admitted to a batch (groups_dropped_stale);
  the trainer's max_staleness must allow async_lag (checked up front).
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

import ray
import torch

from .agents import Task
from .evaluation import is_correct, reports_correct
from .rollout.actor import sync_weights
from .rollout.engine import probe_ids
from .rollout.router import engine_info, engine_lost
from .rollout.runner import RolloutStopped
from .tokens import UNEXPECTED_SEALS, Trajectory, segment_stats, training_tensors
from .trainer.fsdp import PartialUpdate
from .trainer.losses import ADVANTAGES, EQUAL_REWARDS_TOL, GROUP_ADVANTAGES, PER_TOKEN_ADVANTAGES, AdvantageInput, get_advantage

MODES = ("sync", "async")
# What a step does with an episode that failed (the agent raised or timed out, an engine died)
# or was truncated (its conversation outgrew the context, a reply ran out of the policy's
# max_tokens, or its Env truncated it): leave it out of the batch ("drop": out of its group's
# statistics too), keep it with the reward it got ("keep") or with reward 0 ("zero"), or count
# its reward in its group's statistics but train on none of its tokens ("mask": DAPO's overlong
# filtering, TRL's mask_truncated_completions; "drop" instead lifted the baseline of a group whose
# truncated run-ons were its failures, and read a group of one success among them as zero variance).
EPISODE_RULES = ("drop", "keep", "zero", "mask")


@dataclass
class LoopConfig:
    steps: int = 10
    prompts_per_step: int = 16
    group_size: int = 8
    advantage: str = "grpo"
    sync_tol: float = 1e-3
    initial_sync: bool = True  # first make the engines serve the trainer's weights
    mode: str = "sync"
    # async: how many versions behind the trainer a group's oldest token may be when it trains
    # (older groups are not admitted); the rollout starts at most (1 + async_lag) steps of groups
    # ahead of the steps trained
    async_lag: int = 1
    # async: which finished groups a step trains. "start": the next prompts_per_step in the order they
    # started, so a slow group holds its step back but is never overtaken (within async_lag by
    # construction; an episode that hangs stalls training until its episode timeout). "finish":
    # the first to finish (no waiting; a group overtaken past async_lag is not admitted, and the
    # slow groups are the long episodes: a quarter of prompts 15x slower than the rest trained at
    # 1.2% of groups; training then leans to short replies and easy prompts)
    async_order: str = "start"
    # failed episodes carry no reward the agent computed (a crash or a timeout), so by default
    # they leave the batch (the group's baseline is then over those that finished: where timeouts
    # are runaway wrong replies, "zero" scores them instead); truncated ones ran and were scored,
    # so they stay with their reward
    on_failed: str = "drop"
    on_truncated: str = "keep"
    # dynamic sampling (DAPO): a group whose rewards (as the batch sees them: episode rules and
    # overlong shaping applied) are all equal has zero advantage and teaches nothing; it is
    # filtered and replaced by the groups of freshly drawn tasks, in up to `dynamic_sampling_rounds`
    # more rollouts per step (metrics: ds_filtered_groups, ds_rounds, ds_kept_groups, ds_short;
    # ds_reward_mean_sampled: the agents' rewards of every finished episode rolled out, filtered
    # ones included, counted as reward_mean counts them)
    dynamic_sampling: bool = False
    dynamic_sampling_rounds: int = 2
    # overlong reward shaping (DAPO): an episode of L sampled tokens gets a penalty rising linearly
    # from 0 at L = overlong_max_tokens - overlong_band to overlong_coef at L = overlong_max_tokens
    # (and overlong_coef beyond), subtracted from its reward before advantages (metrics:
    # overlong_penalized, overlong_penalty_mean); the recorded reward stays the agent's
    overlong_shaping: bool = False
    overlong_max_tokens: int = 0
    overlong_band: int = 0
    overlong_coef: float = 1.0
    # evaluation on held-out tasks every `eval_every` steps (0: never), after the step's weight
    # sync: `eval_n` samples per task at the policy's temperature (pass@1, pass@k for k = 1, 2,
    # 4, ..., eval_n) and, with eval_greedy, one greedy episode per task (greedy pass@1); merged
    # into that step's metrics as eval_* (workbench.evaluation). Its episodes never train.
    eval_every: int = 0
    eval_n: int = 4
    eval_greedy: bool = True
    # on-policy distillation (advantage="distill"): the teacher, a model name or checkpoint
    # directory with the policy's tokenizer, served frozen on its own engine (the session starts
    # it; loop.run(teacher_engines=...)). Each step's sampled tokens are scored by it
    # (teacher_logprobs) and every token's advantage is log p_teacher - log p_student, the
    # negative per-token reverse KL (metrics: distill_reverse_kl)
    teacher: str | None = None

    def episode_rules(self) -> dict:
        """The keyword arguments of episode_reward / zero_variance / trained_episodes this config sets."""
        return {"on_failed": self.on_failed, "on_truncated": self.on_truncated, "overlong": self.overlong()}

    def overlong(self) -> tuple | None:
        """(max_tokens, band, coef) for batch_from_groups when overlong shaping is on, else None."""
        return (self.overlong_max_tokens, self.overlong_band, self.overlong_coef) if self.overlong_shaping else None

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"LoopConfig.mode {self.mode!r} unknown; choose one of {MODES}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"LoopConfig.advantage {self.advantage!r} unknown; registered: {sorted(ADVANTAGES)}")
        if self.advantage in PER_TOKEN_ADVANTAGES and not self.teacher:
            raise ValueError(f"LoopConfig.advantage {self.advantage!r} needs per-token teacher log-probs: set LoopConfig.teacher "
                             f"(a model name or checkpoint directory, served on its own engine), or use a reward-based "
                             f"estimator ({sorted(set(ADVANTAGES) - PER_TOKEN_ADVANTAGES)})")
        if self.advantage in PER_TOKEN_ADVANTAGES and self.dynamic_sampling:
            # the filter drops groups of equal rewards, but a per-token estimator's signal is the
            # teacher's log-probs, not the reward: it would discard (and redraw) groups that teach
            raise ValueError(f"LoopConfig.dynamic_sampling filters groups by reward variance, but advantage "
                             f"{self.advantage!r} learns from the teacher's per-token log-probs, not rewards: "
                             f"turn dynamic_sampling off")
        if self.advantage in PER_TOKEN_ADVANTAGES and self.overlong_shaping:
            # it shapes the reward, which a per-token estimator never reads: the metrics reported a
            # penalty that changed no advantage
            raise ValueError(f"LoopConfig.overlong_shaping penalises the reward, but advantage {self.advantage!r} learns "
                             f"from the teacher's per-token log-probs, not rewards: turn overlong_shaping off")
        if self.async_order not in ("start", "finish"):
            raise ValueError(f"LoopConfig.async_order {self.async_order!r} unknown: 'start' (groups train in the order "
                             f"they started) or 'finish' (the first to finish; slow groups drop out)")
        for name in ("on_failed", "on_truncated"):
            if getattr(self, name) not in EPISODE_RULES:
                raise ValueError(f"LoopConfig.{name} {getattr(self, name)!r} unknown; choose one of {EPISODE_RULES}")
        for name in ("steps", "prompts_per_step", "group_size", "async_lag", "dynamic_sampling_rounds", "eval_every",
                     "eval_n"):
            low = 1 if name in ("prompts_per_step", "group_size", "async_lag", "eval_n") else 0
            if getattr(self, name) < low:
                raise ValueError(f"LoopConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if self.group_size < 2 and self.advantage in GROUP_ADVANTAGES:
            # a group of one is its own baseline: every advantage 0, every step an update of nothing (the
            # no-signal warning came 5 steps later and blamed the rewards)
            raise ValueError(f"LoopConfig.group_size {self.group_size}: advantage {self.advantage!r} compares each "
                             f"episode with the others of its group, so a group of one gives every advantage 0; use "
                             f"group_size >= 2")
        if not (isinstance(self.sync_tol, (int, float)) and 0 <= self.sync_tol < math.inf):
            raise ValueError(f"LoopConfig.sync_tol must be a finite number >= 0 (the probe's largest log-prob gap "
                             f"after a sync), got {self.sync_tol!r}")
        if not (isinstance(self.overlong_coef, (int, float)) and 0 <= self.overlong_coef < math.inf):
            # a negative one paid a bonus for length (overlong_penalty_mean read negative)
            raise ValueError(f"LoopConfig.overlong_coef must be a finite number >= 0, got {self.overlong_coef!r}")
        if self.overlong_shaping and not 0 < self.overlong_band <= self.overlong_max_tokens:
            raise ValueError(f"LoopConfig.overlong_shaping needs 0 < overlong_band <= overlong_max_tokens (the penalty "
                             f"rises over the last overlong_band tokens before overlong_max_tokens), got overlong_band="
                             f"{self.overlong_band}, overlong_max_tokens={self.overlong_max_tokens}")


def overlong_penalty(length: int, max_tokens: int, band: int, coef: float = 1.0) -> float:
    """DAPO's soft overlong penalty: 0 up to max_tokens - band sampled tokens, then rising
    linearly to `coef` at max_tokens, and `coef` beyond."""
    start = max_tokens - band
    return 0.0 if length <= start else coef * min(1.0, (length - start) / band)


def sampled_tokens(t: Trajectory) -> int:
    """The tokens the policy sampled in an episode (every turn, every segment)."""
    return int(sum(sum(s.loss_mask) for s in t.segments))


def episode_reward(t: Trajectory, on_failed: str = "drop", on_truncated: str = "keep",
                   overlong: tuple | None = None) -> tuple[str, float | None, float]:
    """(rule, reward the batch trains on or None when dropped, overlong penalty) of one episode:
    the episode rules (EPISODE_RULES) first, then the overlong penalty (`overlong`: (max_tokens,
    band, coef), LoopConfig.overlong()) subtracted from a kept reward. An evaluation episode
    (info["eval"]) is refused: evaluation episodes never enter a training batch."""
    if t.info.get("eval"):
        raise ValueError(f"episode {t.episode_id} is an evaluation episode (info['eval']): evaluation episodes never "
                         f"enter a training batch")
    failed = t.error is not None
    truncated = bool(getattr(t, "truncated", False)) and not failed
    rule = on_failed if failed else on_truncated if truncated else "keep"
    if rule == "drop":
        return rule, None, 0.0
    penalty = overlong_penalty(sampled_tokens(t), *overlong) if overlong else 0.0
    return rule, (0.0 if rule == "zero" else float(t.reward)) - penalty, penalty


def zero_variance(group: list[Trajectory], on_failed: str = "drop", on_truncated: str = "keep",
                  overlong: tuple | None = None, tol: float = EQUAL_REWARDS_TOL) -> bool:
    """True when the group teaches nothing: the rewards the batch would train it on (episode_reward)
    are all equal (or fewer than two are kept), so every advantage is 0; or no episode it trains on
    (not masked) has a reward off the group's mean, so every trained advantage is 0 (a group of
    masked run-ons with rewards 0, 0.5, 1 has variance but no row to train; nor has a kept episode
    without a trainable token: a runner that died before the first turn, kept with on_failed="keep")."""
    kept = [(rule, r, t) for t in group for rule, r, _ in [episode_reward(t, on_failed, on_truncated, overlong)]
            if r is not None]
    rewards = [r for _, r, _ in kept]
    if len(rewards) < 2 or max(rewards) - min(rewards) <= tol:
        return True
    mean = sum(rewards) / len(rewards)
    return all(abs(r - mean) <= tol for rule, r, t in kept
               if rule != "mask" and any(any(s.loss_mask) for s in t.segments))


class NothingToTrain(RuntimeError):
    """A batch without one trainable segment (every episode failed and was dropped, say): `info`
    holds batch_from_groups' counts. The loop records such a step without an update."""

    def __init__(self, message: str, info: dict):
        super().__init__(message)
        self.info = info


def batch_from_groups(groups: list[list[Trajectory]], advantage: str, pad_id: int = 0, on_failed: str = "drop",
                      on_truncated: str = "keep", overlong: tuple | None = None,
                      teacher: dict | None = None, temperature: float | None = None, correction=None) -> tuple[dict, dict]:
    """Training tensors (one row per trainable segment) with advantages computed over EPISODES:
    the registered estimator sees one reward per episode and its group, and every segment of
    an episode gets that episode's advantage (an episode sealed into five segments weighs once
    in its group's statistics). `batch["episode_tokens"]` holds each row's episode's trainable
    tokens, so sequence-level aggregations average over episodes too. Failed and truncated
    episodes follow `on_failed` / `on_truncated` (EPISODE_RULES); `overlong` (max_tokens, band,
    coef) shapes rewards (episode_reward). A per-token estimator (distill) instead gets each
    row's behaviour log-probs and `teacher` (teacher_logprobs: id(segment) -> the teacher's
    log-prob of each of its tokens), and info["distill_reverse_kl"] is the mean over sampled
    tokens of log p_student - log p_teacher. `temperature`: the trainer's; a segment sampled at
    another (its stats["temperatures"], stamped by the loopback server) is refused: every ratio
    would be biased (groups from another Rollout, an eval one, an older session). `correction`: the
    trainer's CorrectionConfig; a segment sampled with top_p < 1 (stats["top_ps"]) is refused where it
    (or distillation) needs full-vocabulary log-probs, as loop.run refuses the rollout's sampling."""
    segments, seg_episode, rewards, group_index, row_keys = [], [], [], [], []
    info = {"episodes": 0, "segments": 0, "failed_episodes": 0, "truncated_episodes": 0, "dropped_episodes": 0,
            "masked_episodes": 0, "sampling_overridden": 0,
            # groups whose rewards are all equal: advantage 0, they teach nothing (with every group
            # so, the step's gradient is 0: a policy that earns every group the same reward, e.g.
            # 0, stays as it is)
            "zero_variance_groups": sum(zero_variance(g, on_failed, on_truncated, overlong) for g in groups)}
    # invariant 1's measurements, over every episode of the step (the audit's, which read them only
    # from trajectories/: a run directory copied without those files audited clean)
    info.update(identity_counts([t for g in groups for t in g]))
    penalties = []
    for gi, group in enumerate(groups):
        for t in group:
            failed = t.error is not None
            info["failed_episodes"] += failed
            info["truncated_episodes"] += bool(getattr(t, "truncated", False)) and not failed
            info["sampling_overridden"] += sum(s.stats.get("sampling_overridden", 0) for s in t.segments)
            rule, reward, penalty = episode_reward(t, on_failed, on_truncated, overlong)
            if rule == "drop":
                info["dropped_episodes"] += 1
                continue
            info["masked_episodes"] += rule == "mask"  # its reward in its group's statistics, no row of its own
            for si, s in enumerate(t.segments if rule != "mask" else ()):
                if any(s.loss_mask):
                    segments.append(s)
                    seg_episode.append(len(rewards))
                    row_keys.append((t.episode_id, si))
            rewards.append(reward)
            penalties.append(penalty)
            group_index.append(gi)
    if overlong:
        info["overlong_penalized"] = sum(p > 0 for p in penalties)
        info["overlong_penalty_mean"] = sum(penalties) / max(len(penalties), 1)
    if not segments:  # (its episodes counted as a trained step's are: masked ones too)
        info.update(episodes=len(rewards))
        raise NothingToTrain(f"no trainable segment in this batch: every episode was dropped, masked or sampled nothing "
                             f"({info})", info)
    if temperature is not None:
        other = sorted({t for s in segments for t in s.stats.get("temperatures", ()) if abs(t - temperature) > 1e-6})
        if other:
            raise ValueError(f"these groups were sampled at temperature {other}, but the trainer computes log-probs at "
                             f"{temperature}: every importance ratio would be biased. Train on groups sampled by this "
                             f"session's rollout (WorkbenchConfig.temperature sets both)")
    top_p = min((p for s in segments for p in s.stats.get("top_ps", ())), default=1.0)
    if correction is not None and top_p < 1.0:  # (groups trained through wb.trainer.step too, not only a run's)
        correction.check_sampling(top_p=top_p)
    batch = training_tensors(segments, pad_id)
    index = torch.tensor(seg_episode)
    # each episode's trainable tokens (its rows' together): a batch-wide advantage scale and the
    # sequence-level aggregations count by them
    tokens_per_episode = torch.zeros(len(rewards)).index_add_(0, index, batch["loss_mask"].sum(-1).float())
    if advantage in PER_TOKEN_ADVANTAGES:  # per token, per row: the teacher's log-probs of the row's tokens
        # here, not only where a run starts: wb.trainer.step() / batch() build their batches here too
        for t in sorted({t for s in segments for t in s.stats.get("temperatures", ())} |
                        {1.0 if temperature is None else temperature}):
            check_distill_sampling(t, top_p)
        missing = [i for i, s in enumerate(segments) if teacher is None or id(s) not in teacher]
        if missing:
            raise ValueError(f"advantage {advantage!r} needs the teacher's log-probs of every trainable segment "
                             f"(loop.teacher_logprobs); {len(missing)} of {len(segments)} have none")
        lp_teacher = torch.zeros_like(batch["behaviour_logprobs"])
        for i, s in enumerate(segments):
            lp_teacher[i, :len(s)] = torch.tensor(teacher[id(s)], dtype=torch.float32)
        m = batch["loss_mask"]
        x = AdvantageInput(torch.tensor(rewards, dtype=torch.float64)[index], index, m,
                           logprobs=batch["behaviour_logprobs"], teacher_logprobs=lp_teacher)
        batch["advantages"] = get_advantage(advantage)(x).float() * m
        # the trainer applies the estimator again on its own pi_old (TrainerWorker.train_step): on a
        # stale token (async) the behaviour log-prob's advantage added grad KL(pi || behaviour) to
        # the update, pushing the policy away from whichever version sampled it
        # (the estimator itself, not its name: one registered in a notebook is in the driver's
        # registry only, and Ray sends a function to the trainer's processes by value)
        batch["teacher_logprobs"], batch["per_token_advantage"] = lp_teacher * m, get_advantage(advantage)
        info["distill_reverse_kl"] = float(((batch["behaviour_logprobs"] - lp_teacher) * m).sum() / m.sum().clamp(min=1))
    else:
        # one row per episode (an episode without trainable tokens still counts in its group's baseline),
        # with the trainable tokens its advantage lands on (a batch-wide scale is over tokens)
        x = AdvantageInput(torch.tensor(rewards, dtype=torch.float64), torch.tensor(group_index),
                           torch.ones(len(rewards), 1),
                           tokens=tokens_per_episode)
        per_episode = get_advantage(advantage)(x).float()[:, 0]
        batch["advantages"] = per_episode[index][:, None] * batch["loss_mask"]
    # trainable tokens whose advantage is not 0: none, and the rewards moved nothing this step
    info["signal_tokens"] = int(((batch["advantages"] != 0) & batch["loss_mask"].bool()).sum())
    batch["episode_tokens"] = tokens_per_episode[index]
    # each row's (episode id, segment index): what the token journey finds a row by (by content, two
    # episodes of one task with the same reply in two groups matched the first, its advantage shown).
    # Not a tensor: the trainer's split leaves it with the driver
    batch["row_keys"] = row_keys
    info.update(episodes=len(rewards), segments=len(segments))
    return batch, info


def draw_tasks(source, n: int, position: int, chunk: int) -> tuple[list[tuple[int, Task]], int]:
    """n tasks from data position `position`, each with its position, and the next position. A
    positional source (take(position, n), e.g. data.TaskDataset) gives them; a plain `source(n, seed)` is read as
    one stream of chunks of `chunk` (prompts_per_step) tasks, the chunk starting at position s
    being source(chunk, seed=s): the task at position p is item p - s of its chunk. So a step's
    draw, dynamic sampling's refills, the async loop's draws and a continued run's take the task
    of a position from the same place, and none twice (sync steps were seeded by the step and
    refills by a range of their own, so a sync run after an async one, whose positions ran ahead
    of its steps, drew again tasks the async steps had trained). Seeded by its start, a chunk of
    another size (prompts_per_step changed between runs) takes the seeds of positions not reached
    yet (mid-chunk, the seed of the chunk it continues: from a source whose n tasks are the head
    of its n + k, the very tasks not yet drawn). Positions past what a source gives for its chunk
    hold no task: the draw goes on at the next chunk."""
    if hasattr(source, "take"):
        tasks = list(source.take(position, n))
        if len(tasks) < n:
            # a finite source of the user's that ran out: sync steps trained fewer groups, then none
            # (recorded as steps with no trainable episode), and the async loop raised 'pop from empty list'
            raise ValueError(f"the task source's take({position}, {n}) gave {len(tasks)} task(s): take(position, n) must "
                             f"return n tasks (data.TaskDataset cycles its epochs; a finite source has run out)")
        return list(enumerate(tasks, position)), position + len(tasks)
    out: list[tuple[int, Task]] = []
    while len(out) < n:
        start = position - position % chunk
        drawn = list(source(chunk, start))[:chunk]
        if not drawn:
            raise ValueError(f"the task source gave no task for {chunk} asked (seed {start}): tasks(n, seed) must "
                             f"return n tasks")
        taken = drawn[position - start: position - start + n - len(out)]
        out += enumerate(taken, position)
        position += len(taken)
        if position - start >= len(drawn):  # the chunk is used up (a short one's missing positions hold no task)
            position = start + chunk
    return out, position


def collect_groups(rollout, source, cfg: "LoopConfig", position: int,
                   stop: threading.Event | None = None) -> tuple[list, dict, int]:
    """The groups a step trains on, drawn from data position `position`: (groups, stats,
    next position). With cfg.dynamic_sampling, groups of zero reward variance (zero_variance)
    are filtered and replaced by the groups of freshly drawn tasks, up to
    cfg.dynamic_sampling_rounds more rollouts; a step still short trains on the groups it kept
    (ds_short counts the missing ones), and one left with none trains on its first draw (every
    advantage 0: no signal, but the step and its statistics happen). The groups filtered out are
    stats["_untrained"] (untrained_statistics counts them with the step). A `stop` set meanwhile
    raises RolloutStopped holding every group finished so far."""
    n = cfg.prompts_per_step
    drawn, position = draw_tasks(source, n, position, n)
    groups = rollout.run_groups([t for _, t in drawn], cfg.group_size, progress=False, stop=stop)
    if not cfg.dynamic_sampling:
        return groups, {}, position
    rule = cfg.episode_rules()
    kept = [g for g in groups if not zero_variance(g, **rule)]
    filtered, rounds, sampled = len(groups) - len(kept), 0, list(groups)
    while len(kept) < n and rounds < cfg.dynamic_sampling_rounds:
        rounds += 1
        drawn, position = draw_tasks(source, n - len(kept), position, n)
        try:
            more = rollout.run_groups([t for _, t in drawn], cfg.group_size, progress=False, stop=stop)
        except RolloutStopped as e:
            raise RolloutStopped(sampled + e.groups) from None
        sampled += more
        good = [g for g in more if not zero_variance(g, **rule)]
        filtered += len(more) - len(good)
        kept += good
    trained = kept or groups
    if not kept:  # the first draw trains after all: its groups are not filtered out (async counts them so too)
        filtered -= len(groups)
    stats = {"ds_filtered_groups": filtered, "ds_rounds": rounds, "ds_kept_groups": len(kept), "ds_short": n - len(kept),
             **sampled_statistics(sampled), "_untrained": [g for g in sampled if not any(g is t for t in trained)]}
    return trained, stats, position


def sampled_statistics(sampled: list[list[Trajectory]]) -> dict:
    """Under dynamic sampling, reward_statistics over every group rolled out, the filtered ones
    too: reward_mean and correct_rate are over the trained groups, and the filter drops every
    group all right (no variance), so correct_rate fell as the policy got better (0.50 logged
    where 0.88 were right)."""
    stats = reward_statistics(sampled)
    return {"ds_reward_mean_sampled": stats["reward_mean"] if sampled else math.nan,
            "ds_correct_rate_sampled": stats["correct_rate"]}


def untrained_statistics(untrained: list[list[Trajectory]]) -> dict:
    """What a step's record adds for the groups it rolled out and did not train (dynamic
    sampling's filter, the async gate's stale groups; their trajectories go to untrained/): their
    episodes, failed and truncated episodes, and their token-identity counts, added to the step's own
    (identity_mismatch & co. count every episode the step sampled). Left out, filtering hid both:
    a group whose episodes all failed is zero-variance under on_failed="drop" (filtered: an agent
    crashing on a third of the tasks logged no failure), and a broken record in a group all right
    was never counted."""
    episodes = [t for g in untrained for t in g]
    return {"untrained_episodes": len(episodes), "untrained_failed_episodes": sum(t.error is not None for t in episodes),
            "untrained_truncated_episodes": sum(bool(getattr(t, "truncated", False)) and t.error is None for t in episodes),
            **identity_counts(episodes)}


def identity_counts(episodes: list[Trajectory]) -> dict:
    """Invariant 1's counts over episodes' segments: identity_mismatch, retokenization_drift, unexpected_seals."""
    totals = segment_stats([s for t in episodes for s in t.segments])
    return {"identity_mismatch": totals["identity_mismatch"], "retokenization_drift": totals["retokenization_drift"],
            "unexpected_seals": sum(n for reason, n in totals["seals"].items() if reason in UNEXPECTED_SEALS)}


def _with_untrained(info: dict, untrained: list[list[Trajectory]]) -> dict:
    """The batch's counts (batch_from_groups' info) with the untrained groups' added (untrained_statistics)."""
    if not untrained:
        return info
    extra = untrained_statistics(untrained)
    return {**info, **extra, **{k: info.get(k, 0) + extra[k] for k in ("identity_mismatch", "retokenization_drift", "unexpected_seals")}}


def teacher_segments(groups: list[list[Trajectory]], cfg: "LoopConfig") -> list:
    """The segments a batch trains on, which the teacher scores: those with sampled tokens of the
    episodes the episode rules neither drop nor mask (scoring those too cost teacher forwards
    over the longest episodes, the truncated ones, for rows that never train)."""
    return [s for g in groups for t in trained_episodes(g, cfg.episode_rules()) for s in t.segments if any(s.loss_mask)]


def teacher_logprobs(teachers: list, segments: list) -> dict[int, list[float]]:
    """The teacher's log-prob of every token of each segment given the tokens before it, at
    temperature 1 (column 0, which has no context: 0.0), keyed by id(segment): the teacher
    engines' probe_logprobs (prompt log-probs, vLLM or reference), spread round robin."""
    refs = [teachers[i % len(teachers)].probe_logprobs.remote(list(s.token_ids)) for i, s in enumerate(segments)]
    return {id(s): [0.0] + list(lp) for s, lp in zip(segments, ray.get(refs))}


def check_teacher(rollout, cfg: "LoopConfig", teacher_engines: list | None) -> None:
    """A per-token (distillation) advantage needs teacher engines, and the policy sampling at
    temperature 1: the teacher's log-probs are of its unscaled distribution, and the reverse KL
    compares them with the student's sampled log-probs."""
    if cfg.advantage not in PER_TOKEN_ADVANTAGES:
        return
    if not teacher_engines:
        raise ValueError(f"advantage {cfg.advantage!r} needs a teacher engine (loop.run(teacher_engines=...); a session "
                         f"starts one for LoopConfig.teacher)")
    sampling = getattr(rollout, "sampling", None)
    if sampling is not None:
        check_distill_sampling(sampling.temperature, sampling.top_p)


def check_distill_sampling(temperature: float, top_p: float = 1.0) -> None:
    """On-policy distillation's advantage is log p_teacher - log p_student of each sampled token:
    the teacher's log-probs are of its whole, unscaled distribution, so the student's must be too
    (at temperature 0.7 a teacher equal to the student read as a reverse KL of 0.066 and pulled the
    student toward a flattened teacher; at top_p 0.9 every advantage was offset by log(kept mass)).
    Whether or not the importance correction is on (its own top_p check is skipped when off)."""
    if abs(temperature - 1.0) > 1e-6:
        raise ValueError(f"on-policy distillation compares the student's sampled log-probs with the teacher's at "
                         f"temperature 1; the policy samples at temperature {temperature:g} (set temperature=1.0)")
    if top_p < 1.0:
        raise ValueError(f"on-policy distillation needs the student's log-probs over the whole vocabulary, as the "
                         f"teacher's are; the policy samples with top_p={top_p} (the engine reports them "
                         f"renormalized over the kept tokens): sample with top_p=1.0")


class EnginesLost(RuntimeError):
    """Every rollout engine is dead."""


def drop_dead_engines(engines: list, lost: list) -> None:
    """Remove the engines in `lost` ((engine, error) pairs) from `engines`, IN PLACE: the list is
    the session's (or the caller's) list of live engines, so everyone holding it stops syncing and
    stopping a dead actor. The runners' routers find out on their own (their next request to it
    fails and is retried elsewhere). Raises EnginesLost when none is left."""
    import sys

    for engine, err in lost:
        if engine in engines:
            engines.remove(engine)
            # killed too: an ActorUnavailableError may be transient (a network blip between nodes),
            # and an engine no longer synced but still alive would go on serving the runners'
            # routers (each holds its own list) ever older weights; dead, they fail over
            try:
                ray.kill(engine)
            except Exception:
                pass
            first = " ".join(str(err).split())[:300]
            print(f"workbench: a rollout engine died and was dropped ({len(engines)} left): {first}", file=sys.stderr)
    if not engines:
        raise EnginesLost(f"every rollout engine is dead (last error: {lost[-1][1] if lost else '?'}); "
                          f"the run cannot continue without one")


def engines_version(engines: list, lost: list | None = None, newest: bool = True) -> int:
    """The newest policy version any live engine serves (`newest=False`: the oldest verified one,
    what decides whether every engine needs a sync: after a sync that failed part-way the newest
    says none does, and an engine whose probe check failed is tagged with the version it failed
    at). Dead engines are dropped from `engines` (drop_dead_engines) and added to `lost` when given."""
    refs = [e.info.remote() for e in engines]
    versions, dead = [], []
    for e, r in zip(list(engines), refs):
        try:
            info = engine_info(e, r)  # (unavailable: asked again before it is taken as lost)
            versions.append(info["version"] if newest else info.get("verified_version", info["version"]))
        except Exception as err:
            if not engine_lost(err):
                raise
            dead.append((e, err))
    drop_dead_engines(engines, dead)
    if lost is not None:
        lost += dead
    return max(versions) if newest else min(versions)


def sync_engines(trainer, engines: list, tol: float, lost: list | None = None) -> list:
    """Push the trainer's current weights to every engine under the trainer's version and check
    each engine's probe against the trainer's own log-probs. By NCCL broadcast once
    trainer.init_nccl_sync(engines) ran (GPU); else the CPU path (a state dict through Ray), where
    an engine found dead is dropped from `engines` (drop_dead_engines; added to `lost` when given)
    and the live ones are synced. (The NCCL group includes every engine: one missing or dead is
    refused before any broadcast and breaks the session's training, WeightSyncBroken.)"""
    if getattr(trainer, "nccl", None) is not None:
        expected = trainer.probe(probe_ids(trainer.vocab_size))
        return trainer.sync_weights_nccl(engines, trainer.version, expected, tol)
    # the engines load the gathered weights while the ranks compute the expected probe (a reference
    # each engine awaits only for its check): the trainer's probe is off the sync's critical path
    weights, expected, ranks = trainer.weights_and_probe(probe_ids(trainer.vocab_size))
    dead: list = []
    reports = sync_weights(list(engines), weights, version=trainer.version, expected_probe=expected, tol=tol, lost=dead)
    ray.get(ranks)  # every rank's part of both collectives (an error of theirs is raised here)
    drop_dead_engines(engines, dead)
    if lost is not None:
        lost += dead
    return reports


def save_checkpoint(trainer, path: str, run_state: dict) -> str:
    """Trainer.save into `path`, atomically: the checkpoint is written beside it (`path.new`,
    complete once its run_state.json exists, which Trainer.save writes last), then swapped in by
    two renames. A process killed at any point leaves a complete checkpoint that
    recover_checkpoint finds: the old one, or the new one."""
    import shutil

    from .trainer.fsdp import durable_dir

    # the link's target: renames of a symlinked checkpoint/ moved the link, and the checkpoint landed
    # beside it, on the run directory's disk (the second save then failed renaming onto the link)
    path = os.path.realpath(path)
    if not _checkpoint_like(path):
        # the swap below deletes what `path` held: a run directory given as the checkpoint's
        # (wb.save(wb.run_dir)) lost its metrics, trajectories and policies
        raise ValueError(f"{path!r} holds something other than a checkpoint ({sorted(os.listdir(path))[:5]}): "
                         f"saving there would delete it; give an empty or new directory, or a checkpoint's")
    new, old = path + ".new", path + ".old"
    if os.path.isdir(new):  # its run_state.json first: a removal killed part-way must not leave a torn
        # directory that still reads as complete (recover_checkpoint would prefer it to `path`)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(new, "run_state.json"))
    shutil.rmtree(new, ignore_errors=True)
    trainer.save(new, run_state)
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(new, path)
    durable_dir(os.path.dirname(path))  # the renames on the disk before the old checkpoint goes
    shutil.rmtree(old, ignore_errors=True)
    return path


def _checkpoint_like(path: str) -> bool:
    """Nothing at `path`, or only what Trainer.save writes there (a checkpoint, complete or torn by
    a kill mid-save or mid-removal): what save_checkpoint / recover_checkpoint may replace."""
    if not os.path.isdir(path):
        return not os.path.exists(path)
    return all(n in ("dcp", "run_state.json") or (n.startswith("rng_rank") and n.endswith(".pt")) for n in os.listdir(path))


def _complete(path: str) -> bool:
    """A checkpoint Trainer.save finished: its run_state.json (written last) and the weights'
    checkpoint index beside it."""
    import json

    try:
        with open(os.path.join(path, "run_state.json")) as f:
            return "next_step" in json.load(f) and os.path.isfile(os.path.join(path, "dcp", ".metadata"))
    except (OSError, ValueError):
        return False


def recover_checkpoint(path: str) -> bool:
    """Finish or undo a save_checkpoint that a killed process left half done; True when a complete
    checkpoint is at `path` afterwards: the newest complete one of `path.new`, `path`, `path.old`
    (a partial `path.new`, killed while being written, is removed)."""
    import shutil

    path = os.path.realpath(path)  # (as save_checkpoint: beside a symlinked checkpoint's target)
    new, old = path + ".new", path + ".old"
    if not (os.path.isdir(new) or os.path.isdir(old)):
        return _complete(path)  # nothing half done (and nothing to remove: `path` may be no checkpoint)
    if not _checkpoint_like(path):
        raise ValueError(f"{path!r} holds something other than a checkpoint ({sorted(os.listdir(path))[:5]}) beside "
                         f"{os.path.basename(new)!r} / {os.path.basename(old)!r}: not replacing it")
    for candidate in (new, path, old):
        if _complete(candidate):
            if candidate != path:
                with contextlib.suppress(FileNotFoundError):  # first: a removal killed part-way leaves no
                    os.unlink(os.path.join(path, "run_state.json"))  # torn `path` that reads as complete
                shutil.rmtree(path, ignore_errors=True)
                os.rename(candidate, path)
            break
    for leftover in (new, old):
        shutil.rmtree(leftover, ignore_errors=True)
    return _complete(path)


class TrainerRankDied(RuntimeError):
    """A trainer rank's actor died; the trainer group was stopped."""

    def __init__(self, message: str, rank: int, actor_id: str):
        super().__init__(message)
        self.rank, self.actor_id = rank, actor_id


class TrainerWatch:
    """Watches the trainer's rank actors while the loop runs. When one rank dies, the others wait
    in their next collective (gloo until its timeout, NCCL for ever) and the driver's call on them
    with it, so at the first death this kills the whole trainer group: the driver's pending calls
    fail at once and the loop raises TrainerRankDied naming the rank.

    How it sees a death without disturbing a step: it keeps one `__ray_ready__` call queued on
    every rank (a rank runs its calls in order, so during a step the call waits behind it); the
    call of a dead rank fails with RayActorError. Ray's ActorUnavailableError is transient (a
    network blip between nodes): a rank is taken as dead only once it stays unavailable for
    `unavailable_grace_s` (taken at once, one blip killed a healthy trainer group of a 2-node run)."""

    def __init__(self, trainer, interval: float = 0.5, unavailable_grace_s: float = 30.0):
        self.workers = list(getattr(trainer, "workers", None) or [])
        self.interval = interval
        self.unavailable_grace_s = unavailable_grace_s
        self.failure: TrainerRankDied | None = None
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="workbench-trainer-watch", daemon=True)

    def __enter__(self) -> "TrainerWatch":
        if self.workers:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _watch(self) -> None:
        pending: dict = {}  # ref -> rank
        unavailable: dict = {}  # rank -> when its pings began to answer ActorUnavailableError
        while not self._stop.is_set():
            for rank, w in enumerate(self.workers):
                if rank not in pending.values():
                    pending[w.__ray_ready__.remote()] = rank
            done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=self.interval)
            for ref in done:
                rank = pending.pop(ref)
                try:
                    ray.get(ref)
                    unavailable.pop(rank, None)
                except ray.exceptions.ActorUnavailableError as e:  # (before RayActorError: its subclass)
                    since = unavailable.setdefault(rank, time.monotonic())
                    if time.monotonic() - since >= self.unavailable_grace_s:
                        self._died(rank, e)
                        return
                except ray.exceptions.RayActorError as e:
                    self._died(rank, e)
                    return
            if len(done) == len(self.workers) or unavailable:  # idle ranks (and unavailable ones) answer at
                self._stop.wait(self.interval)  # once: poll, do not spin

    def _died(self, rank: int, error: BaseException) -> None:
        actor_id = self.workers[rank]._actor_id.hex()
        reason = " ".join(str(error).split())[:400]
        for w in self.workers:  # the whole group: its other ranks would wait in a collective
            try:
                ray.kill(w, no_restart=True)
            except Exception:
                pass
        self.failure = TrainerRankDied(
            f"trainer rank {rank} of {len(self.workers)} (actor {actor_id}) died; the trainer group was stopped (its other "
            f"ranks would wait in a collective). What was recorded before stays recorded; resume from the last checkpoint "
            f"(a session: workbench.connect(run_dir=..., resume=True)). Cause: {reason}", rank, actor_id)
        self._failed.set()

    def explain(self, error: BaseException, wait_s: float = 3.0) -> BaseException:
        """The error to raise for `error`, which a trainer call raised: TrainerRankDied when a rank
        died (waiting up to `wait_s` for the watch to see it; a surviving rank may have failed
        first, e.g. gloo's 'connection closed by peer'), else `error` itself."""
        if self.failure is None and isinstance(error, ray.exceptions.RayError) and self._thread.is_alive():
            self._failed.wait(wait_s)
        return self.failure or error


def check_staleness(trainer, cfg: LoopConfig) -> None:
    max_staleness = trainer.cfg.correction.max_staleness
    # the gate applies even with correction disabled (correction_weights keeps only fresh rows)
    if cfg.mode == "async" and max_staleness is not None and cfg.async_lag > max_staleness:
        raise ValueError(f"async_lag={cfg.async_lag} lets tokens be {cfg.async_lag} versions stale, but the trainer's "
                         f"correction gate drops sequences older than max_staleness={max_staleness}: raise max_staleness "
                         f"or lower async_lag")


def check_sampling(rollout, trainer, engines: list = ()) -> None:
    """The rollout's policy sampling must be what the trainer's log-probs assume (the same
    temperature, a full-vocabulary distribution), and each engine must report the log-probs of
    the distribution it sampled (its info()'s logprobs_mode): CorrectionConfig.check_sampling."""
    sampling = getattr(rollout, "sampling", None)
    if sampling is not None:
        trainer.cfg.correction.check_sampling(top_p=sampling.top_p, temperature=sampling.temperature,
                                              trainer_temperature=trainer.cfg.temperature)
    for ref in [e.info.remote() for e in engines]:
        try:
            info = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
            continue  # a dead engine: the run drops it (engines_version), it samples nothing
        trainer.cfg.correction.check_sampling(logprobs_mode=info.get("logprobs_mode", "processed_logprobs"))


def run(rollout, trainer, engines: list, task_source: Callable[[int, int], list[Task]], cfg: LoopConfig,
        on_step: Callable[[dict], None] | None = None, progress: bool = True,
        checkpoint_dir: str | None = None, checkpoint_every: int = 0,
        stop: threading.Event | None = None, on_groups: Callable[[int, list], None] | None = None,
        start_step: int = 0, start_position: int | None = None,
        evaluate: Callable[[int], dict] | None = None, teacher_engines: list | None = None,
        earlier: list[dict] | None = None, on_untrained: Callable[[int, list], None] | None = None) -> list[dict]:
    """Run the loop in `cfg.mode`. `task_source`: a positional source (take(position, n)) or a
    plain `source(n, seed)`, drawn in chunks of prompts_per_step seeded by their data position
    (draw_tasks). With `checkpoint_dir`, a checkpoint found there is resumed from
    (the next step is the one after it: no step is repeated or skipped), and one is written
    every `checkpoint_every` steps. `stop` (an Event) ends the loop after the current step.
    `on_groups(step, groups)` sees each step's trajectories, `on_untrained(step, groups)` those
    of the groups it rolled out and did not train (dynamic sampling's filter, the async gate's stale
    groups; called only where there are some). At the run's end the last step's is called again
    with those and the finished groups no step took (_record_untaken): the later call for a step
    replaces the earlier. `start_step`: the first step's
    index (a session continuing earlier steps); `start_position`: its data position (default
    start_step * prompts_per_step; a checkpoint's `data_position` wins). `evaluate(step)` runs
    every cfg.eval_every steps after the step's sync; its dict joins the step's metrics.
    `teacher_engines`: the frozen teacher for advantage="distill" (never synced). `earlier`: the
    metrics of the steps before this run (a session's earlier runs, a resumed run's record), read
    only by the warnings (warn_no_signal's streak went unseen across runs of fewer than 5 steps).
    Returns one metrics dict per step of this run.

    Faults: an engine that dies is dropped from `engines` (in place) and the run goes on with the
    others (its in-flight requests were retried on them by the runners' routers); a rollout runner
    that dies fails the episodes it was running (Rollout.run_groups) and the run goes on (a step
    none of whose episodes trains is recorded without an update: NothingToTrain); a trainer
    rank that dies stops the run with TrainerRankDied (TrainerWatch), with the trainer group killed
    so that nothing waits in a collective."""
    check_staleness(trainer, cfg)
    check_sampling(rollout, trainer, engines)
    check_teacher(rollout, cfg, teacher_engines)
    with TrainerWatch(trainer) as watch:
        try:
            # the warnings' window: the last steps before this run, which they read with this run's
            history = list(earlier or [])[-(NO_SIGNAL_STEPS + 1):]
            before = len(history)
            return _run(rollout, trainer, engines, task_source, cfg, on_step, progress, checkpoint_dir, checkpoint_every,
                        stop, on_groups, start_step, start_position, evaluate, teacher_engines, history,
                        on_untrained=on_untrained)[before:]
        except Exception as e:
            err = watch.explain(e)
            if err is e:
                raise
            raise err from e


def _run(rollout, trainer, engines, task_source, cfg, on_step, progress, checkpoint_dir, checkpoint_every, stop, on_groups,
         start_step, start_position=None, evaluate=None, teacher_engines=None, history=None, on_untrained=None) -> list[dict]:
    from tqdm.auto import tqdm

    first, restored = start_step, False
    if checkpoint_dir and recover_checkpoint(checkpoint_dir):
        state = trainer.restore(os.path.realpath(checkpoint_dir))  # (the ranks' working directory is not ours)
        first, start_position, restored = state["next_step"], state.get("data_position"), True
    # the data position: tasks drawn so far (the producer advances it, replacements included)
    position = first * cfg.prompts_per_step if start_position is None else start_position
    # one version counter for trainer and engines; it only ever increases
    # (a restore replaced the trainer's weights: the engines serve others whatever initial_sync says;
    # unsynced, the first resumed step sampled the base model, its tokens V versions stale)
    # an engine behind the trainer's verified weights is synced whatever initial_sync says: one whose sync
    # failed its probe check sampled on under the trainer's version (its tokens read as on-policy), one a
    # failed load tore samples nothing (TornWeights: every episode failed, the run spun through its steps)
    if cfg.initial_sync or restored or engines_version(engines, newest=False) < trainer.version:  # rollouts must come from the trainer's weights, not whatever the engines hold:
        # under the trainer's own version (a restored one: its checkpoint's weights), or past every
        # engine's (Workbench.sync's rule; a restored run labelled its steps one past an uninterrupted run's)
        trainer.version = max(trainer.version, engines_version(engines) + 1)
        sync_engines(trainer, engines, cfg.sync_tol)
    else:
        trainer.version = max(engines_version(engines), trainer.version)

    stop = stop or threading.Event()
    if cfg.mode == "async":
        return _run_async(rollout, trainer, engines, task_source, cfg, on_step, progress, checkpoint_dir,
                          checkpoint_every, stop, on_groups, first, position, evaluate, teacher_engines, history, on_untrained)
    # sync: the rollout of step k starts once step k-1 is trained and synced
    trained = threading.Semaphore(0)
    batches: queue.Queue = queue.Queue()
    stopped: list = []  # groups a stop left untaken: the rollout's that had finished (RolloutStopped)

    def produce():
        nonlocal position
        for step in range(first, cfg.steps):
            if step > first:
                while not trained.acquire(timeout=0.5):
                    if stop.is_set():
                        return
            if stop.is_set():
                return
            try:
                t0, start = time.time(), position
                groups, extra, position = collect_groups(rollout, task_source, cfg, position, stop)
                if cfg.advantage in PER_TOKEN_ADVANTAGES:  # scored here: overlaps training in async mode
                    extra["_teacher"] = teacher_logprobs(teacher_engines, teacher_segments(groups, cfg))
                batches.put((step, groups, t0, time.time(), {"data_position": start, "data_next": position, **extra}))
            except RolloutStopped as e:
                stopped.extend(untaken(e.groups))
                return
            except BaseException as e:  # surfaced in the training thread
                batches.put((step, e, 0.0, 0.0, {}))
                return

    producer = threading.Thread(target=produce, name="workbench-rollout", daemon=True)
    producer.start()
    history = [] if history is None else history  # (the steps before this run first: the warnings read them)
    last = None  # the last step recorded and its untrained groups (none: the leftovers are not recorded)
    try:
        for step in tqdm(range(first, cfg.steps), desc=f"RL steps ({cfg.mode})", initial=first, total=cfg.steps,
                         disable=not progress):
            item = _poll(batches, stop, producer)
            if item is None:
                break
            got_step, groups, r0, r1, extra = item
            if isinstance(groups, BaseException):
                raise RuntimeError(f"rollout of step {got_step} failed: {groups}") from groups
            if on_groups is not None:
                on_groups(step, groups)
            teacher, untrained = extra.pop("_teacher", None), extra.pop("_untrained", [])
            if on_untrained is not None and untrained:
                on_untrained(step, untrained)
            trained_metrics, sync_error = _train_on(trainer, engines, groups, cfg, step, r0, r1, teacher, untrained=untrained)
            last = (step, untrained)  # (recorded by _after_step; a training that raised is retried, its files replaced)
            metrics = {**trained_metrics, **extra}
            if sync_error is None:
                trained.release()
            if _after_step(trainer, cfg, step, metrics, history, evaluate, on_step, checkpoint_dir, checkpoint_every,
                           stop, sync_error):  # (raises sync_error once the step is recorded)
                break
    finally:
        stop.set()  # the next step's rollout (started once this step synced) waits no more: RolloutStopped
        producer.join()
        # its finished groups, and a batch done but not taken, are recorded with the last step's untrained
        # ones (they were thrown away unrecorded; their tasks are drawn again from the last step's data_next)
        while True:
            try:
                _, groups, *_, extra = batches.get_nowait()
            except queue.Empty:
                break
            if not isinstance(groups, BaseException):  # (its filtered ones keep their label)
                stopped += untaken(groups) + extra.get("_untrained", [])
        _record_untaken(on_untrained, last, stopped)
    checkpoint_at_end(trainer, checkpoint_dir, checkpoint_every, history, first)
    return history


def untaken(groups: list) -> list:
    """`groups` marked as taken by no step (info["untaken"]): the audit page says the run ended before
    a step took them, not that they were filtered or stale."""
    for group in groups:
        for t in group:
            t.info["untaken"] = True
    return groups


def _record_untaken(on_untrained, last: tuple[int, list] | None, groups: list) -> None:
    """The finished groups no step took when a run ends, stopped or failing, recorded with the last
    step's untrained ones (`last`: that step and its own). Called in the run's `finally`: a failure of
    its own while the run's error propagates is said, not raised over that error. A run that took no
    step records none (`last` None): filed under its first step, which has no record, they were
    deleted as a retried step's first try when the next run took that step (their tasks are drawn
    again there, as that step's)."""
    if on_untrained is None or not groups or last is None:
        return
    failing = sys.exc_info()[0] is not None  # (inside a finally: the exception on its way out, if any)
    try:
        on_untrained(last[0], last[1] + groups)
    except Exception as e:
        if not failing:
            raise
        print(f"workbench: the {len(groups)} finished group(s) no step took could not be recorded "
              f"({type(e).__name__}: {e})", file=sys.stderr)


def checkpoint_at_end(trainer, checkpoint_dir, checkpoint_every: int, history: list[dict], first: int) -> None:
    """The run's last step, where checkpoint_every did not save it: at its end, or after a stop
    (which may come during the next step's rollout). A resume redid the steps since the last multiple."""
    last = history[-1] if history else None
    if checkpoint_dir and checkpoint_every and last is not None and last["step"] >= first and (last["step"] + 1) % checkpoint_every:
        save_checkpoint(trainer, checkpoint_dir, {"next_step": last["step"] + 1, "data_position": last["data_next"]})


def _after_step(trainer, cfg, step, metrics, history, evaluate, on_step, checkpoint_dir, checkpoint_every, stop,
                sync_error: BaseException | None = None) -> bool:
    """A trained step's evaluation, record, checkpoint and callback; True when `stop` is set.
    With `sync_error` (the step trained, then its weight sync failed) the step is recorded, so a
    run continued later starts after it (it trained the step again on the same tasks, over weights
    that held its update, and overwrote its record), then the error is raised. An evaluation that
    fails is the same: the step trained and synced, so it is recorded (`eval_error`), then raised."""
    eval_error = None
    if sync_error is None and evaluate is not None and cfg.eval_every and (step + 1) % cfg.eval_every == 0:
        try:
            metrics.update(evaluate(step))  # on the weights just synced; never part of a batch
        except BaseException as e:  # (a Ctrl-C too: the step trained and synced, it is recorded first)
            eval_error = e
            metrics["eval_error"] = f"{type(e).__name__}: {e}"
    history.append(metrics)
    warn_policy_outran_correction(history)
    warn_no_signal(history)
    if on_step is not None:  # the record first (a metrics line): a checkpoint past it would resume after a step never logged
        on_step(metrics)
    # (not with rank 0 stuck in a failed NCCL broadcast: the save would queue behind it for ever)
    if checkpoint_dir and checkpoint_every and (step + 1) % checkpoint_every == 0 and not getattr(trainer, "nccl_blocked", False):
        save_checkpoint(trainer, checkpoint_dir, {"next_step": step + 1, "data_position": metrics["data_next"]})
    if sync_error is not None:
        raise sync_error
    if eval_error is not None:
        raise eval_error
    return stop.is_set()


NO_SIGNAL_STEPS = 5


def warn_no_signal(history: list[dict], steps: int = NO_SIGNAL_STEPS) -> bool:
    """Say so (stderr, once a streak) when the last `steps` steps trained no token with an
    advantage (`signal_tokens_trained` 0: with a group estimator every group's rewards were equal,
    or the gate dropped every row that had one): the rewards gave no gradient, the trainer skipped
    its updates, and a policy that earns every group the same reward stays so. The run goes on,
    learning nothing. True when it printed."""
    import sys

    def silent(m: dict) -> bool:  # the trainer's count: after the gate (a batch with signal it dropped whole)
        return m.get("signal_tokens_trained", m.get("signal_tokens")) == 0

    # the streak is exactly `steps` long: the last `steps` silent, the one before not (or none);
    # only those steps + 1 are read, however long the run or the streak
    if len(history) < steps or not all(silent(m) for m in history[-steps:]):
        return False
    if len(history) > steps and silent(history[-steps - 1]):
        return False
    last = history[-1]
    # why, from the last step's own record: the cause decides the advice (the gate is a fix for one
    # and the culprit of another; a step whose every episode failed has no rewards at all)
    grad_norm = last.get("grad_norm")
    # (by failures, not episodes: a failed episode with no segments counts as an episode where
    # on_failed keeps or zeroes it, and the step read as "every group's rewards were equal")
    if last.get("updates_skipped") and not last.get("segments") and last.get("failed_episodes") and not last.get("masked_episodes"):
        why = (f"every episode failed ({last['failed_episodes']} in the last step: see failure_reasons in "
               f"metrics.jsonl), so there was nothing to train on")
    elif last.get("updates_skipped") and not last.get("episodes") and last.get("dropped_episodes"):
        # (read as "every group's rewards were equal", with nothing in the batch)
        why = (f"no episode reached the batch ({last['dropped_episodes']} dropped in the last step, "
               f"{last.get('truncated_episodes', 0)} of them truncated: the rules on_truncated / on_failed = 'drop'), so "
               f"there was nothing to train on: a larger max_tokens or context, or another rule (loop.EPISODE_RULES)")
    elif last.get("updates_skipped") and not last.get("segments") and last.get("masked_episodes"):
        # (read as "every group's rewards were equal", with the rewards differing)
        why = (f"every episode kept was masked ({last['masked_episodes']} in the last step; "
               f"{last.get('truncated_episodes', 0)} truncated, their replies out of max_tokens or context, and "
               f"{last.get('failed_episodes', 0)} failed: the rules on_truncated / on_failed = 'mask' train none of them), so "
               f"there was nothing to train on: a larger max_tokens or context, or another rule (loop.EPISODE_RULES)")
    elif isinstance(grad_norm, (int, float)) and not math.isfinite(grad_norm):
        # (read as "the gate dropped every row", beside a gate_pass_ratio of 1.0)
        why = (f"the gradient was not finite (grad_norm {grad_norm}): every update was skipped. Look for a NaN "
               f"or inf in the batch's log-probs or advantages (behaviour_logprobs, rewards), or lower the lr")
    elif (last.get("signal_tokens") or 0) > 0:
        why = (f"the correction's gate dropped every row that had an advantage (gate_pass_ratio "
               f"{last.get('gate_pass_ratio')}, token_keep_ratio {last.get('token_keep_ratio')}): the samples are too far "
               f"off the trainer's policy for its band (trainer.correction; engine and trainer dtypes; staleness)")
    else:
        why = (f"every advantage was 0 (with a group estimator: every group's rewards were equal; reward_mean "
               f"{last.get('reward_mean', float('nan')):.3f}), so the rewards gave no gradient (with kl_coef > 0 the "
               f"policy only moves toward the reference). Look at the rewards and kl_k3 of the steps before; a lower lr "
               f"or a sequence-level gate (trainer.correction) keeps an off-policy run from this")
    print(f"workbench: the last {steps} steps (to step {last.get('step')}) had no learning signal: {why}.", file=sys.stderr)
    return True


# KL(behaviour || trainer) a token, on the stale tokens, above which importance weights no longer
# correct them: most of their ratios lie beyond [1/e, e], where TIS's cap (2) and band masks act
# instead of the ratio. Measured on the quickstart task at async_lag 1, 2026-12-04 (27 runs, lr 1e-3
# unless said, several corrections): of the 6 runs that collapsed (5+ steps at reward 0) whose
# statistics were kept, 5 went over 1.0 one to four steps before (1.03-8.1); 3 that fell to ~0 and
# came back went over too (1.4-1.7), one that fell to 0.05 did not (0.87); none of the 15 whose
# reward stayed above 0.09 did (0.03-0.92; the 4 at lr 3e-4 under 0.6).
STALE_KL_LIMIT = 1.0


def warn_policy_outran_correction(history: list[dict], limit: float = STALE_KL_LIMIT) -> bool:
    """Say so (stderr, once a streak) when the last step's stale tokens were sampled by a policy
    more than `limit` nats a token (kl_k3_stale) from the one training on them: the policy moves
    too far a version for off-policy samples, and an async run in that state tends to collapse
    (every reward 0, then no gradient). True when it printed."""
    import sys

    def over(m: dict) -> bool:  # (NaN is over: a broken engine's statistic)
        v = m.get("kl_k3_stale")
        return v is not None and not v <= limit

    if not history or not over(history[-1]) or (len(history) > 1 and over(history[-2])):
        return False
    last = history[-1]
    print(f"workbench: step {last.get('step')}'s stale tokens were sampled {last['kl_k3_stale']:.2f} nats a token (kl_k3_stale) "
          f"from the policy training on them (over {limit}): the policy moves too far a version for importance weights to "
          f"correct one-version-old samples, and an async run like this tends to collapse. Lower trainer.lr (on the "
          f"quickstart task 3e-4 held where 1e-3 collapsed), or run mode='sync'.", file=sys.stderr)
    return True


def _sampled_versions(trajectories: list[Trajectory]) -> set[int]:
    """The policy versions the trajectories' trainable tokens were sampled at."""
    return {v for t in trajectories for s in t.segments for v, m in zip(s.versions, s.loss_mask) if m}


def trained_episodes(group: list[Trajectory], rule: dict) -> list[Trajectory]:
    """The group's episodes whose tokens a batch would train on: those the episode rules (`rule`:
    on_failed, on_truncated, overlong; episode_reward) neither drop nor mask (a masked episode's
    old tokens refused its group as stale, though none of them trains)."""
    return [t for t in group if episode_reward(t, **rule)[0] not in ("drop", "mask")]


def oldest_version(group: list[Trajectory]) -> int | None:
    """The version that sampled the group's oldest trainable token (None: it sampled none)."""
    return min(_sampled_versions(group), default=None)


class GroupStream:
    """The continuous async rollout: a thread keeps groups in flight on the runners (each to the
    one with the fewest outstanding episodes, Rollout.submit_group) and queues each as it
    finishes, so the rollout waits neither for a step's slowest group nor for training. It
    starts at most prompts_per_step x (1 + async_lag) groups beyond the steps trained (allow():
    each trained step, and each group not admitted, lets more start), so a group started after
    step t's sync is at most async_lag versions old when taken in order (take(), async_order
    "start", the default); in finish order one that is overtaken can be older, and the loop does
    not admit it. Tasks are drawn a step's worth at a time
    (draw_tasks, as in sync mode)."""

    def __init__(self, rollout, source, cfg: LoopConfig, first: int, position: int, stop: threading.Event,
                 teacher_engines: list | None = None):
        self.rollout, self.source, self.cfg, self.stop, self.teachers = rollout, source, cfg, stop, teacher_engines
        # a run continued from a data position (data_next, mid-chunk) goes on from it (draw_tasks): seeded by
        # the step, it drew again tasks an earlier run had trained (those that finished first)
        self.position, self.tasks = position, []
        # the data position of the first task not started (data_next), moved under the lock once a
        # task has started: read from the queue, it could be taken while a task was out of it
        # (popped, not yet started or put back) or before a draw had filled it
        self.unstarted = position
        self.allowed = cfg.prompts_per_step * (1 + cfg.async_lag)
        self.limit = cfg.prompts_per_step * (cfg.steps - first)  # groups the run needs (+ those not admitted)
        self.started = 0
        # (the group's start number, group, its task's data position, start time, end time, teacher
        # log-probs) or an error
        self.finished: queue.Queue = queue.Queue()
        self._held: dict[int, tuple] = {}  # finished ahead of their turn (async_order "start")
        self._next = 0  # the start number take() hands out next (async_order "start")
        self._started_at: dict[int, int] = {}  # start number -> its task's data position (not yet taken)
        self._lock = threading.Lock()
        self.thread = threading.Thread(target=self._produce, name="workbench-rollout", daemon=True)
        self.thread.start()

    def allow(self, groups: int = 0, replace: int = 0) -> None:
        """`groups` more may start (a step was trained and synced); `replace` groups were not
        admitted, so as many more may start, beyond the run's need too."""
        with self._lock:
            self.allowed += groups + replace
            self.limit += replace

    def _draw(self) -> None:
        """The next chunk of prompts_per_step tasks, with their data positions, into self.tasks."""
        drawn, self.position = draw_tasks(self.source, self.cfg.prompts_per_step, self.position, self.cfg.prompts_per_step)
        self.tasks = [(t, at) for at, t in drawn]

    def _next_task(self) -> tuple[Task, int]:
        """The next task and its data position."""
        if not self.tasks:
            self._draw()
        return self.tasks.pop(0)

    def _produce(self) -> None:
        inflight: dict = {}  # ref -> (runner, task, its data position, start time)
        try:
            while not self.stop.is_set():
                while self.started < min(self.allowed, self.limit):
                    task, at = self._next_task()
                    started = self.rollout.submit_group(task, self.cfg.group_size)
                    if started is None:  # every runner is full: put the task back
                        self.tasks.insert(0, (task, at))
                        break
                    inflight[started[0]] = (started[1], task, at, time.time(), self.started)
                    with self._lock:
                        if self.cfg.async_order == "start":  # (read and popped in start order only: in finish
                            self._started_at[self.started] = at  # order it grew by a group a step, all run)
                        self.unstarted = at + 1  # tasks start in the order of their positions
                    self.started += 1
                if not inflight:
                    self.stop.wait(0.05)
                    continue
                done, _ = ray.wait(list(inflight), num_returns=1, timeout=0.1)
                for ref in done:
                    runner, task, at, t0, number = inflight.pop(ref)
                    group = self.rollout.finish_group(ref, runner, task, self.cfg.group_size)
                    teacher = None
                    if self.cfg.advantage in PER_TOKEN_ADVANTAGES:  # scored here, while the trainer trains
                        teacher = teacher_logprobs(self.teachers, teacher_segments([group], self.cfg))
                    self.finished.put((number, group, at, t0, time.time(), teacher))
        except BaseException as e:  # surfaced in the training thread
            self.finished.put(e)
        finally:  # groups in flight keep their runners' slots until they finish, unwaited for (a stop waited
            # for every one, up to the episode timeout, to throw them away)
            if inflight:
                self.rollout.abandon_groups([(ref, runner) for ref, (runner, *_) in inflight.items()], self.cfg.group_size)

    def take(self):
        """The next finished group (group, data position, start and end time, teacher log-probs):
        with async_order "start" the next in the order groups started (those that finish ahead of
        their turn wait), else the next to finish; an error, or None once stopped."""
        while self.cfg.async_order == "finish" or self._next not in self._held:
            item = _poll(self.finished, self.stop, self.thread)
            if item is None or isinstance(item, BaseException):
                return item
            if self.cfg.async_order == "finish":
                return item[1:]
            self._held[item[0]] = item[1:]
        with self._lock:
            self._started_at.pop(self._next, None)
            self._next += 1
        return self._held.pop(self._next - 1)

    def drain(self) -> list:
        """The finished groups no step took (call once stopped and the producer joined): recorded as
        untrained (a stop threw them away uncounted; in finish order their tasks are not drawn again)."""
        groups = [held[0] for _, held in sorted(self._held.items())]
        self._held.clear()
        while True:
            try:
                item = self.finished.get_nowait()
            except queue.Empty:
                return groups
            if not isinstance(item, BaseException):
                groups.append(item[1])

    def data_next(self) -> int:
        """Where a run continued after the groups taken so far starts: in start order the data
        position of the next group to take (started or not: the groups taken are the ones started
        before it, so nothing before it is left and nothing after it was trained; the first task
        not started skipped up to prompts_per_step x async_lag started tasks at every stop or
        resume); in finish order the first task not started (those in flight are skipped)."""
        with self._lock:
            if self.cfg.async_order == "start":
                return self._started_at.get(self._next, self.unstarted)
            return self.unstarted


def _async_batch(stream: GroupStream, cfg: LoopConfig, version: int, leftover: list | None = None):
    """The groups of one async step, trained from `version`: the next prompts_per_step groups
    (GroupStream.take: in start order, or the first to finish) whose oldest token is at most
    cfg.async_lag versions behind (older ones are not admitted: groups_dropped_stale); with
    dynamic sampling, zero-variance groups are filtered too,
    up to dynamic_sampling_rounds x prompts_per_step of them per step. (groups, r0, r1, extra,
    teacher log-probs), or None once stopped (the groups taken so far then go to `leftover`)."""
    n, groups, teacher, starts, ends, positions = cfg.prompts_per_step, [], {}, [], [], []
    stale = filtered = 0
    rule = cfg.episode_rules()
    sampled: list = []
    untrained: list = []  # stale and filtered groups (untrained_statistics, untrained/)
    # zero-variance groups past the filter's budget: they fill the step's count but do not train,
    # as a sync step trains only the groups it kept (admitted, their tokens diluted a token_mean
    # step's signal 4x where a sync step of the same groups did not: the two modes differed)
    flat: list = []
    while len(groups) + len(flat) < n:
        item = stream.take()
        if item is None:
            if leftover is not None:  # (the filtered and stale ones keep their label)
                leftover += untaken(groups + flat) + untrained
            return None
        if isinstance(item, BaseException):
            if leftover is not None:  # the groups this step took are recorded with the run's end, as on a stop
                leftover += untaken(groups + flat) + untrained
            raise RuntimeError(f"the rollout failed: {item}") from item
        group, at, t0, t1, lp = item
        # over the episodes the batch trains on: a timed-out episode (kept with its segments, then
        # dropped by on_failed) holding old tokens rejected its whole group, so the long, hard
        # prompts where timeouts cluster were filtered out of training
        # every group taken counts in the rolled-out statistics and the step's first data position, as a
        # sync step's draw does (the stale ones were left out of both)
        sampled.append(group)
        positions.append(at)
        oldest = oldest_version(trained_episodes(group, rule))
        if oldest is not None and version - oldest > cfg.async_lag:
            stale += 1
            untrained.append(group)
            stream.allow(replace=1)
            continue
        no_signal = cfg.dynamic_sampling and zero_variance(group, **rule)
        if no_signal and filtered < cfg.dynamic_sampling_rounds * n:
            filtered += 1
            untrained.append(group)
            stream.allow(replace=1)
            continue
        starts.append(t0)
        ends.append(t1)
        if no_signal:
            flat.append(group)
            continue
        groups.append(group)
        teacher.update(lp or {})
    zero = len(flat)
    if not groups:  # none kept: the step trains on them (every advantage 0), as a sync step on its first draw
        groups = flat
    else:
        untrained += flat
    trained = [trained_episodes(g, rule) for g in groups]  # (what the version counts describe)
    per_version: dict[int, int] = {}
    for g in trained:
        v = oldest_version(g)
        if v is not None:
            per_version[v] = per_version.get(v, 0) + 1
    extra = {"data_position": min(positions), "data_next": stream.data_next(), "_untrained": untrained,
             "groups_dropped_stale": stale, "groups_per_version": dict(sorted(per_version.items())),
             "episodes_spanning_versions": sum(len(_sampled_versions([t])) > 1 for g in trained for t in g),
             # a group whose episodes were sampled at several versions: its advantages compare rewards
             # of different policies (a sibling queued across a sync), which no other count shows
             "groups_mixing_versions": sum(len(_sampled_versions(g)) > 1 for g in trained)}
    if cfg.dynamic_sampling:
        extra.update(ds_filtered_groups=filtered, ds_rounds=-(-filtered // n), ds_kept_groups=n - zero, ds_short=zero,
                     **sampled_statistics(sampled))
    return groups, min(starts), max(ends), extra, teacher or None


def _run_async(rollout, trainer, engines, task_source, cfg, on_step, progress, checkpoint_dir, checkpoint_every, stop,
               on_groups, first, position, evaluate, teacher_engines, history=None, on_untrained=None) -> list[dict]:
    from tqdm.auto import tqdm

    stream = GroupStream(rollout, task_source, cfg, first, position, stop, teacher_engines)
    history = [] if history is None else history  # (the steps before this run first: the warnings read them)
    step_start = time.time()
    # the finished groups no step took when the run stops (a step's worth and more start ahead of it):
    # recorded with the last step's untrained groups, not thrown away uncounted
    leftover: list = []
    last = None  # the last step recorded and its untrained groups (none: the leftovers are not recorded)
    try:
        for step in tqdm(range(first, cfg.steps), desc="RL steps (async)", initial=first, total=cfg.steps,
                         disable=not progress):
            got = _async_batch(stream, cfg, trainer.version, leftover)
            if got is None:
                break
            groups, r0, r1, extra, teacher = got
            if on_groups is not None:
                on_groups(step, groups)
            untrained = extra.pop("_untrained")
            if on_untrained is not None and untrained:
                on_untrained(step, untrained)
            trained_metrics, sync_error = _train_on(trainer, engines, groups, cfg, step, r0, r1, teacher, step_start, untrained)
            last = (step, untrained)  # (recorded by _after_step; a training that raised is retried, its files replaced)
            metrics = {**trained_metrics, **extra}
            if sync_error is None:
                stream.allow(cfg.prompts_per_step)  # trained and synced: a step's worth more may start
            if _after_step(trainer, cfg, step, metrics, history, evaluate, on_step, checkpoint_dir, checkpoint_every,
                           stop, sync_error):
                break
            step_start = time.time()  # (after its evaluation and checkpoint: not billed to the next step)
    finally:
        stop.set()
        stream.thread.join()
        _record_untaken(on_untrained, last, leftover + untaken(stream.drain()))  # (an error ending the run: they went too)
    checkpoint_at_end(trainer, checkpoint_dir, checkpoint_every, history, first)
    return history


def _poll(items: queue.Queue, stop: threading.Event, producer: threading.Thread):
    """The next item a producer thread queued, or None once stopped or the producer is done."""
    while True:
        try:
            return items.get(timeout=0.5)
        except queue.Empty:
            if stop.is_set() or not producer.is_alive() and items.empty():
                return None


def step_statistics(stats: dict) -> dict:
    """A trainer step's statistics (Trainer.train_step's result) under the keys metrics.jsonl
    logs them: loss, gate and correction, replay. wb.revisit recomputes a step through this too."""
    corr, replay = stats["correction"], stats["replay"]
    return {
        "loss": stats["loss"], "grad_norm": stats["grad_norm"],
        "signal_tokens_trained": stats.get("signal_tokens_trained"), "updates": stats.get("updates"),
        "updates_skipped": stats.get("updates_skipped", 0), "gate_pass_ratio": corr["gate_pass_ratio"], "stale_dropped": corr["stale_dropped"], "band_dropped": corr["band_dropped"],
        "veto_dropped": corr.get("veto_dropped", 0), "token_keep_ratio": corr["token_keep_ratio"],
        "kl_k1": corr["kl_k1"], "kl_k3": corr["kl_k3"], "kl_k3_current": corr["kl_k3_current"], "tokens_current": corr["tokens_current"],
        "kl_k3_stale": corr["kl_k3_stale"],
        "max_abs_delta_p": corr["max_abs_delta_p"], "staleness_hist": corr["staleness_hist"], "tokens_per_version": corr["tokens_per_version"],
        "max_staleness_kept": corr.get("max_staleness_kept"),
        "is_weight_hist": corr["is_weight_hist"], "is_weight_hist_current": corr.get("is_weight_hist_current"), "is_ess": corr["is_ess"], "is_bounded_fraction": corr["is_bounded_fraction"],
        "replay_disagree_rate": replay["disagree_rate"], "replay_disagree_per_layer": replay["disagree_rate_per_layer"],
        "replay_fallback": sum(replay["fallback"]), "kl_k3_live": stats["kl_k3_live"], "kl_ref": stats["kl_ref"],
        # positions replayed (0: nothing captured, so the disagreement measured nothing) and those the
        # forward routed otherwise than recorded although replay applied (0 unless the rule is broken)
        "replay_positions": sum(replay["replayed"]), "replay_unreplayed": sum(replay.get("unreplayed", [])),
        # the positions the disagreement was compared over (the trained version's rows: none in an all-stale async step)
        "replay_compared": sum(replay.get("compared", [])),
        "policy_shift": stats.get("policy_shift"),
    }


def reward_statistics(groups: list[list[Trajectory]]) -> dict:
    """The step's reward_mean: the agents' rewards over the episodes that finished; correct_rate:
    the share of exact answers (info["correct"], where the agent reports it) with a failed episode
    counted wrong, as evaluation counts it (a run timing out more and more read as one answering
    better: 1 right and 3 timed out was 1.0). A step where no episode finished measured neither:
    both NaN (reward_mean read 0.0, a reward nobody earned; correct_rate None, on which the
    notebooks' sums over the history raised); plots leave a gap, `failed_episodes` says why."""
    episodes = [t for g in groups for t in g]
    rewards = [t.reward for t in episodes if t.error is None]
    if not rewards:  # (no episode at all measured nothing either: it read 0.0)
        return {"reward_mean": math.nan, "correct_rate": math.nan}
    # where any episode reports it, every episode scored by evaluation's rule (is_correct: a failed one,
    # or one without the key, wrong): an Env episode cut by max_turns or the context never reached the
    # step that sets info["correct"]; left out (or scored by a shaped reward summed over its looping
    # turns), a policy looping to max_turns read better. Decided per group (one task), as evaluation
    # decides it per task: a reward-graded task's episodes beside another task's reports read wrong at
    # reward 1, and correct_rate and pass@1 scored the same episodes differently
    correct = [is_correct(t, reported=reports_correct(g)) for g in groups for t in g] if reports_correct(episodes) else []
    return {"reward_mean": sum(rewards) / max(len(rewards), 1),
            "correct_rate": sum(correct) / len(correct) if correct else None}


def window_mean(history: list[dict], key: str) -> float | None:
    """The mean of `key` over the steps of `history` that measured it (a step where no episode
    finished has reward_mean NaN, and one NaN made a notebook's summary NaN, written to its
    results.json as a bare NaN); None when none did."""
    values = [float(h[key]) for h in history if h.get(key) is not None and math.isfinite(float(h[key]))]
    return sum(values) / len(values) if values else None


def _train_on(trainer, engines, groups, cfg: LoopConfig, step: int, r0: float, r1: float, teacher=None,
              step_start: float | None = None, untrained: list | None = None):
    """Train on the groups and sync the engines: (the step's metrics, the sync's error or None).
    A failed sync is returned, not raised: the step trained, and _after_step records it first.
    `step_start`: where step_s counts from (async: the previous step's end; else the rollout's start).
    `untrained`: the groups the step rolled out and does not train (counted: untrained_statistics)."""
    t1 = time.time()
    untrained = untrained or []
    reasons: dict[str, int] = {}  # why episodes failed (untrained groups' too): the first line of each error, counted
    for t in (t for g in groups + untrained for t in g if t.error is not None):
        line = (t.error.strip().splitlines() or ["?"])[0][:200]
        reasons[line] = reasons.get(line, 0) + 1
    record = {
        "step": step, "mode": cfg.mode,
        # the settings the audit holds the step to (wb.run's overrides; config.json has the session's)
        "sync_tol": cfg.sync_tol, "on_failed": cfg.on_failed, "on_truncated": cfg.on_truncated,
        # the staleness the async loop admits (the audit holds the step to it; a sync step's is 0)
        **({"async_lag": cfg.async_lag, "async_order": cfg.async_order} if cfg.mode == "async" else {}),
        # the trainer's gate (the audit's cap: config.json held a resumed session's steps to the first one's)
        "max_staleness_gate": getattr(getattr(getattr(trainer, "cfg", None), "correction", None), "max_staleness", None),
        **reward_statistics(groups), "failure_reasons": reasons}

    def timed(tb: float, t2: float) -> dict:
        # train_s holds batch_s (the batch built on the driver); step_s - the rest: the driver's own records.
        # Async: rollout_s spans the step's groups, started while earlier steps trained; step_s is from
        # the previous step's end (from the first group's start it was ~(1 + async_lag) steps long)
        return {"rollout_s": r1 - r0, "batch_s": tb - t1, "train_s": t2 - t1, "sync_s": time.time() - t2,
                "step_s": time.time() - (min(r0, t1) if step_start is None else step_start), "rollout_start": r0, "rollout_end": r1, "train_start": t1,
                "train_end": t2}

    try:
        batch, info = batch_from_groups(groups, cfg.advantage, **cfg.episode_rules(), teacher=teacher,
                                        temperature=getattr(getattr(trainer, "cfg", None), "temperature", None),
                                        correction=getattr(getattr(trainer, "cfg", None), "correction", None))
    except NothingToTrain as e:
        # every episode failed (timed out, say) and was dropped: the step is recorded without an
        # update or a sync (the weights did not change); it stopped the whole run, a dead runner's
        # groups too, which run() says fail only their episodes
        print(f"workbench: step {step} had no trainable episode ({sum(reasons.values())} failed: "
              f"{next(iter(reasons), 'none')}; {e.info.get('masked_episodes', 0)} masked): recorded without an update",
              file=sys.stderr)
        now = time.time()
        return {**record, "version": trainer.version, "trained_version": trainer.version, **_with_untrained(e.info, untrained),
                "engines": len(engines), "engines_lost": 0, "signal_tokens": 0,
                "signal_tokens_trained": 0, "updates_skipped": 1, **timed(now, now)}, None
    info = _with_untrained(info, untrained)
    tb = time.time()
    try:
        stats = trainer.train_step(batch)
    except (KeyboardInterrupt, SystemExit, PartialUpdate) as e:
        # interrupted while the ranks update (they finish it), or a rank failed after an update: recorded
        # as trained, so a run continued later starts after it (it trained the step again on the same
        # tasks, over weights that held its update), then raised; the next run syncs the engines first
        # (the version moved)
        now = time.time()
        return {**record, "version": trainer.version, **info, "engines": len(engines), "engines_lost": 0,
                "train_interrupted": type(e).__name__, **timed(tb, now)}, e
    t2 = time.time()
    lost: list = []
    try:
        # every update skipped: the weights and the version stayed, and the engines hold them already
        moved = stats.get("trained_version", stats["version"] - 1) != stats["version"]
        reports, sync_error = (sync_engines(trainer, engines, cfg.sync_tol, lost) if moved else []), None
    except BaseException as e:  # (a Ctrl-C too: the step trained, it is recorded first)
        reports, sync_error = [], e
    return {
        # (the engines left after the sync, which drops a dead one from `engines`)
        # trained_version: the weights the step trained from (its tokens' staleness is against it);
        # version: those it left (one more, unless every update was skipped)
        **record, "version": stats["version"], "trained_version": stats.get("trained_version", stats["version"] - 1), **info, "engines": len(engines), "engines_lost": len(lost),
        **step_statistics(stats),
        "sync_max_abs_diff": max((r.probe_max_abs_diff for r in reports), default=None),
        # a probe position excused as a router near-tie: its gap, apart (it read as a clean sync)
        "sync_probe_outlier": max((r.probe_outlier for r in reports if r.probe_outlier is not None), default=None),
        **({"sync_error": f"{type(sync_error).__name__}: {sync_error}"} if sync_error is not None else {}),
        **timed(tb, t2),
    }, sync_error
