"""The "vllm" rollout backend: vLLM's AsyncLLM (or, on CPU, its engine core in this process),
driven with token ids only.

Notes that shape this file (details in ../shared FACTS and docs/ARCHITECTURE.md):
- `logprobs_mode="processed_logprobs"`: vLLM's default reports the model's raw distribution,
  but tokens are sampled from the temperature-scaled one; importance weights need the latter.
- Per-token policy versions come from vLLM's `weight_versions` spans; `update_weight_version`
  sets the version that newly sampled tokens record.
- On CPU the engine core runs in this process (rollout/vllm_inproc.py) and a weight sync hands
  the worker the tensors themselves (`WorkerExtension.load_weights` through `collective_rpc`);
  a core process gets a safetensors file in shared memory instead (`load_weights_file`: a state
  dict through collective_rpc fails to pickle). NCCL weight transfer is the GPU path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import uuid

import numpy as np

from .engine import RolloutEngine, Sample, SamplingConfig, TornWeights, WeightsNotLoaded, register_engine
from .nccl_sync import engine_kwargs as nccl_engine_kwargs


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`); runs inside the engine process."""

    def load_weights_file(self, path: str) -> int:
        from safetensors.torch import load_file

        return self.load_weights(load_file(path))

    def load_weights(self, weights: dict) -> int:
        """HF-named tensors into the model (copied). Passed as they are only to a worker in this
        process (the in-process core's "uni" executor calls it directly); a core process gets a
        file path instead (a state dict through collective_rpc fails to pickle)."""
        from vllm.config import set_current_vllm_config

        from ..toy.models import checkpoint_format, meta_hf_model
        from .nccl_sync import TransferMeta, check_meta, model_meta

        if getattr(self, "_hf_model", None) is None:  # built once: the model class's conversion rules
            self._hf_model = meta_hf_model(self.vllm_config.model_config.hf_config)
            self._expected = model_meta(self._hf_model)  # (hf_meta's, from the worker's own config)
        weights = checkpoint_format(self._hf_model, weights)  # (vLLM reads checkpoint names and layouts)
        # refused before any copy (WeightsNotLoaded): vLLM's loader fails on an unknown name after
        # loading the tensors before it (torn weights), and keeps a missing one's old weights
        check_meta(TransferMeta.from_tensors(weights.items()), self._expected)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.reload_weights(weights_iterator=iter(weights.items()), is_checkpoint_format=True)
        # vLLM 0.32 CPU bug: on a *re*load its fused-MoE method skips the CPU kernel's prepacking
        # of expert weights (done once at start-up), so the kernel then reads unpacked weights and
        # the MoE serves garbage (log-prob gap ~5 nats). Prepack again. The post-sync probe check
        # in RolloutEngine.update_weights is what caught this; tests/test_engines.py keeps it so.
        repacked = 0
        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            if kernel is not None and on_cpu():
                kernel.fused_experts.process_weights_after_loading(module)
                repacked += 1
        return repacked


