"""Evaluation on held-out tasks: pass@1 and unbiased pass@k, sampled and greedy.

`evaluate(rollout, tasks, n)` runs `n` episodes per task at the policy's sampling (the
training rollout's engines and runners) and, given a `greedy_rollout` (runners whose policy
sampling is temperature 0), one greedy episode per task. An episode is correct when its info
says so (`info["correct"]`, as the example envs report it); where no episode of its task reports
it, when it was not truncated and its reward reaches `success_reward`. Per task, with c correct of
n samples, the unbiased estimator of pass@k
(the chance that at least one of k samples drawn without replacement from the n is correct) is

    pass@k = 1 - C(n - c, k) / C(n, k)          (1 when n - c < k)

averaged over tasks; pass@1 is then the mean of c / n. Every evaluation episode is marked
`info["eval"] = True`, and loop.batch_from_groups refuses such an episode, so an evaluation
never trains (asserted there, and tested end to end).
"""

from __future__ import annotations

import math
import numbers
import time
from math import comb

from .agents import Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with c correct out of n samples (k <= n)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def is_correct(t, success_reward: float = 1.0, reported: bool = False) -> bool:
    """`reported`: whether any episode of its set (the task's; the step's) says info["correct"]; one that does not is then
    wrong (an Env episode cut by max_turns never reached the step that sets it, and a shaped reward
    summed over its looping turns passed success_reward: correct, while its siblings that
    answered were wrong). With none reporting it, the reward decides."""
    if t.error is not None:
        return False
    if "correct" in t.info:
        return bool(t.info["correct"])
    # (cut short, by max_turns, the context or max_tokens: no answer, whatever its shaped reward summed
    # to; a greedy evaluation looping on every task read pass@1 1.0)
    return not reported and not getattr(t, "truncated", False) and float(t.reward) >= success_reward


def reports_correct(episodes) -> bool:
    return any(t.error is None and "correct" in t.info for t in episodes)


def _mark(groups: list[list], greedy: bool = False) -> list[list]:
    """Evaluation episodes say so (never trained on), and which are greedy (a task's sampled and
    greedy episodes share its task_id in the record: pass@k recomputed from it mixed them)."""
    for g in groups:
        for t in g:
            t.info["eval"] = True
            if greedy:
                t.info["eval_greedy"] = True
    return groups


def check_ks(ks, n: int) -> None:
    """pass@k for every k in ks needs 1 <= k <= n samples a task."""
    bad = [k for k in ks if not isinstance(k, numbers.Integral) or isinstance(k, bool) or not 1 <= k <= n]
    if bad:
        raise ValueError(f"pass@k needs 1 <= k <= n = {n} samples per task; got k = {bad}")


def summarize(groups: list[list], ks: list[int] | None = None, success_reward: float = 1.0,
              prefix: str = "eval_") -> dict:
    """pass@k (k in ks, default default_ks(n)) over groups of n episodes of one task each, the
    mean reward and the counts, as flat metrics named `<prefix>pass@k`. pass@k counts a failed
    episode (crash, timeout) as wrong; the reward mean is over the episodes that ran (a failed one
    has no reward the agent computed): read it with `<prefix>failed`, or a policy that fails more
    can show a higher mean."""
    if not groups:
        raise ValueError("nothing to evaluate: no groups")
    n = min(len(g) for g in groups)
    ks = ks or default_ks(n)
    check_ks(ks, n)
    # (per task: an agent's episodes report it alike; a task whose episodes all looped reports none, and
    # is_correct reads them wrong as truncated). Each task's own samples, all of them: cut to the
    # fewest a task has, the rest were thrown away (which ones by their order) while the reward mean
    # counted them
    correct = [sum(is_correct(t, success_reward, reports_correct(g)) for t in g) for g in groups]
    out = {f"{prefix}pass@{k}": sum(pass_at_k(len(g), c, k) for g, c in zip(groups, correct)) / len(groups) for k in ks}
    rewards = [t.reward for g in groups for t in g if t.error is None]
    # None, not 0, when no episode finished: a reward nobody earned is not a measured 0
    out.update({f"{prefix}reward_mean": sum(rewards) / len(rewards) if rewards else None, f"{prefix}tasks": len(groups),
                f"{prefix}n": n, f"{prefix}failed": sum(t.error is not None for g in groups for t in g)})
    return out


def evaluate(rollout, tasks: list[Task], n: int = 4, greedy_rollout=None, ks: list[int] | None = None,
             success_reward: float = 1.0) -> tuple[dict, list[list]]:
    """Run the evaluation: (metrics, the evaluation groups, greedy ones appended after the
    sampled ones). Metrics: eval_pass@k, eval_reward_mean and eval_failed (sampled),
    eval_greedy_pass@1, eval_greedy_reward_mean and eval_greedy_failed (with greedy_rollout),
    eval_s. A reward mean is None where no episode finished."""
    tasks = list(tasks)
    if not tasks:
        raise ValueError("nothing to evaluate: no tasks")
    if ks:  # before any episode runs (after them, the whole evaluation was lost)
        check_ks(ks, n)
    # (text failed in is_correct after every episode had run, unrecorded; NaN scored every one wrong)
    if isinstance(success_reward, bool) or not isinstance(success_reward, (int, float)) or not math.isfinite(success_reward):
        raise ValueError(f"success_reward is the reward an episode must reach to count as correct, a finite number, "
                         f"got {success_reward!r}")
    t0 = time.time()
    sampled = _mark(rollout.run_groups(tasks, n, progress=False))
    metrics = summarize(sampled, ks, success_reward)
    groups = list(sampled)
    if greedy_rollout is not None:  # greedy samples are all alike: one per task
        greedy = _mark(greedy_rollout.run_groups(tasks, 1, progress=False), greedy=True)
        g = summarize(greedy, [1], success_reward, prefix="eval_greedy_")
        # with its failures: failed episodes count as wrong, so pass@1 alone hid a greedy run that failed
        metrics.update({k: v for k, v in g.items() if k in ("eval_greedy_pass@1", "eval_greedy_reward_mean",
                                                            "eval_greedy_failed")})
        groups += greedy
    metrics["eval_s"] = time.time() - t0
    return metrics, groups
