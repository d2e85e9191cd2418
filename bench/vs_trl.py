"""workbench vs TRL's GRPOTrainer on the quickstart's own task, each side under the same
wall-clock budget including start-up (`make bench-vs-trl`, BENCH_ARGS="--budget 180").

Same checkpoint (the toy MoE), tokenizer and chat template, prompts (the arithmetic Env's tasks),
reward (its rule: 1 for the exact number, partial credit for a close one), batch (16 prompts x
8 completions), 8 new tokens at temperature 1, AdamW at lr 1e-3, grad-norm clip 1, no KL. TRL
runs in its own virtual environment made here (bench/.venv-trl: TRL is not a dependency of
workbench); it sees workbench's torch and transformers through a .pth file, so both sides run
the same library versions. The sides run one after the other, never together.

workbench runs twice: "workbench", the quickstart's synchronous loop, and "workbench-async",
the continuous async loop at async_lag 1 (the rollout keeps sampling while the trainer trains;
a group trains at most one version stale, its tokens corrected per token), on the same batch.
Each side is a fresh process; the parent takes the launch time, the child writes each step's
end time and mean reward. Printed: start-up (launch -> first step done), s/step (median of the
steps after the first two), reward per wall-clock second and per step, and for each reward level
both sides reach (trailing mean of 5 steps) the time to reach it, with and without start-up, as
a workbench / TRL ratio. And the CPU a step takes, by role (engine, trainer ranks, runner, driver,
Ray's own processes; the side's own processes, its local Ray's included, from /proc, from step 3 to
the last: until 2026-12-06 every process of the machine, another session's Ray workers counted as
the side's, so CPU figures quoted from before then may hold them) and the
cores it kept busy: wall time drifts with a shared machine's neighbours, the CPU split less, and
it tells work from waiting. Targets (issue 13): first step done under 20 s after connect(); s/step
at most 1.0x TRL's; time to a reward level at most 1.5x TRL's with start-up, 1.0x without.

The reward levels are what both sides reach on this task by the same route: the toy cannot add,
and the policy collapses onto one answer near the middle of the sums, which the partial credit
pays (notebook 00 shows it); this compares the same algorithm's speed, not learning.

A side whose rewards were all 0 for 5 steps or more is reported as collapsed (every group flat,
no gradient) and left out of the time-to-reward comparison: its curve says nothing about speed,
and it would pull the levels the others are compared at down to its own. The async side does
collapse at these hyper-parameters: on 2026-12-04, async_lag 1 with the quickstart's lr 1e-3 and
token TIS (cap 2) collapsed in 5 of 12 runs (3 of 4 here, 60 s each; 2 of 8 in the loop alone,
12-20 steps; 4 more fell to 0.01-0.09 and came back), the policy moving up to 8 nats a token between
versions (kl_k3_stale) where no importance weight corrects one-version-old samples; at lr 3e-4 it
learned in 4 of 4 (20-30 steps, no mean reward under 0.16), and the sync loop (1 of 5 dipped to
0.02, recovered) and TRL (0 of 3) are on-policy. The sync loop can stall too: later that day it
went 5 steps at reward 0 from step 7 in 1 of 5 runs here (then a lucky sample gave a reward and
it learned on; seed 0, not repeated on a rerun), TRL in 0 of 4. The loop warns when kl_k3_stale goes over 1.0
(loop.warn_policy_outran_correction) and after 5 steps without signal (loop.warn_no_signal).

    .venv/bin/python bench/vs_trl.py [--budget 120] [--sides trl workbench workbench-async] [--backend vllm|reference] [--seeds 0 1 2] [--trainer-ranks N]
Results: bench/results/vs_trl.json. With several --seeds every side runs once per seed and the
medians over the seeds follow: one run's time to a reward level rides on its own reward curve.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRL_VENV = HERE / ".venv-trl"
TRL_VERSION = "1.16.0"
PROMPTS, GROUP, MAX_TOKENS, LR = 16, 8, 8, 1e-3


def reward(text: str, answer: int) -> float:
    """The arithmetic Env's rule (workbench/examples/arithmetic_env.py), on a completion's text."""
    import re

    m = re.fullmatch(r"\s*(-?\d+)\s*", text or "")
    if m is None:
        return 0.0
    return 1.0 if int(m.group(1)) == answer else 0.5 * max(0.0, 1.0 - abs(int(m.group(1)) - answer) / 10)


def trl_python() -> str:
    """bench/.venv-trl with TRL (and accelerate) installed, seeing workbench's site-packages."""
    py = TRL_VENV / "bin" / "python"
    if not (TRL_VENV / ".ready").exists():
        print(f"making {TRL_VENV} (trl=={TRL_VERSION}) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(TRL_VENV)], check=True)
        site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        ours = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        # after the venv's own packages; addsitedir also runs that dir's .pth files (workbench's editable install)
        Path(site, "workbench_site.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"trl=={TRL_VERSION}", "accelerate"], check=True)
        (TRL_VENV / ".ready").write_text(TRL_VERSION)
    return str(py)


def _record(out: Path, event: dict) -> None:
    with open(out, "a") as f:
        f.write(json.dumps({"t": time.time(), **event}) + "\n")


# CPU seconds by role, over this side's own processes (Linux /proc: the side's process and its
# descendants, its local Ray's included). Wall time on a shared machine drifts with its
# neighbours; where the CPU goes drifts less. (Over every process of the machine, another
# session's Ray workers counted as this side's, on both sides.)
ROLES = {"ray::EngineHost": "engine", "ray::TrainerWorker": "trainer", "ray::RolloutRunner": "runner"}
CPU_FROM_STEP = 3  # counted from the end of this step (start-up and the first steps left out) to the last


def cpu_by_role() -> dict[str, list]:
    """{pid: [role, CPU seconds]} of this process and its descendants (per process: one that
    exits between two marks is left out of their difference, not subtracted from it)."""
    tick, me, procs = os.sysconf("SC_CLK_TCK"), os.getpid(), {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        procs[int(pid)] = (int(fields[1]), cmd, (int(fields[11]) + int(fields[12])) / tick)  # ppid, cmd, utime + stime
    out = {}
    for pid, (ppid, cmd, secs) in procs.items():
        up = pid
        while up not in (me, 0, 1) and up in procs:
            up = procs[up][0]
        if up != me:
            continue
        role = "driver" if pid == me else next((r for k, r in ROLES.items() if cmd.startswith(k)),
                                                "ray" if "ray" in cmd else "other")
        out[str(pid)] = [role, secs]
    return out


def cpu_delta(a: dict, b: dict) -> dict[str, float]:
    """CPU seconds by role between two marks, over the processes alive at the second (a process
    new since the first counts whole)."""
    out: dict[str, float] = {}
    for pid, (role, secs) in b.items():
        out[role] = out.get(role, 0.0) + secs - (a[pid][1] if pid in a else 0.0)
    return out


def _cpu_mark(out: Path, step: int, last: bool) -> None:
    """The CPU by role at the end of step CPU_FROM_STEP, and at the last step (budget over)."""
    if step == CPU_FROM_STEP or last:
        _record(out, {"event": "cpu", "step": step, "cpu": cpu_by_role()})


def run_trl(out: Path, budget_end: float, seed: int) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from workbench.examples.arithmetic_env import tasks
    from workbench.toy.models import toy_model_path

    torch.manual_seed(seed)
    path = str(toy_model_path("moe"))
    rows = [{"prompt": t.messages, "answer": t.label} for t in tasks(PROMPTS * 400, seed)]

    def arithmetic_reward(completions, answer, **_):
        return [reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                _record(out, {"event": "step", "step": state.global_step, "reward": logs["reward"]})

        def on_step_end(self, args, state, control, **kw):
            over = time.time() > budget_end
            _cpu_mark(out, state.global_step, over)
            if over:
                control.should_training_stop = True

    cfg = GRPOConfig(output_dir=str(out.parent / "trl-out"), per_device_train_batch_size=PROMPTS * GROUP,
                     num_generations=GROUP, max_completion_length=MAX_TOKENS, learning_rate=LR, weight_decay=0.0,
                     max_grad_norm=1.0, beta=0.0, temperature=1.0, logging_steps=1, report_to="none",
                     save_strategy="no", use_cpu=True, bf16=False, max_steps=10_000, seed=seed,
                     lr_scheduler_type="constant", warmup_steps=0)
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
                          processing_class=AutoTokenizer.from_pretrained(path), reward_funcs=arithmetic_reward,
                          args=cfg, train_dataset=Dataset.from_list(rows), callbacks=[Clock()])
    _record(out, {"event": "ready"})
    trainer.train()


# workbench's sides: the loop's mode. "workbench-async" is the continuous async loop at
# async_lag 1 (rollout keeps sampling while the trainer trains; a group trains at most one
# version stale, corrected per token): the same batch and task, so its time to a reward level
# is comparable with TRL's on-policy one.
WORKBENCH_SIDES = {"workbench": {"mode": "sync"}, "workbench-async": {"mode": "async", "async_lag": 1}}


def run_workbench(out: Path, budget_end: float, seed: int, backend: str, side: str, trainer_ranks: int | None) -> None:
    import shutil

    _record(out, {"event": "connect"})  # the target's clock: connect() (its import included) to the first step done
    import workbench

    run_dir = out.parent / f"{side}-run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a session refuses a run_dir that holds a run
    wb = workbench.connect(backend=backend, seed=seed, run_dir=str(run_dir), max_tokens=MAX_TOKENS,
                           loop={"prompts_per_step": PROMPTS, "group_size": GROUP, **WORKBENCH_SIDES[side]},
                           **({"trainer_ranks": trainer_ranks} if trainer_ranks else {}))
    _record(out, {"event": "ready"})

    class Clock:
        def on_step(self, m):
            _record(out, {"event": "step", "step": m["step"] + 1, "reward": m["reward_mean"]})
            over = time.time() > budget_end
            _cpu_mark(out, m["step"] + 1, over)
            if over:
                wb.stop()

    try:
        wb.run(100_000, monitors=[Clock()], progress=False).wait()
    finally:
        wb.shutdown()


def step_breakdown(run_dir: Path) -> dict:
    """workbench's steps after the first two: the mean share of a step in rollout, building the
    batch, the trainer's step (Ray call included) and the checked weight sync; "other" is the
    driver's own work between them (records written, metrics, the next step's start)."""
    ms = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][2:]
    if not ms:
        return {}
    step = statistics.mean(m["step_s"] for m in ms)
    parts = {"rollout": "rollout_s", "batch": "batch_s", "train": "train_s", "sync": "sync_s"}
    if ms[0].get("mode") == "async":  # its groups roll out while earlier steps train: no share of a step
        del parts["rollout"]
    share = {k: statistics.mean(m[v] for m in ms) / step for k, v in parts.items()}
    share["train"] -= share["batch"]  # train_s includes batch_s
    # async: the rest is the wait for the step's groups (and the driver's own work)
    share["waiting" if "rollout" not in parts else "other"] = 1 - sum(share.values())
    return {"step_s": step, **{k: round(v, 3) for k, v in share.items()}}


def summarize(name: str, launch: float, events: list[dict]) -> dict:
    steps = [e for e in events if e["event"] == "step"]
    if not steps:
        return {"side": name, "steps": 0}
    ends = [e["t"] - launch for e in steps]
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    ready = next((e["t"] - launch for e in events if e["event"] == "ready"), None)
    marks = [e for e in events if e["event"] == "cpu"]
    cpu = None
    if len(marks) >= 2 and marks[-1]["step"] > marks[0]["step"]:
        a, b = marks[0], marks[-1]
        n, span = b["step"] - a["step"], b["t"] - a["t"]
        cpu = {k: v / n for k, v in cpu_delta(a["cpu"], b["cpu"]).items()}
        cpu = {"per_step_s": sum(cpu.values()), "cores_busy": sum(cpu.values()) * n / span, "by_role": cpu}
    return {"side": name, "steps": len(steps), "cpu": cpu, "ready_s": ready, "first_step_done_s": ends[0],
            "first_step_after_ready_s": ends[0] - ready if ready is not None else None,
            "connect_to_first_step_s": next((ends[0] + launch - e["t"] for e in events if e["event"] == "connect"), None),
            "s_per_step": statistics.median(gaps[1:] or gaps or [float("nan")]),  # (gaps[i]: step i+1's)
            "rewards": [e["reward"] for e in steps], "ends": ends,
            "reward_per_s": sum(e["reward"] for e in steps) / ends[-1], "reward_per_step": statistics.mean(e["reward"] for e in steps),
            "collapsed_at": collapsed_at([e["reward"] for e in steps])}


COLLAPSE_STEPS = 5  # the loop's no-signal warning's streak (loop.NO_SIGNAL_STEPS)


def collapsed_at(rewards: list[float]) -> int | None:
    """The first step (1-based) of the first run of at least COLLAPSE_STEPS steps whose rewards
    were all 0: every group flat, so no gradient, and a policy stays so unless a stale group
    still carries a reward. A side that collapsed says nothing about speed: its time to a reward
    level is not compared, and it does not set the levels the other sides are compared at."""
    streak = 0
    for i, r in enumerate(rewards):
        streak = streak + 1 if r == 0.0 else 0
        if streak == COLLAPSE_STEPS:
            return i + 2 - COLLAPSE_STEPS
    return None


def time_to(s: dict, level: float, window: int = 5) -> tuple[float, float] | None:
    """(seconds from launch, seconds from the first step's start) at which the trailing mean reward first reaches level."""
    r = s.get("rewards") or []
    for i in range(window - 1, len(r)):
        if _window_mean(r[i - window + 1:i + 1]) >= level:
            return s["ends"][i], s["ends"][i] - (s["ends"][0] - s["s_per_step"])
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=120.0, help="seconds per side, start-up included")
    ap.add_argument("--sides", nargs="+", default=["trl", *WORKBENCH_SIDES], choices=["trl", *WORKBENCH_SIDES])
    ap.add_argument("--backend", default="vllm", choices=["vllm", "reference"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0],
                    help="every side runs once per seed; with more than one, the medians over the seeds follow")
    ap.add_argument("--trainer-ranks", type=int, help="workbench's FSDP2 ranks (default: connect()'s)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--budget-end", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one side, in its own process
        out = Path(a.out)
        if a.child == "trl":
            run_trl(out, a.budget_end, a.seed)
        else:
            run_workbench(out, a.budget_end, a.seed, a.backend, a.child, a.trainer_ranks)
        return
    from workbench.toy.models import toy_model_path

    toy_model_path("moe")  # built (or found in the cache) before any clock starts
    results_dir = HERE / "results"
    results_dir.mkdir(exist_ok=True)
    runs: dict[int, dict] = {}  # seed -> side -> summary

    def save() -> None:  # after each side: a side failing later loses none of the earlier ones
        (results_dir / "vs_trl.json").write_text(json.dumps({"args": vars(a), "runs": {str(k): v for k, v in runs.items()}},
                                                            indent=1))

    for seed in a.seeds:
        summaries = runs[seed] = {}
        for side in a.sides:
            py = trl_python() if side == "trl" else sys.executable
            out = results_dir / f"vs_trl_{side}.jsonl"
            out.unlink(missing_ok=True)
            launch = time.time()
            print(f"{side}, seed {seed}: {a.budget:.0f} s from launch ...", flush=True)
            child = subprocess.run([py, __file__, "--child", side, "--out", str(out), "--budget-end", str(launch + a.budget),
                            "--backend", a.backend, "--seed", str(seed),
                            *(["--trainer-ranks", str(a.trainer_ranks)] if a.trainer_ranks else [])],
                           stdout=subprocess.DEVNULL if not os.environ.get("BENCH_VERBOSE") else None,
                           stderr=subprocess.DEVNULL if not os.environ.get("BENCH_VERBOSE") else None)
            if child.returncode:  # (its steps up to the failure are still reported, marked)
                print(f"{side}, seed {seed}: its process exited with {child.returncode} (BENCH_VERBOSE=1 shows why)", flush=True)
            events = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
            summaries[side] = {**summarize(side, launch, events), **({"exit_code": child.returncode} if child.returncode else {})}
            if side != "trl" and (results_dir / f"{side}-run" / "metrics.jsonl").exists():
                summaries[side]["breakdown"] = step_breakdown(results_dir / f"{side}-run")
            save()
        print(f"-- seed {seed}")
        report(summaries, a)
    if len(a.seeds) > 1:
        report_over_seeds(runs)


def _window_mean(rewards: list[float]) -> float:
    """A window's mean reward; -inf where a step of it has none (NaN: no episode finished), which no
    level is reached by (max() of a NaN first window was NaN, and the report failed on floor(nan))."""
    return statistics.mean(rewards) if all(math.isfinite(x) for x in rewards) else -math.inf


def best_trailing_mean(rewards: list[float], window: int = 5) -> float:
    return max(_window_mean(rewards[i:i + window]) for i in range(max(1, len(rewards) - window + 1)))


def report_over_seeds(runs: dict[int, dict]) -> None:
    """Medians over the seeds: a single run's time to a reward level rides on its own reward
    curve (two runs of the same sides and seed an hour apart: 2.64x and 1.71x TRL's time to reward
    0.28-0.29 after start-up), the medians less. The levels are common to every run: fractions of
    the lowest best trailing mean of any."""
    seeds = sorted(runs)
    sides = [name for name in runs[seeds[0]] if all(runs[k].get(name, {}).get("steps") for k in seeds)]
    print(f"-- medians over seeds {seeds}")
    for name in sides:
        xs = [runs[k][name] for k in seeds]
        print(f"{name:15s}: ready {statistics.median(x['ready_s'] for x in xs):5.1f} s, first step done "
              f"{statistics.median(x['first_step_done_s'] for x in xs):5.1f} s, "
              f"{statistics.median(x['s_per_step'] for x in xs):.2f} s/step"
              + (f", connect() to the first step done {statistics.median(x['connect_to_first_step_s'] for x in xs):.1f} s"
                 if all(x.get("connect_to_first_step_s") is not None for x in xs) else ""))
    if "trl" not in sides:
        return
    for name in sides:
        if name == "trl":
            continue
        collapsed = [k for k in seeds if runs[k][name].get("collapsed_at") or runs[k]["trl"].get("collapsed_at")]
        if collapsed:
            print(f"{name} or TRL: collapsed ({COLLAPSE_STEPS}+ steps of reward 0) in seed(s) {collapsed}; those seeds' "
                  "times to a reward level are left out")
        ok = [k for k in seeds if k not in collapsed]
        # the levels: fractions of the lowest best trailing mean of this side and TRL in those seeds
        top = min((best_trailing_mean(runs[k][n]["rewards"]) for k in ok for n in (name, "trl")), default=None)
        print(f"{name}: s/step / TRL, per seed "
              + ", ".join(f"{runs[k][name]['s_per_step'] / runs[k]['trl']['s_per_step']:.2f}x" for k in seeds)
              + f"; median {statistics.median(runs[k][name]['s_per_step'] / runs[k]['trl']['s_per_step'] for k in seeds):.2f}x")
        for level in reward_levels(top) if top else []:
            pairs = [(time_to(runs[k][name], level), time_to(runs[k]["trl"], level)) for k in ok]
            reached = [(w, t) for w, t in pairs if w and t]
            if len(reached) < len(pairs):  # (said: a median over the seeds both reached it is selected on the outcome)
                print(f"  reward {level:.2f}: reached by both in {len(reached)} of {len(pairs)} seeds")
            pairs = reached
            if not pairs:
                continue
            with_s, after = [w[0] / t[0] for w, t in pairs], [w[1] / t[1] for w, t in pairs]
            print(f"  reward {level:.2f}: {name} / TRL with start-up {', '.join(f'{r:.2f}' for r in with_s)} (median "
                  f"{statistics.median(with_s):.2f}x, target <= 1.5x); after it {', '.join(f'{r:.2f}' for r in after)} "
                  f"(median {statistics.median(after):.2f}x, target <= 1.0x)")


def reward_levels(top: float) -> list[float]:
    """The reward levels compared: 0.6, 0.8 and 1.0 of the lower side's best trailing mean, rounded
    DOWN to 0.01 (rounded to nearest, 1.0 of 0.4465 was 0.45, which that side never reached: the
    headline level vanished from the report unsaid)."""
    return [math.floor(top * f * 100 + 1e-9) / 100 for f in (0.6, 0.8, 1.0)]


def report(s: dict, a) -> None:
    for name, x in s.items():
        if not x["steps"]:
            print(f"{name:15s}: no step finished within {a.budget:.0f} s")
            continue
        x.setdefault("collapsed_at", collapsed_at(x["rewards"]))  # (a summary saved before the field)
        print(f"{name:15s}: ready {x['ready_s']:5.1f} s, first step done {x['first_step_done_s']:5.1f} s "
              f"({x['first_step_after_ready_s']:.1f} s after ready), {x['s_per_step']:.2f} s/step, {x['steps']} steps, "
              f"reward/step {x['reward_per_step']:.3f}, reward/s {x['reward_per_s']:.3f}, last-5 mean "
              f"{statistics.mean(x['rewards'][-5:]):.3f}")
        if x.get("breakdown"):
            print(f"{'':15s}  a step's share: " + ", ".join(f"{k} {v:.0%}" for k, v in x["breakdown"].items() if k != "step_s"))
        if x.get("cpu"):
            c = x["cpu"]
            roles = ", ".join(f"{k} {v:.2f}" for k, v in sorted(c["by_role"].items(), key=lambda kv: -kv[1]))
            print(f"{'':15s}  CPU a step {c['per_step_s']:.2f} s ({roles}), {c['cores_busy']:.2f} cores busy")
    trl = s.get("trl")
    if not trl or not trl["steps"]:
        return
    for name, wb in s.items():
        if name == "trl" or not wb["steps"]:
            continue
        print(f"{name}: s/step {name} / TRL: {wb['s_per_step'] / trl['s_per_step']:.2f}x (target <= 1.0x)"
              + (f"; connect() to the first step done: {wb['connect_to_first_step_s']:.1f} s (target < 20 s)"
                 if wb.get("connect_to_first_step_s") is not None else ""))
        if wb.get("cpu") and trl.get("cpu"):
            print(f"  CPU a step {name} / TRL: {wb['cpu']['per_step_s'] / trl['cpu']['per_step_s']:.2f}x "
                  f"({wb['cpu']['cores_busy']:.2f} vs {trl['cpu']['cores_busy']:.2f} cores busy)")
        for who, x in ((name, wb), ("TRL", trl)):
            if x.get("collapsed_at"):
                at = x["collapsed_at"]
                zeros = next((n for n, r in enumerate(x["rewards"][at - 1:]) if r != 0.0), None)
                how = (f"{zeros} steps of reward 0 (every group flat, no gradient), then a lucky sample gave rewards again"
                       if zeros is not None else "reward 0 from there to the end (every group flat, no gradient)")
                print(f"  {who} collapsed at step {at}: {how}; times to a reward level are not compared")
        if wb.get("collapsed_at") or trl.get("collapsed_at"):
            continue
        top = min(best_trailing_mean(x["rewards"]) for x in (wb, trl))
        for level in reward_levels(top):
            tw, tt = time_to(wb, level), time_to(trl, level)
            if tw and tt:
                print(f"  reward {level:.2f}: {name} {tw[0]:5.1f} s / TRL {tt[0]:5.1f} s = {tw[0] / tt[0]:.2f}x with start-up "
                      f"(target <= 1.5x); {tw[1]:5.1f} / {tt[1]:5.1f} s = {tw[1] / tt[1]:.2f}x after it (target <= 1.0x)")


if __name__ == "__main__":
    main()