def _dynamo_off() -> None:
    """torch.compile'd functions run eagerly in the calling thread (torch's config settings are
    per thread: set in another thread, this one would still compile)."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def file_tensors(state_dict: dict) -> dict:
    """A sync's tensors as safetensors can write them: a tied weight's second name (lm_head =
    embed_tokens, one tensor in the trainer's gathered state dict) gets a copy of its own.
    safetensors refuses two names of one storage, and every sync of a tied model (the small
    Qwen3s, Llama 3.2, SmolLM2) to a core process (GPUs) failed there, nothing loaded. Both
    names stay: without lm_head, vLLM's layerwise reload left the old output embedding in place
    (tiny Qwen3's probe 1.97 nats off)."""
    out, seen = {}, set()
    for name, t in state_dict.items():
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def token_versions(n: int, spans, request_id: str = "") -> list[int]:
    """The policy version of each of n sampled tokens from vLLM's `weight_versions` spans. vLLM
    returns None when no version label was ever set (update_weight_version not called) and a
    version must be an integer label: anything that leaves a token without one raises, since
    a token recorded at version -1 would pass as a prompt token to every staleness check."""
    versions: list[int | None] = [None] * n
    for span in spans or []:
        try:
            v = int(span.version)
        except (TypeError, ValueError):
            raise RuntimeError(f"vLLM reported weight version {span.version!r} for request {request_id}; "
                               f"versions must be integer labels (RolloutEngine sets them)") from None
        if not 0 <= span.start <= span.end <= n:
            raise RuntimeError(f"vLLM weight-version span [{span.start}, {span.end}) is outside the {n} sampled tokens "
                               f"of request {request_id}")
        versions[span.start : span.end] = [v] * (span.end - span.start)
    missing = [i for i, v in enumerate(versions) if v is None]
    if missing:
        raise RuntimeError(f"vLLM returned no weight version for {len(missing)} of the {n} tokens of request {request_id} "
                           f"(weight_versions={spans!r}); the engine must be started with a version label "
                           f"(VLLMEngine.start calls update_weight_version)")
    return versions


def wants_routed_experts(profile, backend: str, routing_replay: bool, gpus: int) -> bool:
    """Whether the engines record routed experts for routing replay (R3): the profile is an MoE
    that captures them, the trainer replays them, and the engine can return them: the reference
    backend anywhere, vLLM only on GPUs (its CPU build has no Model Runner V2, which the routed-
    expert return needs)."""
    return profile is not None and profile.moe and routing_off_reason(profile, backend, routing_replay, gpus) is None


def routing_off_reason(profile, backend: str, routing_replay: bool, gpus: int) -> str | None:
    """Why an MoE policy's tokens are trained with the trainer's own routing, not the sampler's
    (None: a dense model, or replay runs). Said at connect() and kept in config.json: without it the
    routing gap is in every token's ratio (kl_k3_current) and the replay statistics read 0 positions."""
    if profile is None or not profile.moe:
        return None
    if not routing_replay:
        return "trainer.routing_replay=False"
    if not profile.capture_experts:
        return (f"no routing-replay rule for the {profile.family} family's routers (the profile's capture_experts "
                f"is False): register one (workbench.replay.register_replay_rule) and set capture_experts")
    if backend == "vllm" and gpus == 0:
        return "vLLM's CPU build cannot return routed experts: the 'reference' backend records them on CPU"
    if backend not in ("vllm", "reference"):
        return f"the {backend!r} backend records no routed experts"
    return None


def moe_shape(model_path: str) -> tuple[int, int] | None:
    """(number of routed experts, experts per token) from a checkpoint's config.json; None for
    a dense model."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    experts = next((cfg[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if cfg.get(k)), None)
    if experts is None:
        return None
    return int(experts), int(cfg.get("num_experts_per_tok") or cfg.get("moe_topk") or 0)


# On CPU a KV cache of at most this much memory (SmolLM2-135M in fp32: ~11,600 tokens; the toy
# MoE: every one of 128 sequences at full length). See VLLMEngine.__init__.
CPU_KV_CACHE_BYTES = 512 << 20
# after an abort, the first delay at which it is sent again while its request is still in flight, doubled
# each time up to the last (VLLMEngine._abort_again: a burst's registrations queue on vLLM's input processing)
ABORT_AGAIN_S = (0.05, 2.0)


def kv_bytes_per_token(model_path: str) -> int | None:
    """The KV cache's bytes per token (keys and values of every layer) of a standard-attention
    checkpoint, from its config.json; None when its config does not say (then vLLM sizes it).
    Counted at 4 bytes an element whatever the dtype asked for: vLLM on CPU may upcast a 16-bit
    model to fp32, and a cache too small for one max_model_len sequence refuses to start."""
    with open(os.path.join(model_path, "config.json")) as f:
        cfg = json.load(f)
    cfg = cfg.get("text_config", cfg)
    layers, heads = cfg.get("num_hidden_layers"), cfg.get("num_attention_heads")
    if not layers or not heads or "kv_lora_rank" in cfg:  # MLA caches a latent, not heads
        return None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return 2 * layers * (cfg.get("num_key_value_heads") or heads) * head_dim * 4


def compact_experts(routed, n_tokens: int, num_experts: int, top_k: int | None = None, request_id: str = "") -> np.ndarray:
    """vLLM's routed experts for one request -> the Sample's array, checked and compact.

    vLLM returns [positions, MoE layers, top_k] for every position the model ran on: the prompt
    and each sampled token fed back, so the last sampled token has none (positions = n_tokens - 1;
    Segment pads the rest with -1, "not captured"). Ids are stored as uint8 when the model has at
    most 256 experts (Qwen3-30B-A3B: 128; 384 B per token instead of 1.5 KB as int32), int16
    otherwise. A shape or id that cannot be this model's raises: replaying garbage routes would
    train on a forward the rollout never ran."""
    a = np.asarray(routed)
    if a.ndim != 3 or not np.issubdtype(a.dtype, np.integer):
        raise RuntimeError(f"vLLM returned routed experts of shape {a.shape} ({a.dtype}) for request {request_id}; "
                           f"expected integer ids [positions, moe_layers, top_k]")
    if not n_tokens - 1 <= a.shape[0] <= n_tokens:
        raise RuntimeError(f"vLLM returned routed experts for {a.shape[0]} positions of request {request_id}, which "
                           f"has {n_tokens} tokens (prompt + sampled); expected {n_tokens - 1} or {n_tokens}")
    if top_k and a.shape[2] != top_k:
        raise RuntimeError(f"vLLM returned {a.shape[2]} experts per token for request {request_id}; the model routes "
                           f"each token to {top_k}")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= num_experts):
        raise RuntimeError(f"vLLM returned expert ids in [{int(a.min())}, {int(a.max())}] for request {request_id}; "
                           f"the model has {num_experts} experts")
    return a.astype(np.uint8 if num_experts <= 256 else np.int16)


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    backend = "vllm"

    def __init__(
        self,
        model_path: str,
        seed: int = 0,
        max_model_len: int = 1024,
        dtype: str = "float32",
        gpu_memory_utilization: float | None = None,
        kv_cache_tokens: int | None = None,
        tensor_parallel_size: int = 1,
        enable_prefix_caching: bool = True,
        enable_return_routed_experts: bool = False,
        weight_transfer: str | None = None,
        engine_core_in_process: bool | None = None,
        **engine_kwargs,
    ):
        super().__init__()
        if enable_return_routed_experts and on_cpu():
            raise NotImplementedError(
                "routed-expert capture (enable_return_routed_experts) needs vLLM's Model Runner V2, "
                "which needs Triton with a GPU backend; the CPU build cannot return routed experts. "
                "Use the 'reference' rollout backend to capture experts on CPU."
            )
        self.model_path = str(model_path)
        self.supports_routed_experts = enable_return_routed_experts
        # the expert count and top-k that returned routing is checked against (compact_experts)
        self.moe_shape = moe_shape(self.model_path) if enable_return_routed_experts else None
        if enable_return_routed_experts and self.moe_shape is None:
            raise ValueError(f"enable_return_routed_experts=True, but {self.model_path!r} is not an MoE (its config.json "
                             f"names no expert count)")
        # On CPU vLLM sizes the KV cache as gpu_memory_utilization of the NUMA node's memory less
        # what its process already holds (its default 0.92 fails there): at 0.1 that is ~1.5M
        # tokens for the toy, and allocating it costs what touching that much fresh memory costs,
        # up to ~80 MB/s on a VM that hands freed memory back to its host (measured: SmolLM2's
        # 3.66 GiB at 0.25 took 47 of the engine's 73 s start). A CPU engine instead gets the
        # tokens it needs: kv_cache_tokens, by default 128 sequences at max_model_len within
        # CPU_KV_CACHE_BYTES, never less than one full-length sequence. Past that vLLM preempts
        # and recomputes (slower, same ids). An explicit gpu_memory_utilization or
        # kv_cache_memory_bytes wins; a GPU keeps vLLM's own sizing.
        per_token = kv_bytes_per_token(self.model_path) if on_cpu() else None
        if (per_token and gpu_memory_utilization is None and "kv_cache_memory_bytes" not in engine_kwargs) or (
                kv_cache_tokens is not None):
            if not per_token:
                raise ValueError(f"kv_cache_tokens={kv_cache_tokens} needs a CPU engine and a checkpoint whose config.json "
                                 f"gives its attention shape ({self.model_path}); use gpu_memory_utilization or "
                                 f"kv_cache_memory_bytes")
            if kv_cache_tokens is None:
                kv_cache_tokens = min(128 * max_model_len, CPU_KV_CACHE_BYTES // per_token)
            kv_cache_tokens = max(kv_cache_tokens, max_model_len + 256)  # + a block's worth of slack
            engine_kwargs["kv_cache_memory_bytes"] = kv_cache_tokens * per_token
        if gpu_memory_utilization is None:
            gpu_memory_utilization = 0.1 if on_cpu() else 0.85
        if on_cpu():
            # vLLM's CPU build kills its engine core when a seeded request's prefill is chunked: it
            # rewinds the request's generator over the discarded sample, and a CPU generator has no
            # offset ("CPU Generator does not use offset"). An agent's `seed` among concurrent long
            # prompts did so within seconds, failing every request of the engine. Whole prefills
            # never discard a sample; vLLM then takes max(max_model_len, its default) tokens a step.
            engine_kwargs.setdefault("enable_chunked_prefill", False)
        # vLLM's per-step and per-request serving statistics (Prometheus histograms, timings):
        # nothing here reads them, and recording them costs engine CPU every step
        engine_kwargs.setdefault("disable_log_stats", True)
        self.engine_args = dict(
            model=self.model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=on_cpu(),
            enable_prefix_caching=enable_prefix_caching,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WorkerExtension",
            **({"enable_return_routed_experts": True} if enable_return_routed_experts else {}),
            **(nccl_engine_kwargs() if weight_transfer == "nccl" else {}),
            **engine_kwargs,
        )
        # On CPU vLLM would run its one worker in a process of its own (the "mp" executor, for
        # its OMP thread binding): a further import of vLLM (~20 s of CPU) and ~2.5 GB. The "uni"
        # executor runs it inside the engine core. And that engine core runs in this process,
        # stepped by a thread of its own (rollout/vllm_inproc.py): AsyncLLM would spawn it as a
        # process that imports vLLM again (~9 s of a connect() on 2 cores) and send every output
        # across a socket. The same ids and log-probs either way (tests/test_engines.py).
        # engine_core_in_process=False keeps AsyncLLM's core process (always so on GPUs).
        one_cpu_worker = on_cpu() and tensor_parallel_size == 1 and "distributed_executor_backend" not in engine_kwargs
        if one_cpu_worker:
            self.engine_args["distributed_executor_backend"] = "uni"
        self.in_process_core = one_cpu_worker and engine_core_in_process is not False
        if weight_transfer not in (None, "nccl"):
            raise ValueError(f"weight_transfer {weight_transfer!r} unknown: None (the CPU file path) or 'nccl' (GPU)")
        self.llm = None
        self._rx = None  # NcclReceiver once init_nccl ran
        self._shm = None  # this engine's temp dir (weight-sync files, vLLM's sockets), made by start()
        self._in_flight: set[str] = set()  # request ids generate_stream is serving
        self._failed: dict[str, BaseException] = {}  # in-flight requests aborted by _fail_in_flight: their error
        self._aborting: set = set()  # abort()'s retries still waiting (held: a task only the loop references can be collected)

    async def start(self) -> dict:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._shm = tempfile.mkdtemp(prefix="workbench-sync-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        # On CPU (enforce_eager) nothing of the model is compiled, but vLLM's sampler torch.compiles
        # its log-prob gather on the first request: ~2 s of Dynamo and Inductor, the whole of the
        # first weight sync's probe (connect's last part) and of the first rollout's wait. Eager
        # gives the same log-probs at the same speed here (measured: 128 8-token requests 0.097 s
        # either way). An in-process core runs it in the engine's thread, where Dynamo is turned
        # off below (torch's config is per thread). A core process reads the variable at its
        # import: set for its spawn only.
        # vLLM names a core process's ZMQ IPC sockets by uuid under VLLM_RPC_BASE_PATH (the temp
        # dir by default) and leaves them there: ~60 socket files an hour of tests in /tmp. This
        # engine's own temp dir holds them instead, removed at shutdown; not where the path would
        # pass the ~100-byte limit of a Unix socket's name (the temp dir when there is no /dev/shm).
        if self.in_process_core:
            from .vllm_inproc import InprocLLM

            spawn_env = {}
        else:
            # (vLLM's CPU platform keeps the "uni" executor only with VLLM_ENABLE_V1_MULTIPROCESSING=0)
            spawn_env = {**({"TORCHDYNAMO_DISABLE": "1"} if on_cpu() else {}),
                         **({"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if self.engine_args.get("distributed_executor_backend") == "uni" else {}),
                         **({"VLLM_RPC_BASE_PATH": self._shm} if len(self._shm) + 37 < 100 else {})}
            spawn_env = {k: v for k, v in spawn_env.items() if k not in os.environ}  # the user's settings win
        os.environ.update(spawn_env)
        try:
            if self.in_process_core:
                self.llm = InprocLLM(self.engine_args)
                if os.environ.get("TORCHDYNAMO_DISABLE") is None:  # (the user's setting wins)
                    await self.llm.call_in_thread(_dynamo_off)  # before the first request compiles
            else:
                self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_args))
        except BaseException:  # nothing will call shutdown(): the dir (and vLLM's sockets in it) goes now
            shutil.rmtree(self._shm, ignore_errors=True)
            self._shm = None
            raise
        finally:
            for k in spawn_env:
                del os.environ[k]
        self.vocab_size = self.llm.model_config.get_vocab_size()
        await self.llm.update_weight_version(str(self.version))
        return self.info()

    def info(self) -> dict:
        out = super().info()
        if self.llm is None:
            return out
        out["logprobs_mode"] = str(self.llm.vllm_config.model_config.logprobs_mode)  # the running engine's own
        out["workers"] = self.llm.vllm_config.parallel_config.world_size  # (tensor x pipeline parallel: its NCCL ranks)
        cache = self.llm.vllm_config.cache_config
        if cache is not None and cache.num_gpu_blocks:
            out["kv_cache_tokens"] = cache.num_gpu_blocks * cache.block_size
        return out

    async def generate(self, prompt_ids, sampling=None, request_id=None, return_routed_experts=False) -> Sample:
        async for item in self.generate_stream(prompt_ids, sampling, request_id, return_routed_experts, final_only=True):
            pass
        return item

    async def generate_stream(self, prompt_ids, sampling=None, request_id=None, return_routed_experts=False,
                              final_only: bool = False):
        """vLLM's incremental outputs (AsyncLLM.generate, cumulative: each output holds every id so
        far) as lists of new ids, then the Sample built from the final output: generate() is this,
        consumed, so a streamed and an unstreamed request record the same thing. `final_only`
        (generate()): vLLM makes the final output only (RequestOutputKind.FINAL_ONLY), so nothing
        comes before the Sample. The Sample is the same: vLLM keeps the ids, log-probs and version
        spans per request whatever it hands out, and an output per request and engine step that
        nobody read cost time: the quickstart's batch (128 requests, 8 tokens) 0.130 s vs 0.137 s
        a batch, alternating in one process (0.95x, 2026-12-05)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if return_routed_experts and not self.supports_routed_experts:
            raise NotImplementedError(
                "this vllm engine does not return routed experts: start it with "
                "enable_return_routed_experts=True (GPU only) or use the 'reference' backend"
            )
        self.refuse_if_torn()
        s = sampling or SamplingConfig()
        request_id = request_id or uuid.uuid4().hex
        params = SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=s.max_tokens,
            stop=s.stop or None,
            stop_token_ids=s.stop_token_ids or None,
            ignore_eos=s.ignore_eos,
            seed=s.seed,
            logprobs=0,  # the sampled token's own log-prob
            # ids are the record and the runner decodes them with the policy's tokenizer; vLLM's
            # own detokenizing (of every output and every log-prob entry) is needed only to match
            # stop strings: without it its output processing takes ~25% less CPU
            detokenize=bool(s.stop),
            output_kind=RequestOutputKind.FINAL_ONLY if final_only else RequestOutputKind.CUMULATIVE,
            # made for this request alone: vLLM may take it as it is rather than deep-copy it (its
            # ~45 fields, ~22 us a request: ~3 ms of a quickstart rollout's 128)
            skip_clone=True,
        )
        final, n = None, 0
        self._in_flight.add(request_id)
        try:
            async for out in self.llm.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params, request_id=request_id):
                if request_id in self._failed and final is None:  # failed by a torn load before vLLM had
                    # registered it (AsyncLLM adds a request over several awaits): its abort found nothing
                    await self.llm.abort(request_id)
                final = out
                new = list(out.outputs[0].token_ids[n:])  # copied now: vLLM may go on appending to that list
                if new and not out.finished:
                    n += len(new)
                    yield new
        finally:
            self._in_flight.discard(request_id)
            failed = self._failed.pop(request_id, None)
        if failed is not None:
            raise failed
        o = final.outputs[0]
        ids = list(o.token_ids)
        logprobs = [d[t].logprob for t, d in zip(ids, o.logprobs or [])]
        versions = token_versions(len(ids), getattr(o, "weight_versions", None), request_id)
        experts = None
        if return_routed_experts:
            # asked for and missing would silently turn replay off for this sample's tokens
            if getattr(o, "routed_experts", None) is None:
                raise RuntimeError(f"vLLM returned no routed experts for request {request_id} although the engine "
                                   f"was started with enable_return_routed_experts=True")
            experts = compact_experts(o.routed_experts, len(prompt_ids) + len(ids), *self.moe_shape, request_id)
        yield await self.verified(Sample(
            prompt_ids=list(prompt_ids),
            token_ids=ids,
            logprobs=logprobs,
            versions=versions,
            finish_reason=o.finish_reason or "abort",
            request_id=request_id,
            routed_experts=experts,
        ))

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)
        if request_id in self._in_flight:  # it may not be registered yet: aborted again while it is in flight
            task = asyncio.ensure_future(self._abort_again(request_id))
            self._aborting.add(task)
            task.add_done_callback(self._aborting.discard)

    async def _abort_again(self, request_id: str) -> None:
        """AsyncLLM registers a request only after awaiting its input processing: an abort in that
        window (a request given up within milliseconds of its send, EngineRouter's abort of a
        coalesced call's request) found nothing, and the request sampled on to max_tokens, unread.
        vLLM drops the abort of an id it does not hold, so one that had worked costs nothing more;
        sent again for as long as the request is in flight (a burst's registrations queue one after
        another on vLLM's input processing: a fixed few tries gave up on the late ones). (The
        in-process core keeps such ids itself: InprocLLM._aborted_unsent.)"""
        delay, longest = ABORT_AGAIN_S
        while True:
            await asyncio.sleep(delay)
            if request_id not in self._in_flight or self.llm is None:  # ended (aborted, finished, failed), or shut down
                return
            await self.llm.abort(request_id)
            delay = min(2 * delay, longest)

    async def pause(self) -> None:
        # "keep": in-flight requests are frozen, not aborted, and continue after resume.
        # AsyncLLM.pause_generation is this call plus a fixed 20 ms sleep that only lets outputs
        # already produced reach their callers first ("not required for correctness", vLLM says):
        # each token's version is set by the engine core, not by when its output arrives. A loop
        # step's sync measured 0.110 s with the sleep, 0.093 s without.
        core = getattr(self.llm, "engine_core", None)
        if hasattr(core, "pause_scheduler_async"):
            await core.pause_scheduler_async(mode="keep", clear_cache=False)
        else:  # the in-process core (vllm_inproc.InprocLLM) pauses by not stepping
            await self.llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def _load_weights(self, state_dict: dict) -> None:
        if self.in_process_core:  # the worker is in this process: the tensors go by reference (it checks
            # the names and shapes first; its WeightsNotLoaded reaches here as it is)
            await self.llm.collective_rpc("load_weights", args=(state_dict,))
        else:
            from safetensors.torch import save_file

            from .nccl_sync import check_meta, hf_meta, sent_meta

            # checked here: a core process's refusal comes back as a plain Exception, read as a torn load
            check_meta(sent_meta(self.model_path, state_dict), hf_meta(self.model_path))
            path = os.path.join(self._shm, f"v{self.version + 1}.safetensors")
            try:
                save_file(file_tensors(state_dict), path)
            except Exception as e:  # (a full /dev/shm: safetensors' own error type): nothing reached the model
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise WeightsNotLoaded(f"the weights could not be written for the engine's core ({e}); nothing loaded") from e
            try:
                await self.llm.collective_rpc("load_weights_file", args=(path,))
            finally:
                os.unlink(path)
        await self._drop_old_kv()

    async def _fail_in_flight(self, error: TornWeights) -> None:
        for request_id in list(self._in_flight):  # each ends as aborted; generate_stream raises its error
            if request_id in self._in_flight:  # (not finished while an earlier one's abort was awaited)
                self._failed[request_id] = error
                await self.abort(request_id)  # (again while in flight: one not registered yet ran on to max_tokens)

    async def _drop_old_kv(self) -> None:
        """After a load: no K/V computed with the old weights may be read again. vLLM's plain
        prefix-cache reset refuses (a warning, False) while any request holds blocks, i.e. at
        every sync of a partial rollout; new requests then reused the old weights' prefixes and
        in-flight ones kept their old K/V, so tokens tagged with the new version were sampled
        from neither policy (measured: 7.6 nats off the new weights on the toy MoE). Preempting
        the in-flight requests frees their blocks: each resumes by recomputing its context under
        the new weights, so every token is exactly its version's policy on its whole context
        (what the trainer and routing replay reproduce), at the cost of that recompute. A KV
        connector's cache too (engine_kwargs kv_offloading_size, kv_transfer_config: vLLM clears it
        only when asked, reset_connector): left, a later prefix hit loaded K/V the old weights made."""
        if await self.llm.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is False:  # (vLLM 0.32 raises instead)
            raise RuntimeError("vLLM refused to drop the K/V of the old weights after a weight load: "
                               "tokens sampled now would read it; the sync is not complete")

    async def _set_version(self, version: int) -> None:
        await self.llm.update_weight_version(str(version))

    # GPU path (rollout/nccl_sync.py): start the engine with weight_transfer="nccl", join the
    # trainer's NCCL group once, then receive every sync by broadcast instead of a file.
    async def init_nccl(self, cfg, rank_offset: int, world_size: int) -> None:
        from .nccl_sync import NcclReceiver, hf_meta

        rx = NcclReceiver(self.llm, cfg, rank_offset, world_size, expected=hf_meta(self.model_path))
        await rx.init()  # (refused without GPUs: then there is no receiver to close at shutdown)
        self._rx = rx

    async def update_weights_nccl(self, meta: dict, version=None, expected_probe=None, probe=None, tol: float = 1e-3):
        """update_weights, with the weights arriving by NCCL broadcast (the trainer sends at the
        same time; see Trainer.sync_weights_nccl). `meta`: TransferMeta.update_info() fields."""
        if self._rx is None:
            raise RuntimeError("update_weights_nccl before init_nccl: start the engine with weight_transfer='nccl' "
                               "and call Trainer.init_nccl_sync(engines) once")

        async def load(v: int) -> None:
            await self._rx.receive_update(meta["names"], meta["dtype_names"], meta["shapes"], v)
            await self._drop_old_kv()

        from .nccl_sync import TransferMeta

        nbytes = sum(TransferMeta(meta["names"], meta["dtype_names"], meta["shapes"]).nbytes())
        return await self._update(load, nbytes, version, expected_probe, probe, tol)

    async def probe_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i] | ids[:i]) for i >= 1, at temperature 1. The prompt is ids[:-1] and the
        last token's log-prob is the one position's (logprob_token_ids): vLLM refuses a prompt
        that fills the context (it must leave room for one token), and a distillation teacher
        scores whole segments, which a reply cut at the context's end fills exactly."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(ids)
        if len(ids) < 2:  # no token with a context: nothing to score (and vLLM refuses an empty prompt)
            return []
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, logprob_token_ids=[ids[-1]])
        final = None
        async for out in self.llm.generate(TokensPrompt(prompt_token_ids=ids[:-1]), params, request_id=f"probe-{uuid.uuid4().hex}"):
            final = out
        last = final.outputs[0].logprobs[0][ids[-1]].logprob
        return [d[t].logprob for t, d in zip(ids[1:-1], final.prompt_logprobs[1:])] + [last]

    async def shutdown(self) -> None:
        for task in list(self._aborting):  # (abort()'s retries: nothing left to abort)
            task.cancel()
        if self._rx is not None:
            await self._rx.close()
            self._rx = None
        if self.llm is not None:
            # On CPU the engine core's own teardown takes ~2 s; its Python exit (a process holding
            # vLLM and torch) ~3 s more, which vLLM's default 5 s grace waits out. After 2 s
            # vLLM kills it instead: nothing of a CPU engine outlives the process but what the
            # OS frees with it. (GPU engines keep vLLM's grace: device memory is released there.)
            self.llm.shutdown(timeout=2.0 if on_cpu() else None)
            self.llm = None
        if self._shm is not None:
            shutil.rmtree(self._shm, ignore_errors=True)
