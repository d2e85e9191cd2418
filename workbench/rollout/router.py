"""Routing requests over N engine actors: session-sticky (a multi-turn episode stays on one
engine and keeps its prefix cache), least-outstanding when a session is placed, and failover:
a request whose engine died is retried on a live one, and when none is left it fails with a
clear error instead of hanging."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter


class EngineUnavailable(RuntimeError):
    pass


# An engine whose core died inside its live actor fails every request at once, so it kept the
# fewest outstanding requests and least-outstanding placement sent it most new sessions (each
# failing its episode) until the step's sync raised: its errors, by class name (the engine's
# own, inside Ray's task error), mark it dead like a dead actor.
CORE_DEAD = {"EngineCoreDead", "EngineDeadError"}


def engine_lost(e: BaseException) -> bool:
    """An engine's error that says the engine is gone: its actor died or is unavailable, or its
    core died inside the live actor (the usual failure on GPU: AsyncLLM's core process crashes)."""
    import ray

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)) or _core_dead(e)


def engine_info(engine, ref=None, tries: int = 3, timeout: float | None = None) -> dict:
    """`engine.info()` (`ref`: a call already made), asked again 1 s and 2 s later while Ray says
    the actor is unavailable: that error is transient (a network blip between nodes), and taken at
    once as the engine's loss it killed the engine (drop_dead_engines) or broke the NCCL
    weight-sync group for the rest of the session, at the first blip of a 2-node run."""
    import time

    import ray

    for attempt in range(tries):
        try:
            return ray.get(ref if ref is not None else engine.info.remote(), timeout=timeout)
        except ray.exceptions.ActorUnavailableError:
            if attempt == tries - 1:
                raise
            time.sleep(2 ** attempt)
            ref = None


def _core_dead(e: BaseException, names: set = CORE_DEAD) -> bool:
    while e is not None:
        if names & {c.__name__ for c in type(e).__mro__}:
            return True
        e = getattr(e, "cause", None) if "RayTaskError" in {c.__name__ for c in type(e).__mro__} else None
    return False


UNAVAILABLE_RETRY_S = 10.0  # an engine Ray called unavailable is tried again after this long
# an engine whose weight load failed part-way (engine.TornWeights) refuses every request until a sync
# completes: unavailable for this long, not dead (a live engine the next sync repairs). Its refusal
# sampled nothing, so the request goes to another engine; left in the pick, the torn engine, failing
# at once, had the fewest outstanding and drew most new sessions
TORN_RETRY_S = 1.0
# a request's attempts on engines left out for a while (unavailable, torn) besides one per engine: each
# waits for an engine to be asked again (_pick_or_wait). Counted against the engines, one blip on a
# lone engine failed every request in flight at it, although the engine was asked again 10 s later
TRANSIENT_RETRIES = 3


