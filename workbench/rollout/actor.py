"""Rollout engines as Ray actors.

`launch_engine` starts an `EngineHost` actor that owns one engine (either backend) and forwards
calls to it. It asks Ray for no CPUs: the engine's own processes do the work, and on a small
machine an actor that asks for more CPUs than are free waits forever instead of failing.
"""

from __future__ import annotations

import asyncio
import pickle
import time

from .engine import Sample, SamplingConfig, WireWeights, create_engine
from .router import engine_lost

# A streamed reply's new ids go on at once for the first (time to first token), then merged
# over a window: each item is a Ray object, a server feed, an SSE chunk and an SDK parse, about
# 3 ms of CPU in all (Ray's streaming generator alone ~2 ms, half in this actor, half in the
# server's process), more than the engine's step on 2 cores. The window is STREAM_WINDOW_S (ten
# updates a second, as chat UIs show text), longer when many streams share the actor, so that it
# sends at most STREAM_ITEMS_PER_S items a second in all (32 streams: 320 ms). Measured with
# bench/loopback.py --stream: a streamed 128-token reply took 1.64x the unstreamed one at 8
# sessions and 1.5-1.75x at 32 with a 20 ms window; see docs/ARCHITECTURE.md for the after. The
# record does not depend on it (the final Sample carries every id).
STREAM_WINDOW_S = 0.1
STREAM_ITEMS_PER_S = 100
# a coalesced call (generate_many) hands back what finished within this long of the first to finish
# of each batch: its siblings are not held for the slowest, and requests finishing together are one item
GENERATE_N_HOLD_S = 1.0


def request_error(e: BaseException) -> BaseException:
    """A request's own exception as generate_many sends it back beside its siblings' results: as
    it is, unless it does not come back from a pickle or is a TimeoutError, then a RuntimeError
    naming it. Why: Ray could not rebuild an exception whose __init__ takes other arguments than
    its args (vLLM's QueueOverflowError, with max_num_queued_reqs set) and failed the whole item,
    the Samples finished beside it too, as one RaySystemError; and the engine's own TimeoutError,
    bare, read at the router as its own request timeout ("did not answer within 600 s")."""
    if isinstance(e, TimeoutError):
        return RuntimeError(f"the engine's {type(e).__name__}: {e}")
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def stream_window(streams: int) -> float:
    """The default merge window of an engine actor with `streams` streams in flight."""
    return max(STREAM_WINDOW_S, streams / STREAM_ITEMS_PER_S)


class EngineHost:
    """Actor body: one engine, its async methods exposed one to one."""

    def __init__(self, backend: str, engine_kwargs: dict, keep_log: bool = False):
        self.engine = create_engine(backend, **engine_kwargs)
        # keep_log: remember every (prompt ids, sampled ids), so tests and debugging sessions can
        # compare recorded trajectories with what this engine really produced
        self.log: list | None = [] if keep_log else None
        self.streams = 0  # generate_stream calls in flight (they share the item budget)

    async def start(self) -> dict:
        return await self.engine.start()

    async def info(self) -> dict:
        return self.engine.info()

    async def generate(self, prompt_ids, sampling: SamplingConfig | None = None, request_id=None, return_routed_experts=False):
        sample = await self.engine.generate(prompt_ids, sampling, request_id, return_routed_experts)
        if self.log is not None:
            self.log.append((list(prompt_ids), list(sample.token_ids)))
        return sample

    async def generate_many(self, requests: list, return_routed_experts=False, hold_s: float = GENERATE_N_HOLD_S):
        """generate() for each (prompt ids, sampling, request id) of `requests`, in one Ray call
        (EngineRouter coalesces the single-turn sessions' requests of one event-loop pass so: a
        rollout's first turns; call it with .options(num_returns="streaming")). Yields lists of
        (index, result), a result a Sample or the exception its own request raised (one failure
        fails only its request): those finished within `hold_s` of the first of the list. Why not
        one list of all: a finished request waited for the slowest, and past the episodes' timeout
        every episode of the call failed with the slow one (one long reasoning sample and its group
        was dropped). Requests finishing together are one item, as one list was. A request the
        caller gives up is stopped by abort(its id), its siblings sampling on."""
        tasks = [asyncio.ensure_future(self.generate(prompt_ids, sampling, request_id, return_routed_experts))
                 for prompt_ids, sampling, request_id in requests]
        index, pending = {t: i for i, t in enumerate(tasks)}, set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if pending and hold_s > 0:
                    more, pending = await asyncio.wait(pending, timeout=hold_s)
                    done |= more
                # (a request cancelled in the engine, not by this call, is its own error: read with
                # exception(), it raised here and failed every sibling still sampling)
                yield [(index[t], RuntimeError("the request was cancelled in the engine") if t.cancelled()
                        else request_error(t.exception()) if t.exception() is not None else t.result())
                       for t in sorted(done, key=index.get)]
        finally:  # (the caller gone: ray.cancel, every request of it given up) the engine stops the rest
            for t in pending:
                t.cancel()

    async def generate_stream(self, prompt_ids, sampling: SamplingConfig | None = None, request_id=None,
                              return_routed_experts=False, window_s: float | None = None):
        """engine.generate_stream through Ray: call it with .options(num_returns="streaming")
        (stream_generate does), each item an object the caller gets as it is produced: lists of
        new ids, merged over `window_s` after the first (None: the default window above, which
        grows with the streams in flight), then the Sample."""
        pending, sent = [], None
        self.streams += 1
        try:
            async for item in self.engine.generate_stream(prompt_ids, sampling, request_id, return_routed_experts):
                if isinstance(item, Sample):
                    if pending:
                        yield pending
                    if self.log is not None:
                        self.log.append((list(prompt_ids), list(item.token_ids)))
                    yield item
                    continue
                pending += item
                window = window_s if window_s is not None else stream_window(self.streams)
                if sent is None or time.monotonic() - sent >= window:
                    yield pending
                    pending, sent = [], time.monotonic()
        finally:
            self.streams -= 1

    async def sample_log(self) -> list:
        return list(self.log or [])

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    async def update_weights(self, state_dict, version=None, expected_probe=None, probe=None, tol=1e-3):
        """`expected_probe`: the log-probs, or (a Ray reference to them,) from sync_weights: Ray
        resolves only a top-level reference, before the call; this one the engine awaits after
        its load, which the trainer's probe overlaps."""
        if isinstance(state_dict, WireWeights):
            state_dict = state_dict.tensors()
        import ray

        if isinstance(expected_probe, tuple) and len(expected_probe) == 1 and isinstance(expected_probe[0], ray.ObjectRef):
            expected_probe, = expected_probe
        return await self.engine.update_weights(state_dict, version, expected_probe, probe, tol)

    async def init_nccl(self, cfg, rank_offset: int, world_size: int) -> None:
        await self.engine.init_nccl(cfg, rank_offset, world_size)

    async def update_weights_nccl(self, meta, version=None, expected_probe=None, probe=None, tol=1e-3):
        return await self.engine.update_weights_nccl(meta, version, expected_probe, probe, tol)

    async def probe_logprobs(self, ids):
        return await self.engine.probe_logprobs(ids)

    async def shutdown(self) -> None:
        await self.engine.shutdown()


