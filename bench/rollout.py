"""Rollout benchmark: group rollouts through the full stack (runner actor, router, loopback
server, the OpenAI SDK inside the agent) against the engine driven directly with the same
requests (the prompts the engine actually received, replayed with the same concurrency).
Prints episodes/s, generated tokens/s and their ratio (target >= 0.85).

    .venv/bin/python bench/rollout.py [--prompts 8] [--group 4] [--turns 3] [--reply-tokens 128] [--runners 2]

Results: bench/results/rollout.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from replay_direct import group_episodes, replay_direct

AGENT = Path(__file__).parent / "agents" / "multi_turn_chat.py"


def cpu_by_process(runner_pids: list[int]) -> dict:
    """CPU seconds so far of the processes that matter (runner actors, this driver, the engine's)."""
    import psutil

    out = {f"runner actor {i}": psutil.Process(p).cpu_times() for i, p in enumerate(runner_pids)}
    out["driver"] = psutil.Process().cpu_times()
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "EngineCore" in (p.info["name"] or "") or "EngineHost" in cmd or "VllmWorker" in (p.info["name"] or ""):
            try:
                out[f"{p.info['name']}:{p.pid}"] = p.cpu_times()
            except psutil.Error:
                pass
    return {k: v.user + v.system for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reply-tokens", type=int, default=128)
    ap.add_argument("--runners", type=int, default=2, help="runner actors (each hosts a loopback server)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import ray

    from workbench.agents import Task
    from workbench.cluster import init_ray, shutdown_ray
    from workbench.rollout.actor import launch_engine, stop_engine
    from workbench.rollout.engine import SamplingConfig
    from workbench.rollout.runner import Rollout
    from workbench.toy.models import toy_model_path

    path = toy_model_path("moe")
    init_ray()
    engine = launch_engine("vllm", model_path=str(path), keep_log=True, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    # the policy's sampling runs on past the end of turn (ignore_eos: the runner then adds no stop
    # tokens; the agent's own ignore_eos leaves the family's turn ends stopping, by design): every
    # turn is --reply-tokens long (it was the toy's ~7-token reply while the docs said 128)
    rollout = Rollout(str(AGENT), [engine], str(path), num_runners=args.runners,
                      sampling=SamplingConfig(max_tokens=args.reply_tokens, ignore_eos=True))
    info = {"turns": args.turns, "reply_tokens": args.reply_tokens}
    tasks = [Task([{"role": "user", "content": f"Say something about topic {k}."}], info=info) for k in range(args.prompts)]
    try:
        rollout.run_groups(tasks[:2], group_size=2, progress=False)  # warm-up
        seen = len(ray.get(engine.sample_log.remote()))
        pids = [i["pid"] for i in rollout.info]
        procs = cpu_by_process(pids)
        t0 = time.perf_counter()
        groups = rollout.run_groups(tasks, group_size=args.group)
        full_s = time.perf_counter() - t0
        cpu_full = {k: v - procs[k] for k, v in cpu_by_process(pids).items() if k in procs}
        trajs = [t for g in groups for t in g]
        errors = [t.error for t in trajs if t.error]
        full_tokens = sum(s.stats["sampled_tokens"] for t in trajs for s in t.segments)
        if errors:  # (a ratio over fewer episodes compares other work)
            print(f"rollout: {len(errors)} of {len(trajs)} episodes failed: {errors[0].splitlines()[0]}")
        episodes = group_episodes(ray.get(engine.sample_log.remote())[seen:])
        procs = cpu_by_process(pids)
        # each call generates as many tokens as the full stack's did (call[1]: its sampled ids): the
        # policy's sampling stops at <|im_end|>, so a fixed max_tokens with ignore_eos made every
        # direct call longer than its full-stack twin (fewer requests a token: a ratio of other work)
        direct_tokens, direct_s = asyncio.run(replay_direct(
            engine, episodes, lambda call: SamplingConfig(max_tokens=max(1, len(call[1])), ignore_eos=True)))
        cpu_direct = {k: v - procs[k] for k, v in cpu_by_process(pids).items() if k in procs}
    finally:
        rollout.shutdown()
        stop_engine(engine)
        shutdown_ray()
    n = len(trajs)
    r = {"episodes": n, "errors": len(errors), "replayed_episodes": len(episodes),
         "full_s": full_s, "full_episodes_per_s": n / full_s, "full_tokens_per_s": full_tokens / full_s,
         "direct_s": direct_s, "direct_episodes_per_s": len(episodes) / direct_s, "direct_tokens_per_s": direct_tokens / direct_s}
    r["ratio"] = r["full_tokens_per_s"] / r["direct_tokens_per_s"]
    print(f"\nrollout: {args.prompts} prompts x {args.group} episodes, {args.turns} turns x {args.reply_tokens} tokens, "
          f"{args.runners} runner(s), tiny MoE on vLLM (CPU)")
    print(f"{'path':<28} {'episodes/s':>10} {'tokens/s':>10}")
    print(f"{'full stack (runner+router+SDK)':<28} {r['full_episodes_per_s']:>10.2f} {r['full_tokens_per_s']:>10.0f}")
    print(f"{'engine directly':<28} {r['direct_episodes_per_s']:>10.2f} {r['direct_tokens_per_s']:>10.0f}")
    print(f"ratio full / direct tokens/s: {r['ratio']:.2f}   (episode errors: {len(errors)})")
    print("CPU seconds by process (full stack | direct):")
    for k in cpu_full:
        print(f"  {k:<32} {cpu_full[k]:>7.2f} | {cpu_direct.get(k, 0.0):.2f}")
    r["cpu_full"], r["cpu_direct"] = cpu_full, cpu_direct
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "rollout.json").write_text(json.dumps({"args": vars(args), "result": r}, indent=1))


if __name__ == "__main__":
    main()
