"""What a weight sync costs the requests in flight (`make bench-sync-inflight`): one engine, a batch
of long requests, and the same batch with one weight sync halfway, alternating in one run.

At a sync every engine drops the K/V its old weights computed: in-flight requests are preempted
and recompute their context under the new weights when they resume (VLLMEngine._drop_old_kv;
the reference sampler re-encodes its batch). That recompute is the price of each token being
exactly its version's policy. Printed: the batch's wall time without and with the sync (medians
over --rounds alternating pairs), their ratio, and the sync's own time (pause, load, K/V drop,
resume; no probe check). Results also go to bench/results/sync_inflight.json.

    .venv/bin/python bench/sync_inflight.py [--requests 64] [--prompt 300] [--tokens 200] [--rounds 6] [--backend vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path


async def batch(engine, prompts: list[list[int]], tokens: int, weights: dict | None, at: float) -> tuple[float, float | None]:
    """The batch's wall time, and the sync's own when `weights` is given (started `at` seconds in)."""
    from workbench.rollout.engine import SamplingConfig

    sampling = SamplingConfig(max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    running = [asyncio.create_task(engine.generate(p, sampling)) for p in prompts]
    sync_s = None
    if weights is not None:
        await asyncio.sleep(at)
        if all(t.done() for t in running):
            raise RuntimeError("the batch finished before the sync: lower --at or raise --tokens")
        ts = time.perf_counter()
        await engine.update_weights(weights)
        sync_s = time.perf_counter() - ts
    await asyncio.gather(*running)
    return time.perf_counter() - t0, sync_s


async def main_async(args) -> dict:
    from tqdm.auto import tqdm

    from workbench.rollout.engine import create_engine
    from workbench.toy.models import load_hf_model, toy_model_path

    path = toy_model_path(args.model)
    engine = create_engine(args.backend, model_path=str(path))
    await engine.start()
    weights = load_hf_model(path).state_dict()  # the same weights: the sync's cost, not a new policy's
    rng = random.Random(0)
    vocab = engine.vocab_size
    plain, synced, syncs = [], [], []
    try:
        first, _ = await batch(engine, [[rng.randrange(5, vocab) for _ in range(args.prompt)] for _ in range(args.requests)],
                               args.tokens, None, 0)  # warm-up, and the batch's length for --at
        at = args.at if args.at is not None else first / 2
        for k in tqdm(range(args.rounds), desc="pairs (no sync, sync)"):
            # each batch its own prompts (the synced batch re-sent the plain one's: its prefill hit the
            # prefix cache, and the sync's cost read smaller), and the pair's order alternates
            fresh = [[[rng.randrange(5, vocab) for _ in range(args.prompt)] for _ in range(args.requests)] for _ in "ab"]
            for with_sync, prompts in sorted(zip((False, True), fresh), reverse=bool(k % 2)):
                wall, sync_s = await batch(engine, prompts, args.tokens, weights if with_sync else None, at)
                (synced if with_sync else plain).append(wall)
                if with_sync:
                    syncs.append(sync_s)
    finally:
        await engine.shutdown()
    return {"backend": args.backend, "requests": args.requests, "prompt": args.prompt, "tokens": args.tokens,
            "sync_at_s": at, "no_sync_s": statistics.median(plain), "with_sync_s": statistics.median(synced),
            "ratio": statistics.median(b / a for a, b in zip(plain, synced)), "sync_s": statistics.median(syncs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", type=int, default=300, help="prompt tokens per request")
    p.add_argument("--tokens", type=int, default=200, help="sampled tokens per request (ignore_eos)")
    p.add_argument("--rounds", type=int, default=6, help="alternating pairs")
    p.add_argument("--at", type=float, default=None, help="seconds into the batch to sync (default: half the warm-up batch)")
    p.add_argument("--backend", default="vllm", choices=["vllm", "reference"])
    p.add_argument("--model", default="moe")
    args = p.parse_args()
    r = asyncio.run(main_async(args))
    print(f"{r['backend']}: {r['requests']} requests x ({r['prompt']} prompt + {r['tokens']} sampled) tokens, "
          f"one sync {r['sync_at_s']:.2f} s in")
    extra = r["with_sync_s"] - r["no_sync_s"]
    print(f"  batch without a sync {r['no_sync_s']:.3f} s, with one {r['with_sync_s']:.3f} s: {r['ratio']:.2f}x; of the "
          f"{extra * 1000:.0f} ms more, the sync itself {r['sync_s'] * 1000:.1f} ms, the rest the in-flight recompute")
    out = Path(__file__).parent / "results" / "sync_inflight.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(r, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
