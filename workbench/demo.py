"""Command-line demo of the engine stack on the embedded default (`make demo-script`):
local Ray, the tiny MoE in vLLM inside a Ray actor, a few sampled episodes of the toy
arithmetic task printed with their token ids, behaviour log-probs and policy versions, then a
weight sync mid-generation (a partial rollout spanning two versions) with its post-sync check,
and a short RL run on the toy task (rollouts -> FSDP2 trainer -> checked weight sync) whose
reward rises.

    python -m workbench.demo [--backend vllm|reference] [--model moe|dense] [--prompts 3] [--group 4]
    python -m workbench.demo --agent workbench/examples/calculator_openai.py   # roll out an agent file
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
import random
import re
import time


def reward(problem, text: str) -> float:
    """1 when the reply is exactly the right number, else 0."""
    m = re.fullmatch(r"\s*(-?\d+)\s*", text)
    return float(m is not None and int(m.group(1)) == problem.answer)


def token_table(tokenizer, sample, limit: int = 12) -> str:
    rows = [f"    {'pos':>3} {'id':>5}  {'token':<14} {'logprob':>9} {'version':>7}"]
    for j, (t, lp, v) in enumerate(zip(sample.token_ids, sample.logprobs, sample.versions)):
        if j == limit:
            rows.append(f"    ... {len(sample.token_ids) - limit} more")
            break
        rows.append(f"    {j:>3} {t:>5}  {tokenizer.decode([t])!r:<14} {lp:>9.4f} {v:>7}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="vllm", choices=["vllm", "reference"])
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    # (the RL run at the end keeps its own: 16 prompts x 8, temperature 1, the tasks seeded by step)
    ap.add_argument("--prompts", type=int, default=3, help="prompts of step 4 (or of --agent's rollout)")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt in step 4 (or --agent's)")
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of step 4 (or --agent's); "
                    "step 5 and the RL run sample at 1, the temperature the trainer computes log-probs at")
    ap.add_argument("--seed", type=int, default=0, help="seed of step 4's prompts (or --agent's tasks) and of the "
                    "engine's sampling")
    ap.add_argument("--agent", help="an agent file (defines AgentRunner and tasks(n, seed)) to roll out instead")
    ap.add_argument("--rl-steps", type=int, default=16, help="steps of the short RL run at the end (0 skips it)")
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import ray
    import torch

    from .cluster import init_ray, shutdown_ray
    from .rollout.actor import launch_engine, stop_engine
    from .rollout.engine import SamplingConfig, expected_probe_logprobs, probe_ids
    from .toy.models import load_hf_model, load_tokenizer, toy_model_path
    from .toy.tasks import arithmetic_problem

    print(f"[1/6] tiny {args.model} checkpoint (built once, then cached)")
    path = toy_model_path(args.model)
    tokenizer = load_tokenizer(path)
    print(f"      {path}")

    print("[2/6] local Ray")
    init_ray()
    print(f"[3/6] {args.backend} engine in a Ray actor")
    t0 = time.perf_counter()
    engine = launch_engine(args.backend, model_path=str(path), seed=args.seed, env={"VLLM_LOGGING_LEVEL": "WARNING"})
    print(f"      started in {time.perf_counter() - t0:.1f} s: {ray.get(engine.info.remote())}")
    try:
        if args.agent:
            return run_agent(args, engine, path)
        print(f"[4/6] {args.prompts} prompts x {args.group} samples (temperature {args.temperature})")
        rng = random.Random(args.seed)
        problems = [arithmetic_problem(rng) for _ in range(args.prompts)]
        prompt_ids = [tokenizer.apply_chat_template(p.messages, add_generation_prompt=True)["input_ids"] for p in problems]
        sampling = SamplingConfig(temperature=args.temperature, max_tokens=16)
        refs = [[engine.generate.remote(ids, sampling) for _ in range(args.group)] for ids in prompt_ids]
        total = 0.0
        for p, group in zip(problems, refs):
            samples = ray.get(group)
            print(f"\n  Q: {p.messages[-1]['content']}  (answer {p.answer})")
            for s in samples:
                text = tokenizer.decode(s.token_ids, skip_special_tokens=True)
                r = reward(p, text)
                total += r
                print(f"    -> {text!r:<12} reward {r:.0f}  {len(s.token_ids)} tokens, finish={s.finish_reason}, "
                      f"sum logprob {sum(s.logprobs):.3f}")
            print(token_table(tokenizer, samples[0]))
        print(f"\n  mean reward {total / (args.prompts * args.group):.2f}")

        print("\n[5/6] weight sync during generation (partial rollout) with the post-sync check")
        model = load_hf_model(path)
        g = torch.Generator().manual_seed(1)
        new = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
        model.load_state_dict(new)
        long = engine.generate.remote(prompt_ids[0], SamplingConfig(max_tokens=200, ignore_eos=True))
        time.sleep(0.5)
        report = ray.get(engine.update_weights.remote(new, None, expected_probe_logprobs(model, probe_ids(len(tokenizer)))))
        s = ray.get(long)
        spans = {v: s.versions.count(v) for v in sorted(set(s.versions))}
        print(f"      synced to version {report.version} in {report.seconds:.2f} s "
              f"({report.bytes / 1e6:.1f} MB); probe log-prob max |diff| {report.probe_max_abs_diff:.2e}: engine serves the new weights")
        print(f"      the in-flight request's {len(s.token_ids)} tokens by version: {spans}")
        if args.rl_steps:
            run_rl(args, engine, path)
    finally:
        stop_engine(engine)
        shutdown_ray()
    print("\ndone.")
    return 0


def run_rl(args, engine, path) -> None:
    """A short sync RL run on the toy Env: rollouts on this engine, 2 FSDP2 ranks, GRPO + PPO clip."""
    from .agents import load_agent
    from .correction import CorrectionConfig
    from .loop import LoopConfig, run
    from .rollout.engine import SamplingConfig
    from .rollout.runner import Rollout
    from .trainer.fsdp import Trainer, TrainerConfig

    agent = str(Path(__file__).parent / "examples" / "arithmetic_env.py")
    spec = load_agent(agent)
    print(f"\n[6/6] RL on the toy task: {args.rl_steps} steps x 16 prompts x 8 samples, 2 FSDP2 ranks (gloo)")
    rollout = Rollout(agent, [engine], str(path), sampling=SamplingConfig(max_tokens=8))
    trainer = Trainer(str(path), world_size=2, cfg=TrainerConfig(lr=1e-3, micro_batch_size=64, correction=CorrectionConfig.tis()))
    try:
        run(rollout, trainer, [engine], lambda n, step: spec.tasks(n, seed=1000 + step),
                 LoopConfig(steps=args.rl_steps, prompts_per_step=16, group_size=8), progress=False,
                 on_step=lambda m: print(f"      step {m['step']:>2}  reward {_num(m.get('reward_mean')):.3f}  "
                                         f"exact {_num(m.get('correct_rate')):.3f}  loss {_num(m.get('loss')):+.4f}  "
                                         f"k3 {_num(m.get('kl_k3')):.1e}  sync |diff| {_num(m.get('sync_max_abs_diff')):.1e}  "
                                         f"{m['step_s']:.1f} s"))
    finally:
        rollout.shutdown()
        trainer.shutdown()


def _num(value) -> float:
    """A step's statistic to print: NaN where the step has none (a step with nothing to train logs no
    loss, k3 or sync; reading it raised out of on_step and ended the demo's run)."""
    return float("nan") if value is None else float(value)


