"""The "reference" rollout backend: a small pure-PyTorch sampler over the HF transformers model.

Why it exists: it computes exactly the forward a trainer computes (same module code), so its
log-probs are the exact baseline for the consistency statistics, and its router hooks capture
MoE expert ids on CPU, where vLLM cannot (routed-expert return needs vLLM's GPU model runner).

How it runs: requests queue up; a scheduler task takes up to `max_batch` of them, left-pads
their prompts into one batch, prefills once and decodes step by step with the HF KV cache
(static batching: requests that arrive mid-batch wait for the next one). Each forward runs in
a worker thread so the event loop stays free; between steps the loop honours abort, pause and
weight updates, so a request spans two policy versions when weights change mid-flight. As in the
vllm backend, a weight load drops the batch's K/V: the next step re-encodes every row's context
under the new weights, so each token is exactly its version's policy on its whole context.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from ..replay import RouterCapture
from .engine import RolloutEngine, Sample, SamplingConfig, TornWeights, WeightsNotLoaded, register_engine


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingConfig
    request_id: str
    want_experts: bool
    future: asyncio.Future
    generator: torch.Generator
    stream: asyncio.Queue | None = None  # generate_stream's: each sampled id as it is sampled
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    experts: list[torch.Tensor] = field(default_factory=list)  # per fed position: [layers, k]
    finish_reason: str | None = None


# As vLLM 0.32 (sampling_params.py, v1/sample/sampler.py): temperature 0 is greedy and reports
# the log-prob of the unscaled logits (log_softmax(logits), the temperature-1 distribution);
# 0 < temperature < 0.01 is raised to 0.01 ("may cause numerical errors") before vLLM's greedy
# test, so only 0 itself is greedy (1e-6 samples at 0.01). tests/test_engines.py compares both
# backends at temperature 0 and below 0.01.
MIN_TEMPERATURE = 1e-2


def sample_next(logits: torch.Tensor, s: SamplingConfig, generator: torch.Generator) -> tuple[int, float]:
    """Sample one token from a [V] logit row; return (id, processed log-prob)."""
    if s.temperature <= 0:
        lp = torch.log_softmax(logits.float(), dim=-1)
        tok = int(torch.argmax(lp))
        return tok, float(lp[tok])
    lp = torch.log_softmax(logits.float() / max(s.temperature, MIN_TEMPERATURE), dim=-1)
    if s.top_p < 1.0:
        sorted_lp, order = torch.sort(lp, descending=True)
        cum = sorted_lp.exp().cumsum(-1)
        drop = cum - sorted_lp.exp() >= s.top_p  # keep the smallest prefix reaching top_p
        lp = lp.clone()
        lp[order[drop]] = float("-inf")
        lp = torch.log_softmax(lp, dim=-1)  # renormalized over the kept tokens, as vLLM reports
    tok = int(torch.multinomial(lp.exp(), 1, generator=generator))
    return tok, float(lp[tok])


def eos_ids(model, tokenizer) -> set[int]:
    """Every id that ends a sequence: the config's and generation config's eos_token_id (an int
    or, e.g. in Llama 3 configs, a list) and the tokenizer's, as vLLM stops on each of them."""
    out = set()
    for value in (model.config.eos_token_id, getattr(getattr(model, "generation_config", None), "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        out.update(value if isinstance(value, (list, tuple, set)) else [value])
    return {int(i) for i in out if i is not None}


@register_engine("reference")
class ReferenceEngine(RolloutEngine):
    backend = "reference"
    supports_routed_experts = True

    def __init__(self, model_path: str, seed: int = 0, max_batch: int = 64, max_model_len: int = 1024, dtype: str = "float32"):
        super().__init__()
        self.model_path, self.seed, self.max_batch, self.max_model_len = str(model_path), seed, max_batch, max_model_len
        self.dtype = getattr(torch, dtype)
        self._queue: list[_Request] = []
        self._active: dict[str, _Request] = {}
        self._rng = np.random.default_rng(seed)

    async def start(self) -> dict:
        from ..toy.models import load_hf_model, load_tokenizer

        self.model = load_hf_model(self.model_path, dtype=self.dtype)
        self.tokenizer = load_tokenizer(self.model_path)
        self.vocab_size = self.model.config.vocab_size
        self.eos_ids = eos_ids(self.model, self.tokenizer)
        self.capture = RouterCapture(self.model)
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._wakeup = asyncio.Event()
        self._step_lock = asyncio.Lock()  # held during each forward; weight loads wait for it
        self._loads = 0  # weight loads so far: a batch whose K/V predates the last one re-encodes
        self._scheduler = asyncio.create_task(self._run())
        return self.info()

    async def generate(self, prompt_ids, sampling=None, request_id=None, return_routed_experts=False) -> Sample:
        req = self._submit(prompt_ids, sampling, request_id, return_routed_experts)
        try:
            return await self.verified(await req.future)
        except asyncio.CancelledError:  # its caller gave up: stop sampling it (it ran on to max_tokens)
            self._abort(req.request_id)
            raise

    async def generate_stream(self, prompt_ids, sampling=None, request_id=None, return_routed_experts=False):
        """Each decode step's token as it is sampled (the steps that came while the consumer was
        away, together), then the Sample generate() would return."""
        stream: asyncio.Queue = asyncio.Queue()  # sampled ids, then None once the request is finished
        req = self._submit(prompt_ids, sampling, request_id, return_routed_experts, stream)
        req.future.add_done_callback(lambda _: stream.put_nowait(None))
        done = False
        try:
            while not done:
                ids = [await stream.get()]
                while not stream.empty():
                    ids.append(stream.get_nowait())
                done = ids[-1] is None
                if ids[0] is not None:
                    yield ids[:-1] if done else ids
            yield await self.verified(await req.future)
        finally:
            if not req.future.done():  # its reader left (cancelled, closed): stop sampling it
                self._abort(req.request_id)

    def _submit(self, prompt_ids, sampling, request_id, return_routed_experts, stream=None) -> _Request:
        self.refuse_if_torn()
        s = sampling or SamplingConfig()
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) + s.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({s.max_tokens}) exceeds max_model_len {self.max_model_len}"
            )
        if max(prompt_ids) >= self.vocab_size or min(prompt_ids) < 0:
            raise ValueError(f"prompt_ids must be in [0, {self.vocab_size})")
        seed = s.seed if s.seed is not None else int(self._rng.integers(2**62))
        req = _Request(
            list(prompt_ids), s, request_id or uuid.uuid4().hex, return_routed_experts,
            asyncio.get_running_loop().create_future(), torch.Generator().manual_seed(seed), stream,
        )
        self._queue.append(req)
        self._wakeup.set()
        return req

    async def abort(self, request_id: str) -> None:
        self._abort(request_id)

    def _abort(self, request_id: str) -> None:
        for r in list(self._queue):
            if r.request_id == request_id:
                self._queue.remove(r)
                self._finish(r, "abort")
        if request_id in self._active:
            self._active[request_id].finish_reason = "abort"

    async def pause(self) -> None:
        self._unpaused.clear()
        async with self._step_lock:  # returns once no forward is running
            pass

    async def resume(self) -> None:
        self._unpaused.set()

    async def _load_weights(self, state_dict: dict) -> None:
        async with self._step_lock:
            # checked before anything is copied: load_state_dict copies what fits, then reports, and
            # a refused load left the model half new under the old version
            own = self.model.state_dict()
            missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
            wrong = sorted(k for k in set(own) & set(state_dict) if tuple(own[k].shape) != tuple(state_dict[k].shape))
            if unexpected or missing or wrong:
                raise WeightsNotLoaded(f"weights do not fit the model (nothing loaded): missing {missing[:5]}, unexpected "
                                 f"{unexpected[:5]}, other shapes {wrong[:5]}")
            self.model.load_state_dict(state_dict, strict=True)
            self._loads += 1

    async def _fail_in_flight(self, error: TornWeights) -> None:
        for r in self._queue + list(self._active.values()):
            r.finish_reason = "abort"  # (a batch in progress drops it at its next token)
            if not r.future.done():
                r.future.set_exception(error)
        self._queue = []

    async def probe_logprobs(self, ids: list[int]) -> list[float]:
        from .engine import expected_probe_logprobs

        async with self._step_lock:
            return await asyncio.to_thread(expected_probe_logprobs, self.model, ids)

    async def shutdown(self) -> None:
        if getattr(self, "_scheduler", None) is not None:
            self._scheduler.cancel()
            self._scheduler = None
        for r in self._queue + list(self._active.values()):
            self._finish(r, "abort")
        self.capture.remove()

    # ----------------------------------------------------------------- the sampling loop
    def _finish(self, r: _Request, reason: str) -> None:
        r.finish_reason = reason
        self._active.pop(r.request_id, None)
        if r.future.done():
            return
        experts = None
        if r.want_experts and self.capture.routers:
            layers, k = len(self.capture.routers), self.model.config.num_experts_per_tok
            experts = np.full((len(r.prompt_ids) + len(r.token_ids), layers, k), -1, dtype=np.int16)
            if r.experts:
                fed = torch.stack(r.experts).numpy()[: experts.shape[0]]
                experts[: fed.shape[0]] = fed
        r.future.set_result(
            Sample(r.prompt_ids, r.token_ids, r.logprobs, r.versions, reason, r.request_id, experts)
        )

    async def _run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch :]
                try:
                    await self._run_batch(batch)
                except Exception as e:  # fail these requests, keep serving
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(e)
                        self._active.pop(r.request_id, None)

    def _forward(self, ids, mask, pos, cache):
        self.capture.active = True
        with torch.no_grad():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
        self.capture.active = False
        return out.logits[:, -1, :], out.past_key_values, self.capture.pop()

    async def _run_batch(self, batch: list[_Request]) -> None:
        from transformers import DynamicCache

        for r in batch:
            self._active[r.request_id] = r
        B = len(batch)
        live = list(range(B))
        loads = None  # the weight loads the batch's K/V was computed after
        while live:
            await self._unpaused.wait()
            async with self._step_lock:
                prefill = loads != self._loads
                if prefill:  # the start, or weights loaded since: encode every row's whole context
                    seqs = [r.prompt_ids + r.token_ids for r in batch]
                    L = max(len(q) for q in seqs)
                    ids = torch.full((B, L), self.model.config.pad_token_id or 0, dtype=torch.long)
                    mask = torch.zeros((B, L), dtype=torch.long)
                    for i, q in enumerate(seqs):  # left padding: every row's next position is column L
                        ids[i, L - len(q):] = torch.tensor(q)
                        mask[i, L - len(q):] = 1
                    pos = (mask.cumsum(-1) - 1).clamp(min=0)
                    cache, loads = DynamicCache(config=self.model.config), self._loads
                logits, cache, routed = await asyncio.to_thread(self._forward, ids, mask, pos, cache)
                version = self.version
            if routed is not None:  # [B * S, layers, k] -> per row, per fed (non-pad) position
                routed = routed.view(B, -1, *routed.shape[1:])
                for i in live:
                    r = batch[i]
                    if r.want_experts:
                        if prefill:  # a re-encoded context's experts replace the earlier ones
                            r.experts = list(routed[i, L - len(seqs[i]):])
                        else:
                            r.experts.extend(routed[i])
            next_ids = torch.full((B, 1), self.model.config.pad_token_id or 0, dtype=torch.long)
            for i in list(live):
                r = batch[i]
                if r.finish_reason == "abort":
                    self._finish(r, "abort")
                    live.remove(i)
                    continue
                tok, lp = sample_next(logits[i], r.sampling, r.generator)
                r.token_ids.append(tok)
                r.logprobs.append(lp)
                r.versions.append(version)
                if r.stream is not None:
                    r.stream.put_nowait(tok)
                next_ids[i, 0] = tok
                reason = self._stop_reason(r, tok)
                if reason:
                    self._finish(r, reason)
                    live.remove(i)
            ids = next_ids
            mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], dim=1)
            pos = pos[:, -1:] + 1

    def _stop_reason(self, r: _Request, tok: int) -> str | None:
        s = r.sampling
        if (tok in self.eos_ids and not s.ignore_eos) or tok in s.stop_token_ids:
            return "stop"
        if s.stop:
            # the last tokens, enough to hold the longest stop string (a character may take up to 4
            # byte-level tokens; a fixed 16 never stopped on a longer one, which the server then cut
            # from the text while the record ran on past it)
            # Decoded as vLLM's detokenizer does: special tokens left out, and in context (the few ids before
            # the window, their text cut off): alone, a SentencePiece window's first piece lost its space,
            # and " Observation" at a reply's start never stopped it; a stop string spelling a special
            # token stopped here and not on vLLM
            n = 16 + 4 * max(len(x) for x in s.stop)
            whole = r.prompt_ids[-4:] + r.token_ids if len(r.token_ids) <= n else r.token_ids[-n - 4:]
            context = len(whole) - min(n, len(r.token_ids))
            text = self.tokenizer.decode(whole, skip_special_tokens=True)
            tail = text[len(self.tokenizer.decode(whole[:context], skip_special_tokens=True)):]
            if any(stop in tail for stop in s.stop):
                return "stop"
        if len(r.token_ids) >= s.max_tokens:
            return "length"
        return None
