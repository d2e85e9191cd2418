"""vLLM's engine core stepped in a thread of the engine's own process: the CPU path of the
"vllm" backend (rollout/vllm_engine.py), behind the part of AsyncLLM's interface it uses.

Why: AsyncLLM always runs its engine core in a process of its own, started by spawn (vLLM
forces spawn in a Ray actor), which imports vLLM a second time: on 2 cores ~11 s of a 13 s
engine start, and each output crosses a ZMQ socket both ways (msgpack out, in again). On CPU
with one worker, vLLM's synchronous LLMEngine runs the same engine core in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0). Measured on the toy MoE, same process, 128 requests x
8 tokens: started 1.4 s after the import vs 11.3 s; a batch 0.083 s vs 0.13 s.

One thread owns the LLMEngine: it runs every call on it (queued by the event loop, run between
steps) and steps it while requests are in flight and it is not paused; each step's outputs go to
the requests' queues on the event loop. Nothing else touches the engine, so vLLM's single-
threaded engine is never entered twice. Pause "keep" is this thread not stepping: in-flight
requests stay scheduled with their KV, and each sampled token's version is what the engine
core set when it was sampled (set_weight_version), as in AsyncLLM.
"""

from __future__ import annotations

import asyncio
import gc
import os
import queue
import threading

from .engine import EngineCoreDead


