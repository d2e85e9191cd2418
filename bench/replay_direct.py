"""Shared by the benchmarks: replay the engine calls a full-stack run made, directly on the
engine actor, with the same per-episode ordering and cross-episode concurrency."""

from __future__ import annotations

import asyncio
import time


def group_episodes(calls: list[tuple]) -> list[list[tuple]]:
    """Regroup calls (each a tuple whose first item is the prompt ids) into episodes: a call
    belongs to the episode whose last prompt it extends."""
    episodes: list[list[tuple]] = []
    for call in calls:
        for ep in episodes:
            last = ep[-1][0]
            if len(call[0]) > len(last) and call[0][: len(last)] == last:
                ep.append(call)
                break
        else:
            episodes.append([call])
    return episodes


async def replay_direct(actor, episodes: list[list[tuple]], sampling_of) -> tuple[int, float]:
    """Each episode's calls in order, episodes concurrently; returns (generated tokens, seconds)."""
    async def episode(calls):
        n = 0
        for call in calls:
            n += len((await actor.generate.remote(call[0], sampling_of(call))).token_ids)
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*[episode(c) for c in episodes])
    return sum(counts), time.perf_counter() - t0