class EngineRouter:
    routes_sessions = True  # the loopback server passes session ids to generate()

    def __init__(self, engines: list, request_timeout_s: float | None = 600.0):
        if not engines:
            raise ValueError("EngineRouter needs at least one engine actor")
        self.engines = list(engines)
        self.outstanding = [0] * len(engines)
        self.dead: set[int] = set()
        # engines that answered ActorUnavailableError (Ray: temporary, e.g. a network blip between
        # nodes) -> when to try them again. Marked dead for good, a healthy engine the driver still
        # synced was never asked again by this runner (with one engine: every later episode failed)
        self.unavailable_until: dict[int, float] = {}
        self.sticky: dict[str, int] = {}
        self.requests = Counter()  # per engine index: requests served
        self.failovers = 0  # retries: a request asked again after its engine died, was unavailable or torn (on another
        # engine, or on the same one after its wait)
        self.request_timeout_s = request_timeout_s
        # single-turn sessions' requests to one engine within one event-loop pass, waiting to go as one call
        self._this_pass: dict[tuple, tuple] = {}
        # the sessions whose requests may share a call (_call): single-turn episodes (RolloutRunner
        # marks an Env with max_turns 1). A shared call answers when its slowest request does; a
        # multi-turn episode's next turn waited for its siblings' longest first reply (and so timed
        # out by their lengths, not its own)
        self.single_turn: set[str] = set()
        self.coalesced = 0  # requests that went to an engine in another request's call
        self._deliveries: set = set()  # the tasks awaiting those calls (held: the loop keeps weak references)

    def pick(self, session_id: str | None) -> int:
        now = time.monotonic()
        alive = [i for i in range(len(self.engines)) if i not in self.dead and self.unavailable_until.get(i, 0) <= now]
        if not alive:
            raise EngineUnavailable(f"all {len(self.engines)} rollout engines are {self._gone()}")
        i = self.sticky.get(session_id) if session_id is not None else None
        if i is None or i not in alive:
            i = min(alive, key=lambda j: (self.outstanding[j], j))
            if session_id is not None:
                self.sticky[session_id] = i
        return i

    def release(self, session_id: str) -> None:
        self.sticky.pop(session_id, None)
        self.single_turn.discard(session_id)

    async def generate(self, prompt_ids, sampling, session_id: str | None = None, return_routed_experts: bool = False):
        share = session_id in self.single_turn

        async def whole(engine):
            yield await asyncio.wait_for(self._call(engine, prompt_ids, sampling, return_routed_experts, share),
                                         self.request_timeout_s)

        # run to the end (one item), so that the attempt's bookkeeping in _failover completes
        return [sample async for sample in self._failover(session_id, whole)][0]

    async def generate_stream(self, prompt_ids, sampling, session_id: str | None = None, return_routed_experts: bool = False):
        """generate(), streamed (actor.stream_generate): new ids as the engine samples them, then the
        Sample. request_timeout_s bounds the wait for each item, not the whole reply."""
        from .actor import stream_generate

        def streamed(engine):
            return stream_generate(engine, prompt_ids, sampling, return_routed_experts, self.request_timeout_s)

        async for item in self._failover(session_id, streamed):
            yield item

    async def _failover(self, session_id: str | None, attempt):
        """The items of `attempt(engine)` (an async iterator: one request on that engine) from the
        engine pick() chooses. An engine that dies before its first item is marked dead and the
        request retried on another (nothing was recorded for it); after its first item the error
        is the caller's (ids were already sent on). One that does not answer in time fails."""
        import ray

        last_error, attempts, transient = None, 0, 0
        while attempts - transient < len(self.engines) and transient <= TRANSIENT_RETRIES:
            i = await self._pick_or_wait(session_id)
            self.failovers += attempts > 0  # (counted as another attempt starts: one that never did was counted)
            attempts += 1
            self.outstanding[i] += 1
            started = False
            try:
                async for item in attempt(self.engines[i]):
                    started = True
                    yield item
                self.requests[i] += 1
                return
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                if isinstance(e, ray.exceptions.ActorUnavailableError):
                    self.unavailable_until[i] = time.monotonic() + UNAVAILABLE_RETRY_S
                    transient += 1
                else:
                    self.dead.add(i)
                if started:
                    raise
                last_error = e
            except asyncio.TimeoutError as e:
                if isinstance(e, ray.exceptions.RayTaskError):  # (RayTaskError(TimeoutError) is one: the engine's
                    raise  # own error, at once, read as this router's timeout of request_timeout_s)
                raise EngineUnavailable(f"engine {i} did not answer within {self.request_timeout_s} s") from None
            except Exception as e:
                if _core_dead(e, {"TornWeights"}) and not started:
                    self.unavailable_until[i] = time.monotonic() + TORN_RETRY_S
                    transient += 1
                    last_error = e
                    continue
                if not _core_dead(e):
                    raise
                self.dead.add(i)
                if started:
                    raise
                last_error = e
            finally:
                self.outstanding[i] -= 1
        raise EngineUnavailable(f"all {len(self.engines)} rollout engines are {self._gone()} (last error: {last_error})")

    async def _pick_or_wait(self, session_id: str | None) -> int:
        """pick(); where every engine left is only unavailable for now (Ray's temporary error), after
        waiting for the first to be tried again: with one engine, every request of those seconds failed."""
        while True:
            try:
                return self.pick(session_id)
            except EngineUnavailable:
                waits = [t - time.monotonic() for i, t in self.unavailable_until.items() if i not in self.dead]
                if not waits:
                    raise
                await asyncio.sleep(max(min(waits), 0.0) + 0.01)

    def _gone(self) -> str:
        return "dead or unavailable for now" if any(t > time.monotonic() for t in self.unavailable_until.values()) else "dead"

    def _call(self, engine, prompt_ids, sampling, return_routed_experts, share: bool = False) -> asyncio.Future:
        """One request's Sample (a future), from engine.generate. Why requests are coalesced: a
        rollout's episodes open within one pass of the event loop, and each Ray call costs the
        engine's actor and this process CPU: the quickstart's 128 first turns as 16 calls of a
        group each took 0.114 s a batch, as one call 0.080 s, of which the engine's own work is
        0.068 s (bench/rollout_floor.py, engine-ray vs engine). `share` requests (single-turn
        sessions) for the same engine made in one pass go as one EngineHost.generate_many call;
        each is still its own engine request with its own Sample (or its own exception). Requests
        are never held back for a later pass; a coalesced call streams its requests back as they
        finish (batched within actor.GENERATE_N_HOLD_S: answered only with its slowest, every
        sibling timed out with it). Only single-turn sessions' requests share one: a multi-turn
        episode's next turn would wait for the batch its first reply came back in."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not share:
            self._send(engine, [(prompt_ids, sampling, None)], return_routed_experts, [future])
            return future
        key = (id(engine), return_routed_experts)
        pending = self._this_pass.get(key)
        if pending is None:
            pending = self._this_pass[key] = (engine, [], return_routed_experts, [])
            loop.call_soon(lambda: self._send(*self._this_pass.pop(key)))  # after every request of this pass
        pending[1].append((prompt_ids, sampling, uuid.uuid4().hex))  # (its id: given up, it is aborted by it)
        pending[-1].append(future)
        return future

    def _send(self, engine, requests: list, return_routed_experts, futures: list) -> None:
        if len(futures) == 1:
            ref = engine.generate.remote(*requests[0][:2], None, return_routed_experts)
        else:
            self.coalesced += len(futures) - 1
            ref = engine.generate_many.options(num_returns="streaming").remote(requests, return_routed_experts)
        task = asyncio.ensure_future(self._deliver(ref, futures) if len(futures) == 1 else self._deliver_n(ref, futures))
        self._deliveries.add(task)
        task.add_done_callback(self._deliveries.discard)

        def given_up(future) -> None:
            # a request that timed out or was cancelled (its episode timed out, the client left): the
            # engine stops sampling it. Not stopped, Ray ran the call on, sampling to max_tokens,
            # holding its batch slot and KV, re-prefilled at every sync, while this router's
            # outstanding count (least-outstanding placement) read the engine as idle. One request of
            # a coalesced call is aborted by its id (it sampled on until its siblings had all
            # finished: with a rollout's first turns in one call, the whole rollout); a call whose
            # every request is done and any given up is cancelled. Ray's ActorUnavailableError too:
            # the call may be running still, and the request goes to another engine (the first
            # sampled it on unread)
            import ray

            def abandoned(f) -> bool:
                return f.cancelled() or isinstance(f.exception(), ray.exceptions.ActorUnavailableError)

            if all(f.done() for f in futures):
                if any(abandoned(f) for f in futures):
                    ray.cancel(ref)
            elif future.cancelled():
                engine.abort.remote(requests[futures.index(future)][2])
        for f in futures:
            f.add_done_callback(given_up)

    @staticmethod
    async def _deliver(ref, futures: list) -> None:
        try:
            got = await asyncio.wrap_future(ref.future())
            results = got if len(futures) > 1 else [got]
        except BaseException as e:  # the call failed (a dead engine, ...): every request of it fails so
            results = [e] * len(futures)
        for future, result in zip(futures, results):
            if future.done():  # its request timed out or was cancelled meanwhile
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)

    @staticmethod
    async def _deliver_n(gen, futures: list) -> None:
        """A coalesced call's results as its stream gives them (EngineHost.generate_many)."""
        error = None
        try:
            async for ref in gen:
                for i, result in await ref:
                    if futures[i].done():  # its request timed out or was cancelled meanwhile
                        continue
                    if isinstance(result, BaseException):
                        futures[i].set_exception(result)
                    else:
                        futures[i].set_result(result)
        except BaseException as e:  # the call failed (a dead engine, ...): every request not answered fails so
            error = e
            if not engine_lost(e):  # (an item Ray could not read, ...): the engine stops the unanswered ones,
                import ray  # failed here, not given up, so nothing else cancels them (they sampled on, unread)

                with contextlib.suppress(Exception):
                    ray.cancel(gen)
        for future in futures:
            if not future.done():
                future.set_exception(error or RuntimeError("the engine's group call ended without this request's result"))

    def state(self) -> dict:
        return {"engines": len(self.engines), "dead": sorted(self.dead), "outstanding": list(self.outstanding),
                "unavailable": sorted(i for i, t in self.unavailable_until.items() if t > time.monotonic()),
                "requests": dict(self.requests), "sessions": len(self.sticky), "failovers": self.failovers,
                "coalesced": self.coalesced}