class InprocLLM:
    """AsyncLLM's calls that VLLMEngine makes, on an in-process LLMEngine."""

    def __init__(self, engine_args: dict):
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        # vLLM's start runs five full garbage collections (after loading, after profiling, ...),
        # each walking every object of the process (~630,000 after importing torch and vLLM: 0.28 s a
        # walk here). What is alive now lives as long as the engine: move it out of the collector's
        # walk, as vLLM does itself once started (freeze_gc_heap). Measured: start 1.7 -> 0.75 s.
        gc.freeze()
        # read as the engine is made (its default, 1, would start a core process); the process's
        # own setting is restored after
        before = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            engine = LLMEngine.from_engine_args(EngineArgs(**engine_args), enable_multiprocessing=False)
        finally:
            if before is None:
                del os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"]
            else:
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = before
        self._serve(engine)

    def _serve(self, engine) -> None:
        """Start the thread that owns `engine` (on the running event loop's side)."""
        self.engine = engine
        self.vllm_config, self.model_config = self.engine.vllm_config, self.engine.model_config
        self._loop = asyncio.get_running_loop()
        self._calls: queue.SimpleQueue = queue.SimpleQueue()  # (fn, future) run by the thread
        self._streams: dict[str, asyncio.Queue] = {}  # request id -> its outputs, on the loop
        self._adds: list = []  # (request id, prompt, params, future) made in this pass of the loop (_add)
        self._unsent: set[str] = set()  # their ids, until the thread adds them
        self._aborted_unsent: set[str] = set()  # of those, the ones an abort reached first (_abort)
        self._wake = threading.Event()
        self._paused = self._stopped = False
        self._thread = threading.Thread(target=self._run, name="vllm-engine-core", daemon=True)
        self._thread.start()

    # -- the engine's thread ---------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopped:
            self._wake.clear()  # before draining: a call queued after this wakes the wait below
            while True:
                try:
                    fn, fut = self._calls.get_nowait()
                except queue.Empty:
                    break
                try:
                    result, error = fn(), None
                except BaseException as e:  # noqa: BLE001  (handed to the caller)
                    result, error = None, e
                if fut is not None:
                    self._loop.call_soon_threadsafe(_settle, fut, result, error)
            if self._stopped:
                break
            if self._paused or not self.engine.has_unfinished_requests():
                self._wake.wait()
                continue
            try:
                outs = self.engine.step()
            except BaseException as e:  # noqa: BLE001  every waiting request gets the error
                self._loop.call_soon_threadsafe(self._fail_all, e)
                self._stopped = True
                break
            # each output with its id count now: the engine appends to the same lists next step
            if outs:  # (none in most steps when every request asked for its final output only)
                batch = [(o, len(o.outputs[0].token_ids) if o.outputs else 0) for o in outs]
                self._loop.call_soon_threadsafe(self._deliver, batch)
        self._refuse_queued(lambda fut, e: self._loop.call_soon_threadsafe(_settle, fut, None, e))

    def _refuse_queued(self, settle) -> None:
        """Stopped (shut down, or the engine failed): calls still queued get an error, not a wait."""
        stopped = EngineCoreDead("the in-process vLLM engine has stopped")
        while True:
            try:
                _, fut = self._calls.get_nowait()
            except queue.Empty:
                return
            if fut is not None:
                settle(fut, stopped)

    def _abort(self, request_id: str, notify: bool) -> None:
        """In the thread: abort a request and, as AsyncLLM's abort does, end its stream with an
        output finished as "abort" holding what it sampled so far, with its versions (LLMEngine
        emits none: vLLM makes it only for a request with an AsyncLLM queue)."""
        from vllm.v1.engine import FinishReason

        if request_id in self._unsent:  # made, its add not yet sent: aborted once added (add_all), else the
            self._aborted_unsent.add(request_id)  # add, coming after, ran it to max_tokens on what the abort
            return  # was for (a torn weight load)
        processor = self.engine.output_processor
        states = [processor.request_states.get(i) for i in processor.external_req_ids.get(request_id, [])]
        final = [s.make_request_output([], None, FinishReason.ABORT, None) for s in states if s is not None]
        self.engine.abort_request([request_id])
        if notify and final and final[0] is not None:
            self._loop.call_soon_threadsafe(self._deliver, [(final[0], len(final[0].outputs[0].token_ids))])

    # -- the event loop's side -------------------------------------------------------------
    def _deliver(self, batch) -> None:
        for out, n in batch:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait((out, n))

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_nowait(error)

    async def call_in_thread(self, fn):
        """fn() in the engine's thread, between two steps; its result (or error) here."""
        if self._stopped:
            raise EngineCoreDead("the in-process vLLM engine has stopped")
        fut = self._loop.create_future()
        self._calls.put((fn, fut))
        self._wake.set()
        return await fut

    async def generate(self, prompt, params, request_id: str):
        """Yields the request's outputs as AsyncLLM does (cumulative: each holds every id so
        far); the last one is finished. An output's token_ids may hold ids of a later step by the
        time it is read; `.outputs[0].token_ids[:n]` with the count taken at its step does not."""
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        finished = False
        try:
            await self._add(request_id, prompt, params)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise EngineCoreDead(f"vLLM's engine core failed: {item!r}") from item
                out, n = item
                finished = out.finished
                if not finished and out.outputs:
                    out.outputs[0].token_ids = list(out.outputs[0].token_ids[:n])
                yield out
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopped:  # the caller left early: free its slot
                self._calls.put((lambda: self._abort(request_id, notify=False), None))
                self._wake.set()

    def _add(self, request_id: str, prompt, params) -> asyncio.Future:
        """engine.add_request, with every other request made in this pass of the event loop: one
        call to the thread for all. Why: a rollout's requests are made together (a coalesced group's
        in one pass), and added one call each, the thread woke at the first and could step with what
        had arrived while the loop was still adding (a prefill of a few, the rest a forward later:
        tests/test_engines.py), the two threads trading the GIL at every add. Each request still
        gets its own error."""
        fut = self._loop.create_future()
        if not self._adds:
            self._loop.call_soon(self._send_adds)  # after every request of this pass
        self._adds.append((request_id, prompt, params, fut))
        self._unsent.add(request_id)
        return fut

    def _send_adds(self) -> None:
        adds, self._adds = self._adds, []

        def add_all() -> list:
            errors = []
            for request_id, prompt, params, fut in adds:
                self._unsent.discard(request_id)
                aborted = request_id in self._aborted_unsent
                self._aborted_unsent.discard(request_id)
                if fut.cancelled():  # its caller left before it was sent: not added (its abort, queued
                    errors.append(None)  # before this call, found nothing to abort)
                    continue
                try:
                    self.engine.add_request(request_id, prompt, params)
                    errors.append(None)
                except BaseException as e:  # noqa: BLE001  (handed to its own request)
                    errors.append(e)
                    continue
                if aborted:  # its stream ends as an abort's does
                    self._abort(request_id, notify=True)
            return errors

        def settle(added) -> None:
            error = added.exception() if not added.cancelled() else asyncio.CancelledError()
            for i, (*_, fut) in enumerate(adds):
                _settle(fut, None, error or added.result()[i])

        asyncio.ensure_future(self.call_in_thread(add_all)).add_done_callback(settle)

    async def abort(self, request_id: str) -> None:
        await self.call_in_thread(lambda: self._abort(request_id, notify=True))

    async def pause_generation(self, mode: str = "keep", clear_cache: bool = False) -> None:
        if mode != "keep" or clear_cache:
            raise NotImplementedError("the in-process vLLM engine pauses in 'keep' mode only")
        await self.call_in_thread(lambda: setattr(self, "_paused", True))  # returns between two steps

    async def resume_generation(self) -> None:
        await self.call_in_thread(lambda: setattr(self, "_paused", False))

    async def update_weight_version(self, version: str) -> None:
        await self.call_in_thread(lambda: self.engine.set_weight_version(version))

    async def collective_rpc(self, method: str, args: tuple = ()):
        return await self.call_in_thread(lambda: self.engine.collective_rpc(method, args=args))

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return await self.call_in_thread(lambda: self.engine.reset_prefix_cache(reset_running_requests, reset_connector))

    def shutdown(self, timeout: float | None = None) -> None:
        """`timeout` is AsyncLLM's (for its core process) and not used: the thread ends after
        the step it is in, which must finish before the engine core is shut down under it."""
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._refuse_queued(lambda fut, e: _settle(fut, None, e))  # any queued after the thread's last look
        self._fail_all(EngineCoreDead("the in-process vLLM engine was shut down"))  # requests still streaming
        self.engine.engine_core.shutdown()


def _settle(fut: asyncio.Future, result, error) -> None:
    if fut.done():  # its caller was cancelled
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)
