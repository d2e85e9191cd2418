"""Engine benchmark: start-up time and generated tokens/s of the two rollout backends on the
tiny MoE at a fixed batch, measured in the same run, and their ratio.

    .venv/bin/python bench/engines.py [--batch 64] [--tokens 64] [--model moe]

Both engines run in this process (no Ray) on the same prompts with ignore_eos, so every
sequence generates exactly --tokens tokens. Results also go to bench/results/engines.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path


async def measure(backend: str, path: str, prompts: list[list[int]], tokens: int) -> dict:
    from workbench.rollout.engine import SamplingConfig, create_engine

    t0 = time.perf_counter()
    engine = create_engine(backend, model_path=path)
    await engine.start()
    startup = time.perf_counter() - t0
    sampling = SamplingConfig(max_tokens=tokens, ignore_eos=True, temperature=1.0)
    await asyncio.gather(*[engine.generate(p, sampling) for p in prompts[:4]])  # warm-up
    t0 = time.perf_counter()
    outs = await asyncio.gather(*[engine.generate(p, sampling) for p in prompts])
    seconds = time.perf_counter() - t0
    await engine.shutdown()
    generated = sum(len(o.token_ids) for o in outs)
    return {"backend": backend, "startup_s": startup, "generated_tokens": generated,
            "seconds": seconds, "tokens_per_s": generated / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from workbench.toy.models import load_tokenizer, toy_model_path
    from workbench.toy.tasks import arithmetic_problem

    path = str(toy_model_path(args.model))
    tok, rng = load_tokenizer(path), random.Random(0)
    prompts = [tok.apply_chat_template(arithmetic_problem(rng).messages, add_generation_prompt=True)["input_ids"]
               for _ in range(args.batch)]
    results = [asyncio.run(measure(b, path, prompts, args.tokens)) for b in ("vllm", "reference")]
    vllm, ref = results
    print(f"\nengines on the tiny {args.model}, {args.batch} sequences x {args.tokens} tokens")
    print(f"{'backend':<10} {'start-up s':>10} {'tokens/s':>10}")
    for r in results:
        print(f"{r['backend']:<10} {r['startup_s']:>10.1f} {r['tokens_per_s']:>10.0f}")
    ratio = vllm["tokens_per_s"] / ref["tokens_per_s"]
    print(f"ratio vllm / reference tokens/s: {ratio:.2f}x")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "engines.json").write_text(json.dumps({"args": vars(args), "results": results, "ratio": ratio}, indent=1))


if __name__ == "__main__":
    main()
