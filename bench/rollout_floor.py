"""Where a sync step's rollout time goes, from the floor up (`make bench-rollout-floor`).

The quickstart's rollout batch (16 arithmetic prompts x 8 completions, up to 8 new tokens at
temperature 1, the toy MoE) generated four ways, each in a fresh process, one after the other:

  hf-generate     transformers' `generate` on one left-padded batch: TRL's GRPOTrainer path
  vllm-llm        vLLM's own offline `LLM.generate`, with the engine arguments workbench uses
  engine          workbench's engine (rollout/vllm_engine.py: vLLM's engine core stepped in the
                  process, rollout/vllm_inproc.py), 128 concurrent `generate` calls
  engine-ray      that engine as the Ray actor a loop uses, sent one `generate_many` call of the
                  128 requests as a rollout's router coalesces its first turns

Prints each one's median seconds a batch (after warm-up), its engine forwards a batch (the
vLLM ones), and its ratio to hf-generate. Each layer's cost is the difference to the one above.
A loop's `rollout_s` (metrics.jsonl; bench/vs_trl.py prints its share of a step) adds the runner
(the Env episodes, the router, the records) on top of engine-ray.

Why it exists (issue 13): TRL's whole step is generation + training in one process. This
shows how much of the gap to it is vLLM's own CPU stepping of a 2-layer model (the floor no
wrapper removes) and how much is ours. Three runs on 2026-12-05 (2 cores, a slow hour):

  hf-generate  0.096-0.109 s
  vllm-llm     0.105-0.116 s   0.97-1.21x
  engine       0.164-0.173 s   1.51-1.74x
  engine-ray   0.184-0.234 s   1.93-2.32x

So vLLM's own floor is level with transformers' generate on this model. Ours adds ~0.05 s in the
engine's process, most of it the stepping thread and the event loop handing the GIL back and
forth at every torch op: stepping on the loop instead cut `engine` to 0.126-0.149 s. Ray adds
~0.02-0.06 s more, which stepping on the loop did not cut (`engine-ray` 0.206-0.256 vs
0.203-0.224 s in alternating runs), and it held loopback requests behind each step: not kept
(docs/ARCHITECTURE.md, the in-process engine core).

On 2026-12-07 the rollout's first turns went to the engine as one call (they went as 16, a
group's each): engine-ray 0.111 -> 0.089 s against engine 0.068-0.073 s (Ray's share ~43 ->
~16 ms; the sends of one run, --only engine engine-ray).

Even a rollout at the floor would leave the step with the checked weight sync (0.07 s), which
TRL's single model copy does not have: ~25% of TRL's 0.28 s step on a quiet machine, so the
sync loop would reach TRL's s/step only with a train step that much shorter than TRL's.

    .venv/bin/python bench/rollout_floor.py [--reps 12] [--only hf-generate vllm-llm engine engine-ray]

Results: bench/results/rollout_floor.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS, GROUP, MAX_TOKENS, MAX_MODEL_LEN = 16, 8, 8, 1024  # the quickstart's (vs_trl.py's) batch
VARIANTS = ("hf-generate", "vllm-llm", "engine", "engine-ray")


def batch() -> tuple[str, list[list[int]]]:
    """The toy MoE's path and the quickstart's prompts as token ids (the chat template's)."""
    from workbench.examples.arithmetic_env import tasks
    from workbench.toy.models import load_tokenizer, toy_model_path

    path = str(toy_model_path("moe"))
    tok = load_tokenizer(path)
    return path, [tok.apply_chat_template(t.messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
                  for t in tasks(PROMPTS, 0)]


def count_forwards(executor) -> list:
    """Wrap a vLLM executor's execute_model: the list gets one entry per engine forward."""
    calls, inner = [], executor.execute_model

    def execute_model(*a, **k):
        calls.append(1)
        return inner(*a, **k)

    executor.execute_model = execute_model
    return calls


def hf_generate(reps: int) -> tuple[list[float], list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    from workbench.toy.models import load_tokenizer

    path, prompts = batch()
    tok = load_tokenizer(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    inputs = tok.pad({"input_ids": [p for p in prompts for _ in range(GROUP)]}, return_tensors="pt")
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=True, temperature=1.0, top_k=0,
                           pad_token_id=tok.pad_token_id)
        times.append(time.perf_counter() - t)
    return times, []


def vllm_llm(reps: int) -> tuple[list[float], list[int]]:
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # its engine core in this process, as workbench's
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from workbench.rollout.vllm_engine import VLLMEngine

    path, prompts = batch()
    llm = LLM(**VLLMEngine(path, max_model_len=MAX_MODEL_LEN).engine_args)
    forwards = count_forwards(llm.llm_engine.engine_core.engine_core.model_executor)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, logprobs=0, detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=p) for p in prompts for _ in range(GROUP)]
    times, counts = [], []
    for _ in range(reps):
        forwards.clear()
        t = time.perf_counter()
        llm.generate(requests, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        counts.append(len(forwards))
    return times, counts


def engine(reps: int) -> tuple[list[float], list[int]]:
    import asyncio

    from workbench.rollout.engine import SamplingConfig, create_engine

    path, prompts = batch()
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0)

    async def run():
        e = create_engine("vllm", model_path=path, max_model_len=MAX_MODEL_LEN)
        await e.start()
        forwards = count_forwards(e.llm.engine.engine_core.engine_core.model_executor)
        times, counts = [], []
        try:
            for _ in range(reps):
                forwards.clear()
                t = time.perf_counter()
                await asyncio.gather(*[e.generate(p, sampling) for p in prompts for _ in range(GROUP)])
                times.append(time.perf_counter() - t)
                counts.append(len(forwards))
        finally:
            await e.shutdown()
        return times, counts

    return asyncio.run(run())


def engine_ray(reps: int) -> tuple[list[float], list[int]]:
    import ray

    from workbench.cluster import init_ray
    from workbench.rollout.actor import launch_engine, stop_engine
    from workbench.rollout.engine import SamplingConfig

    path, prompts = batch()
    sampling = SamplingConfig(max_tokens=MAX_TOKENS, temperature=1.0)
    init_ray()
    actor = launch_engine("vllm", model_path=path, max_model_len=MAX_MODEL_LEN)
    times = []
    try:
        for _ in range(reps):
            t = time.perf_counter()
            call = actor.generate_many.options(num_returns="streaming").remote([(p, sampling, None) for p in prompts for _ in range(GROUP)])
            [ray.get(item) for item in call]  # (it streams its samples back as they finish)
            times.append(time.perf_counter() - t)
    finally:
        stop_engine(actor)
        ray.shutdown()
    return times, []


RUN = {"hf-generate": hf_generate, "vllm-llm": vllm_llm, "engine": engine, "engine-ray": engine_ray}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=12, help="batches per variant; the first 2 are warm-up")
    ap.add_argument("--only", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.reps < 3:
        ap.error(f"--reps {a.reps}: at least 3 (the first 2 are warm-up)")
    if a.child:  # one variant in this fresh process: its result as the last line of stdout
        times, counts = RUN[a.child](a.reps)
        print(json.dumps({"times": times[2:], "forwards": counts[2:]}))
        return
    results = {}
    for name in a.only:
        print(f"{name} ...", flush=True)
        p = subprocess.run([sys.executable, __file__, "--child", name, "--reps", str(a.reps)],
                           capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{name} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
        results[name] = json.loads(p.stdout.strip().splitlines()[-1])
    base = statistics.median(results["hf-generate"]["times"]) if "hf-generate" in results else None
    print(f"\nthe quickstart's rollout batch ({PROMPTS} prompts x {GROUP}, up to {MAX_TOKENS} tokens), "
          f"median of {a.reps - 2} batches")
    print(f"{'':12} {'s/batch':>8} {'forwards':>9} {'vs hf-generate':>15}")
    for name, r in results.items():
        med = statistics.median(r["times"])
        fw = f"{statistics.median(r['forwards']):.0f}" if r["forwards"] else "-"
        print(f"{name:12} {med:8.3f} {fw:>9} {f'{med / base:.2f}x' if base else '-':>15}")
    out = Path(__file__).parent / "results" / "rollout_floor.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M"), "reps": a.reps, "results": results}, indent=1))
    print(f"\n{out}")


if __name__ == "__main__":
    main()
