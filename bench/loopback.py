"""Loopback benchmark: the same multi-turn episodes (a) through the OpenAI SDK and the
loopback server and (b) on the engine directly with the same token ids, at 1 and 32 concurrent
sessions. Prints tokens/s of both, their ratio (target >= 0.9 at 32 sessions on the tiny
model), and the p50/p99 latency the server adds per request (server time minus engine time).

    .venv/bin/python bench/loopback.py [--sessions 1 32] [--turns 3] [--max-tokens 32]

(b) replays exactly the prompts (a) sent to the engine, with the same seeds, so both paths
generate the same tokens; the engine is the vLLM actor in both. Results: bench/results/loopback.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from replay_direct import group_episodes, replay_direct

FOLLOW_UPS = ["Are you sure? Say it again.", "Now add one to it.", "And once more.", "Thanks."]


class Recorder:
    """Forwards to the engine actor and keeps (session order, prompt ids, sampling) for replay."""

    def __init__(self, actor):
        self.actor, self.calls = actor, []

    async def generate(self, prompt_ids, sampling):
        sample = await self.actor.generate.remote(prompt_ids, sampling)
        self.calls.append((list(prompt_ids), sampling, len(sample.token_ids)))
        return sample


async def through_server(server, n_sessions: int, turns: int, reply_tokens: int, seed0: int):
    import httpx
    import openai

    from workbench.toy.tasks import SYSTEM_PROMPT

    http = httpx.AsyncClient(limits=httpx.Limits(max_connections=256, max_keepalive_connections=256))
    per_session: list[list[int]] = []

    async def episode(k: int):
        sid = server.open_session()
        client = openai.AsyncOpenAI(base_url=server.base_url(sid), api_key=server.api_key, http_client=http, max_retries=0)
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {k % 10}+{(k * 7) % 10}?"}]
        tokens = []
        for t in range(turns):
            # reply_tokens 0: natural replies (the toy answers in ~3 tokens); N: exactly N tokens per
            # turn (vLLM's ignore_eos extension), closer to real agent turns
            extra = {"max_tokens": reply_tokens, "extra_body": {"ignore_eos": True}} if reply_tokens else {"max_tokens": 32}
            r = await client.chat.completions.create(model="policy", messages=msgs, seed=seed0 + 1000 * k + t, **extra)
            tokens.append(r.usage.completion_tokens)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
        server.close_session(sid)
        per_session.append(tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*[episode(k) for k in range(n_sessions)])
    seconds = time.perf_counter() - t0
    await http.aclose()
    return sum(map(sum, per_session)), seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reply-tokens", type=int, nargs="+", default=[0, 128],
                    help="tokens per reply; 0 = natural length (EOS), N = exactly N (ignore_eos)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from workbench.cluster import init_ray, shutdown_ray
    from workbench.loopback.server import LoopbackServer
    from workbench.rollout.actor import launch_engine, stop_engine
    from workbench.toy.models import load_tokenizer, toy_model_path

    path = toy_model_path("moe")
    init_ray()
    actor = launch_engine("vllm", model_path=str(path), env={"VLLM_LOGGING_LEVEL": "WARNING"})
    results = []
    try:
        for n, reply_tokens in [(n, r) for r in args.reply_tokens for n in args.sessions]:
            rec = Recorder(actor)
            with LoopbackServer(rec, load_tokenizer(path)) as server:
                asyncio.run(through_server(server, min(n, 4), 1, reply_tokens, 7))  # warm-up
                rec.calls.clear()
                server.stats.overhead_s.clear()
                cpu0 = time.process_time()
                tok_a, sec_a = asyncio.run(through_server(server, n, args.turns, reply_tokens, 0))
                cpu_a = time.process_time() - cpu0
                summary = server.summary()
            episodes = group_episodes(rec.calls)
            cpu0 = time.process_time()
            tok_b, sec_b = asyncio.run(replay_direct(actor, episodes, lambda call: call[1]))
            cpu_b = time.process_time() - cpu0
            r = {"sessions": n, "reply_tokens": reply_tokens or "natural", "server_tokens": tok_a, "server_s": sec_a, "server_tok_s": tok_a / sec_a,
                 "direct_tokens": tok_b, "direct_s": sec_b, "direct_tok_s": tok_b / sec_b,
                 "ratio": (tok_a / sec_a) / (tok_b / sec_b),
                 "overhead_p50_ms": 1e3 * summary["overhead_p50_s"], "overhead_p99_ms": 1e3 * summary["overhead_p99_s"],
                 "identity_mismatch": summary["identity_mismatch"], "requests": len(rec.calls),
                 # CPU seconds this process (SDK clients + server, or the direct driver) spent per request
                 "client_server_cpu_ms_per_request": 1e3 * cpu_a / len(rec.calls),
                 "direct_driver_cpu_ms_per_request": 1e3 * cpu_b / len(rec.calls)}
            results.append(r)
    finally:
        stop_engine(actor)
        shutdown_ray()

    print(f"\nloopback vs direct engine, tiny MoE, {args.turns} turns/episode")
    print(f"{'reply':>7} {'sessions':>8} {'server tok/s':>12} {'direct tok/s':>12} {'ratio':>6} {'added p50 ms':>12} {'added p99 ms':>12}"
          f" {'cpu ms/req (sdk+server | direct)':>32}")
    for r in results:
        print(f"{r['reply_tokens']:>7} {r['sessions']:>8} {r['server_tok_s']:>12.0f} {r['direct_tok_s']:>12.0f} {r['ratio']:>6.2f} "
              f"{r['overhead_p50_ms']:>12.2f} {r['overhead_p99_ms']:>12.2f}"
              f" {r['client_server_cpu_ms_per_request']:>16.1f} | {r['direct_driver_cpu_ms_per_request']:<13.1f}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "loopback.json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
