"""Continuous async vs sync loop, in one session (`make bench-async`): wall time per step and
what the staleness bound lets through, at async_lag (the bound) 1 and 2.

One session on the embedded default (reference engine, one trainer rank, the toy arithmetic
Env unless --agent), a warm-up step, then rounds of [sync, async lag 1, async lag 2, async lag 1
in finish order (LoopConfig.async_order)], each
`--steps` steps, interleaved so that a load change on the machine reaches every mode alike.
The trainer's gate (max_staleness) is 2, so both lags run under the same trainer. Printed per
mode: steady s/step (from the first step's end to the last's, over the steps between: an async run
starts with an empty pipeline, its first step waiting for a whole batch of rollouts as a sync step
does, and each run of --steps started that way again) and its ratio to sync; whole s/step (the
run's wall time over its steps, pipeline fill and drain included); the trainer's
gate pass ratio (sequences kept by the gate, over trained sequences); the loop's admission
ratio (groups admitted over groups finished: a group older than the bound is not trained);
the staleness histogram of trained tokens, summed. Results: bench/results/async_loop.json.

    .venv/bin/python bench/async_loop.py [--steps 6] [--rounds 2] [--prompts 8] [--group 4] [--agent FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

# (label, mode, async_lag, async_order): start order is the default (no group overtaken: a slow one
# holds its step); finish order trains the first groups to finish (long episodes drop out)
MODES = (("sync", "sync", 1, "start"), ("async lag 1", "async", 1, "start"), ("async lag 2", "async", 2, "start"),
         ("lag 1 finish", "async", 1, "finish"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="steps per mode per round (at least 2: the steady s/step is between step ends)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--agent", default=None, help="an agent file (default: the toy arithmetic Env)")
    p.add_argument("--backend", default="reference")
    args = p.parse_args()
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (the steady s/step is timed between the first and the last step's end), got {args.steps}")

    import workbench

    session = {"backend": args.backend, "trainer_ranks": 1, "max_tokens": args.max_tokens,
               "trainer": {"correction": {"max_staleness": 2}},
               "loop": {"prompts_per_step": args.prompts, "group_size": args.group}}
    if args.agent:
        session["agent"] = args.agent
    wb = workbench.connect(config=session)
    try:
        wb.run(1, progress=False).wait()  # warm-up, apart
        wall: dict = {label: [] for label, *_ in MODES}
        steady: dict = {label: [] for label, *_ in MODES}
        steps: dict = {label: [] for label, *_ in MODES}
        for _ in range(args.rounds):
            for label, mode, lag, order in MODES:
                t0 = time.time()
                hs = wb.run(args.steps, mode=mode, async_lag=lag, async_order=order, progress=False).wait()
                wall[label].append((time.time() - t0) / len(hs))
                ends = [h["train_end"] + h["sync_s"] for h in hs]  # (each step's end: trained and synced)
                steady[label].append((ends[-1] - ends[0]) / (len(ends) - 1))
                steps[label] += hs
    finally:
        wb.shutdown()

    sync_s, sync_whole_s = statistics.median(steady["sync"]), statistics.median(wall["sync"])
    table = {}
    for label, *_ in MODES:
        hs = steps[label]
        trained = len(hs) * args.prompts  # groups
        dropped = sum(h.get("groups_dropped_stale", 0) for h in hs)
        # (a step with nothing to train logs no gate statistics: it counts no sequence)
        sequences = sum(h["segments"] for h in hs if h.get("gate_pass_ratio") is not None)  # the gate's unit: a row
        table[label] = {
            "s_per_step": statistics.median(steady[label]), "vs_sync": statistics.median(steady[label]) / sync_s,
            "whole_s_per_step": statistics.median(wall[label]), "whole_vs_sync": statistics.median(wall[label]) / sync_whole_s,
            "gate_pass_ratio": sum((h.get("gate_pass_ratio") or 0.0) * h["segments"] for h in hs) / max(sequences, 1),
            "admitted_ratio": trained / (trained + dropped) if trained + dropped else 1.0,
            "groups_dropped_stale": dropped,
            "staleness_hist": dict(sorted(sum((Counter({int(k): v for k, v in (h.get("staleness_hist") or {}).items()})
                                                for h in hs), Counter()).items())),
            "episodes_spanning_versions": sum(h.get("episodes_spanning_versions", 0) for h in hs),
            "reward_mean": sum(h["reward_mean"] for h in hs) / len(hs)}
    for label, row in table.items():
        print(f"{label:12} {row['s_per_step']:6.2f} s/step ({row['vs_sync']:.2f}x sync; whole run {row['whole_s_per_step']:.2f}, "
              f"{row['whole_vs_sync']:.2f}x)  gate pass "
              f"{row['gate_pass_ratio']:.3f}  admitted {row['admitted_ratio']:.3f} ({row['groups_dropped_stale']} groups "
              f"dropped)  staleness {row['staleness_hist']}  spanning episodes {row['episodes_spanning_versions']}")
    out = Path(__file__).resolve().parent / "results" / "async_loop.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "modes": table}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