def run_agent(args, engine, path) -> int:
    """Roll out an agent file's own tasks through runner actors and print what was recorded."""
    from .agents import load_agent
    from .rollout.engine import SamplingConfig
    from .rollout.runner import Rollout
    from .tokens import segment_stats

    spec = load_agent(args.agent)
    if spec.tasks is None:
        raise SystemExit(f"{args.agent} defines no tasks(n, seed) function to draw prompts from")
    print(f"[4/4] {args.agent} ({spec.kind}): {args.prompts} tasks x {args.group} episodes (instead of steps 4-6)")
    rollout = Rollout(args.agent, [engine], str(path), sampling=SamplingConfig(max_tokens=64, temperature=args.temperature))
    try:
        groups = rollout.run_groups(spec.tasks(args.prompts, seed=args.seed), group_size=args.group)
    finally:
        rollout.shutdown()
    for g in groups:
        for t in g:
            s = segment_stats(t.segments)
            print(f"  episode {t.episode_id} group {t.group_id}: reward {t.reward:.2f}, {s['segments']} segment(s), "
                  f"{s['sampled_tokens']} sampled tokens, seals {s['seals']}" + (f", ERROR {t.error.splitlines()[0]}" if t.error else ""))
    # over the episodes that finished, as reward_mean everywhere else (a failed one's 0 is no reward earned)
    rewards = [t.reward for g in groups for t in g if t.error is None]
    failed = sum(t.error is not None for g in groups for t in g)
    print(f"\n  mean reward {sum(rewards) / max(len(rewards), 1):.2f} over {len(rewards)} finished episodes"
          + (f" ({failed} failed)" if failed else ""))
    # (a script or CI checking an agent file read success where every episode failed)
    return 1 if failed and not rewards else 0


if __name__ == "__main__":
    raise SystemExit(main())