async def stream_generate(actor, prompt_ids, sampling, return_routed_experts=False, timeout_s: float | None = None,
                          window_s: float | None = None):
    """An EngineHost's generate_stream from another process: Ray's streaming generator
    (num_returns="streaming"), each item awaited as the actor yields it; `timeout_s` bounds the
    wait for each (asyncio.TimeoutError)."""
    import ray

    gen = actor.generate_stream.options(num_returns="streaming").remote(prompt_ids, sampling, None, return_routed_experts,
                                                                        window_s)
    finished = False
    try:
        while True:
            try:
                ref = await asyncio.wait_for(gen.__anext__(), timeout_s)
            except StopAsyncIteration:
                finished = True
                return
            yield await ref
    finally:
        if not finished:  # its reader left (a timeout, the client gone): the engine stops sampling it
            ray.cancel(gen)


def launch_engine(backend: str, name: str | None = None, env: dict | None = None, keep_log: bool = False,
                  actor_options: dict | None = None, **engine_kwargs):
    """Start an engine actor, wait until its model is loaded, and return the actor handle.
    Stop it with `stop_engine(handle)`. `actor_options`: Ray actor options over the defaults
    (workbench.placement's Placement.options("engine", i): its GPUs and placement-group bundle)."""
    import ray

    actor, loaded = start_engine(backend, name, env, keep_log, actor_options, **engine_kwargs)
    try:
        ray.get(loaded)
    except BaseException:  # a failed load: its actor would hold its GPU for as long as anything (a notebook's
        # last traceback) holds this frame's handle
        ray.kill(actor)
        raise
    return actor


def start_engine(backend: str, name: str | None = None, env: dict | None = None, keep_log: bool = False,
                 actor_options: dict | None = None, **engine_kwargs):
    """launch_engine without the wait: returns (actor, the ObjectRef of its start), so that a
    session loads its engines while its trainer ranks start (connect's longest parts overlap)."""
    import ray

    from ..cluster import cluster_gpus

    # on a GPU cluster the engine's actor holds its tensor-parallel GPUs (vLLM's workers run
    # inside it and see only those); on CPU it asks for nothing
    gpus = engine_kwargs.get("tensor_parallel_size", 1) if cluster_gpus() else 0
    options = {"num_cpus": 0, "num_gpus": gpus, "max_concurrency": 1000}
    if name:
        options["name"] = name
    if env:
        options["runtime_env"] = {"env_vars": env}
    options.update(actor_options or {})
    actor = ray.remote(EngineHost).options(**options).remote(backend, engine_kwargs, keep_log)
    return actor, actor.start.remote()


def stop_engine(actor, timeout: float = 60) -> None:
    """Shut the engine down cleanly (its vLLM processes included), then end the actor."""
    import ray

    try:
        ray.get(actor.shutdown.remote(), timeout=timeout)
    finally:
        ray.kill(actor)


def sync_weights(engines: list, state_dict, version: int | None = None, expected_probe=None, tol: float = 1e-3,
                 lost: list | None = None):
    """Push weights to every engine (each pauses in keep mode, loads, bumps its version, resumes,
    and checks its probe): in-flight episodes continue and their tokens span both versions.
    `state_dict`: the HF-named tensors, or a Ray reference to them (Trainer.weights_and_probe);
    `expected_probe` the same (a reference: each engine awaits it once loaded).
    `lost`: a list that collects (engine, error) for engines found dead instead of raising; the
    reports of the live ones are returned (a refused probe still raises)."""
    import ray

    # one copy in the object store, shared by all engines (a reference is passed on as it is)
    ref = state_dict if isinstance(state_dict, ray.ObjectRef) else ray.put(WireWeights.of(state_dict))
    if isinstance(expected_probe, ray.ObjectRef):  # awaited by each engine after its load (EngineHost.update_weights)
        expected_probe = (expected_probe,)
    refs = [e.update_weights.remote(ref, version, expected_probe, None, tol) for e in engines]
    if lost is None:
        return ray.get(refs)
    reports = []
    for e, r in zip(engines, refs):
        try:
            reports.append(ray.get(r))
        except Exception as err:  # (a core dead in a live actor too: the sync raised, and the run ended)
            if not engine_lost(err):
                raise
            lost.append((e, err))
    return reports

