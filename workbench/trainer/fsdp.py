"""The FSDP2 trainer: a Ray actor group of N ranks (gloo on CPU, NCCL on GPU) over an HF
transformers causal LM, dense or MoE.

Each rank shards every decoder layer and the root with `fully_shard`. A step, on one batch
(rows = segments, see tokens.training_tensors), split evenly over ranks:

    per micro-batch: log-probs (grad, routing replayed) -> correction weights (workbench.correction)
    -> surrogate -> backward;  then clip grad norm -> optimizer step

pi_old is the gradient forward's own log-probs, detached, with one update a step (the default);
with updates_per_step > 1 a no-grad forward first computes it (the ratio then moves between updates).

Log-probs are of the sampled tokens under logits / sampling temperature (what the engine's
processed log-probs are, for top_p = 1), aligned per token: column i is token i's log-prob
given tokens < i; column 0 is 0.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from ..correction import CorrectionConfig, correction_weights, kl_k3_sum, merge_stats
from ..replay import ReplayStats, routing_replay
from .logprobs import forward_logprobs, logprob_head, sampled_logprobs
from .packing import micro_batches_by_tokens, pack, packed_forward, packing_leak, packing_mixes, unpack
from .losses import (KL_ESTIMATORS, SEQUENCE_SURROGATES, SURROGATES, AdvantageInput, aggregation_weights, episode_units,
                     get_surrogate, kl_penalty, kl_to_reference)

# A CPU trainer step frees and re-allocates the same large buffers (activations, logits,
# gradients). glibc serves an allocation over its mmap threshold (128 KB to 32 MB) with a fresh
# mapping and unmaps it at free, so every step faults those pages in again (SmolLM2's recipe
# step: ~1.2M faults, 1.6-1.7x its time on a 2-core VM). Without mmap and heap trimming, freed
# memory stays mapped and a warm step faults nothing; the rank keeps its peak memory and some
# fragmentation (figures: docs/ARCHITECTURE.md, `bench/trainer.py --malloc-only`). glibc reads
# these variables at process start, so they go into the ranks' Ray runtime_env.
CPU_MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}


@dataclass
class TrainerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8
    # pack each micro-batch's rows, first-fit, into as few rows of its longest row's width as hold them
    # (trainer/packing.py): only the packed rows' tails are padding, and each row's log-probs equal its
    # padded forward's to fp32 rounding. Checked
    # at setup: off (padded) for a model whose forward mixes packed sequences (packing_leak)
    pack_sequences: bool = True
    # with pack_sequences: micro-batches of at most this many real tokens (a longer row alone), the
    # count agreed across ranks; None: micro_batch_size rows each
    micro_batch_tokens: int | None = None
    # optimizer updates per train_step: the batch's rows are cut into this many mini-batches, one
    # AdamW step each, all against the same pi_old (the weights at the start of the step). With 1,
    # pi_old is the gradient forward's own log-probs and every surrogate's ratio is exactly 1
    # (PPO clipping, CISPO's cap and GSPO act only from the second update on).
    updates_per_step: int = 1
    temperature: float = 1.0  # the sampling temperature: trainer log-probs use logits / T
    # log-probs of the sampled ids a chunk of positions at a time, each chunk's fp32 logits at
    # most this many MB (trainer/logprobs.py); None: full [batch, length, vocab] logits
    logprob_chunk_mb: float | None = 256.0
    surrogate: str = "ppo_clip"  # with updates_per_step=1 every surrogate sees ratio 1 (see updates_per_step)
    surrogate_kwargs: dict = field(default_factory=dict)
    # token_mean | seq_mean_token_mean | constant (losses.aggregation_weights); None: the surrogate's
    # (loss_aggregation: token_mean, seq_mean_token_mean for a sequence-level one such as GSPO)
    aggregation: str | None = None
    # "constant" (Dr.GRPO) divides each episode's token-loss sum by this fixed length (e.g. the
    # rollout's max tokens per episode), never by the batch's padded width, which changes per batch
    constant_len: int | None = None
    # optional KL penalty to a frozen reference (the initial weights, or ref_model_path): each
    # token loss gains kl_coef * KL_ESTIMATORS[kl_estimator](log pi - log pi_ref)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    ref_model_path: str | None = None
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    routing_replay: bool = True  # MoE: replay the rollout's expert ids when the batch has them
    # MoE with recorded experts: one more no-grad forward with live routing, to report the
    # train-vs-rollout KL without replay (kl_k3_live) next to the one with it (what replay buys),
    # on a Trainer's first train_step and every this many after it (counted by the Trainer, so a
    # new session, a resumed run's included, starts its count again), None on the others; True
    # or 1: every step, False or 0: never. Why not every step: it made the quickstart batch's
    # train_step 1.35x, and the loop's step on the reference backend 1.12x (docs/ARCHITECTURE.md).
    measure_live_routing: int = 10
    activation_checkpointing: bool = False  # recompute layer activations in backward (replay holds there)
    # FSDP2: free each unit's gathered parameters after its forward (True: least memory) or keep
    # them for the backward (False: one all-gather per unit and micro-batch fewer; ZeRO-2-like).
    # None: torch's rule, True for the layers and False for the root, whose backward starts at
    # once and would gather it again (with shard_unit "model", the CPU default, the root is all:
    # one all-gather a micro-batch instead of two); with one rank (world_size 1) False for every
    # unit: nothing is sharded across ranks, and gathering each layer again (a copy, and a cast
    # with mixed_precision) for its backward only costs time. On an H200, a 0.6B model's step took
    # 0.876x -> 0.952x a plain HF loop's (scripts/gpu_check.py); kept, the gathered copy costs one
    # more copy of the model in the compute dtype between forward and backward (True frees it)
    reshard_after_forward: bool | None = None
    # FSDP2's units: "layer" (each decoder layer, then the root: one layer's full parameters at a
    # time, each unit's all-gather overlapping compute on GPUs) or "model" (the root alone: one
    # all-gather and one reduce-scatter a micro-batch). On CPU a gloo collective overlaps nothing
    # and costs milliseconds: train_step on the quickstart's batch (128 x 33 tokens, 2 ranks)
    # took 186-206 ms per layer, 142-163 ms as one unit. None: "model" on CPU ranks, "layer" on GPUs.
    shard_unit: str | None = None
    dtype: str = "float32"  # the parameters' dtype (the FSDP shards and the optimizer state)
    # FSDP2 mixed precision: compute in this dtype ("bfloat16" on GPU), reduce gradients in fp32,
    # keep fp32 master weights. None: compute in `dtype`.
    mixed_precision: str | None = None
    # the frozen reference's parameter dtype (kl_coef > 0): it has no optimizer, so no master
    # weights; None: mixed_precision if set (half the bytes of fp32), else dtype
    ref_dtype: str | None = None
    # FSDP2 CPUOffloadPolicy: the sharded parameters, their gradients and the optimizer state live
    # in host memory (the optimizer step runs there); each layer is copied to the GPU to compute
    cpu_offload: bool = False
    seed: int = 0
    # CPU ranks (no GPUs in the cluster): glibc keeps freed memory for re-use (CPU_MALLOC_ENV)
    # instead of unmapping it, so a step re-uses the pages the last one faulted in. False: glibc's
    # default (the rank's memory shrinks after a step; every step faults its large buffers in again)
    keep_freed_memory: bool = True
    # how the ranks get the weights: "full" (each rank loads the whole checkpoint in `dtype`, moves
    # it to its device and shards it: simple, but 8 full copies in host memory and a full copy on
    # each GPU for a moment) or "rank0" (every rank builds the model on the meta device and shards
    # it empty; rank 0 alone reads the checkpoint, on CPU, and broadcasts it tensor by tensor, each
    # rank keeping its shard: what a 30B model on 80 GB GPUs needs; docs/cluster.md) or "sharded"
    # (meta init and sharding as "rank0", then each rank reads from the safetensors only the
    # slices it owns: no full copy anywhere; trainer/loading.py)
    load: str = "full"

    @property
    def loss_aggregation(self) -> str:
        """The aggregation in force: `aggregation`, else the surrogate's own (seq_mean_token_mean for
        a sequence-level one: GSPO under token_mean weighed each sequence by its length)."""
        if self.aggregation is not None:
            return self.aggregation
        return "seq_mean_token_mean" if self.surrogate in SEQUENCE_SURROGATES else "token_mean"

    def __post_init__(self):
        for name in ("dtype", "mixed_precision", "ref_dtype"):
            v = getattr(self, name)
            if v is not None and not isinstance(getattr(torch, str(v), None), torch.dtype):
                raise ValueError(f"TrainerConfig.{name}={v!r} is not a torch dtype name (e.g. 'float32', 'bfloat16')")
        if self.micro_batch_tokens is not None and (not self.pack_sequences or self.micro_batch_tokens < 1):
            raise ValueError(f"TrainerConfig.micro_batch_tokens needs pack_sequences=True and a value >= 1, got "
                             f"{self.micro_batch_tokens} with pack_sequences={self.pack_sequences}")
        if not isinstance(self.measure_live_routing, int) or self.measure_live_routing < 0:
            raise ValueError(f"TrainerConfig.measure_live_routing is every how many steps (0 or False: never, 1 or True: "
                             f"every step), got {self.measure_live_routing!r}")
        if self.micro_batch_size < 1 or self.updates_per_step < 1:
            raise ValueError(f"TrainerConfig.micro_batch_size and updates_per_step must be >= 1, got "
                             f"{self.micro_batch_size}, {self.updates_per_step}")
        if self.aggregation not in (None, "token_mean", "seq_mean_token_mean", "constant"):
            raise ValueError(f"TrainerConfig.aggregation {self.aggregation!r} unknown: token_mean, seq_mean_token_mean, "
                             "constant or None (the surrogate's)")
        if self.aggregation == "constant" and not (isinstance(self.constant_len, int) and self.constant_len > 0):
            raise ValueError("TrainerConfig.aggregation='constant' needs constant_len, a fixed positive length (e.g. the "
                             f"rollout's max tokens per episode), got {self.constant_len!r}")
        surrogate = get_surrogate(self.surrogate)  # unknown names fail here, not on the first step
        import inspect  # and arguments it does not take (cispo dropped them: `eps_low` did nothing)

        try:
            inspect.signature(surrogate).bind(*range(5), **self.surrogate_kwargs)
        except TypeError as e:
            raise ValueError(f"surrogate_kwargs {self.surrogate_kwargs} do not fit surrogate {self.surrogate!r} ({e}); "
                             f"it takes {list(inspect.signature(surrogate).parameters)[5:]}") from None
        # numbers where the surrogate's default is one: YAML reads 3e-4 (no dot) as text, and the run
        # failed in the ranks at its first step ("unsupported operand ... 'int' and 'str'"), after its start-up
        kwargs, params = dict(self.surrogate_kwargs), inspect.signature(surrogate).parameters
        for name, value in kwargs.items():
            default = params[name].default
            if isinstance(default, (int, float)) and not isinstance(default, bool) and \
                    (isinstance(value, bool) or not isinstance(value, (int, float))):
                try:
                    kwargs[name] = float(value) if not isinstance(value, bool) else None
                except (TypeError, ValueError):
                    kwargs[name] = None
                if kwargs[name] is None or not math.isfinite(kwargs[name]):
                    raise ValueError(f"surrogate_kwargs[{name!r}] must be a number (surrogate {self.surrogate!r}), got {value!r}")
        # clip widths (the built-in surrogates' and any registered one's of the same names): a negative
        # eps_low put clamp's min above its max, every token read 1 + eps_high, and negative-advantage tokens
        # trained nothing (a run learning from its successes alone, looking healthy); a negative eps_high did
        # the same to the positive ones, and CISPO's below -1 reversed every gradient
        for name, high in (("eps_low", 1.0), ("eps_high", math.inf)):
            v = kwargs.get(name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not 0 <= v < high:
                raise ValueError(f"surrogate_kwargs[{name!r}] is a clip width: it must be >= 0"
                                 f"{' and < 1' if high == 1.0 else ''} (surrogate {self.surrogate!r}), got {v!r}")
        self.surrogate_kwargs = kwargs
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"TrainerConfig.kl_estimator {self.kl_estimator!r} unknown: {sorted(KL_ESTIMATORS)}")
        if self.kl_coef > 0 and self.kl_estimator == "k1":
            raise ValueError("TrainerConfig.kl_estimator 'k1' as a penalty (kl_coef > 0) pulls nowhere: its gradient on "
                             "tokens sampled from the policy is 0 in expectation (E[grad log pi] = 0). Use 'k2' (gradient "
                             "of KL(pi || pi_ref)) or 'k3' (gradient of KL(pi_ref || pi), GRPO's); losses.KL_ESTIMATORS")
        if self.shard_unit not in (None, "layer", "model"):
            raise ValueError(f"TrainerConfig.shard_unit {self.shard_unit!r} unknown: 'layer', 'model' or None (by device)")
        if self.load not in ("full", "rank0", "sharded"):
            raise ValueError(f"TrainerConfig.load {self.load!r} unknown: 'full', 'rank0' or 'sharded'")
        # (NaN passed `< 0` and read as 0: no reference model, the KL penalty off without a word)
        if isinstance(self.kl_coef, bool) or not isinstance(self.kl_coef, (int, float)) or not 0 <= self.kl_coef < math.inf:
            raise ValueError(f"TrainerConfig.kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not 0 < self.temperature < math.inf:  # the trainer's log-probs are of logits / temperature
            raise ValueError(f"TrainerConfig.temperature must be a finite number > 0 (the sampling temperature), "
                             f"got {self.temperature!r}")
        # torch refused a bad lr or weight decay only inside the ranks, after every process had started;
        # max_grad_norm it took as given: clip_grad_norm_ scales by max_norm / norm, so a negative one
        # reversed every gradient (gradient ascent, grad_norm reading as usual), 0 zeroed them (an update
        # of nothing, unskipped: the skip reads the norm before clipping) and NaN made every weight NaN
        for name, low, what in (("lr", 0.0, "a finite number > 0"), ("max_grad_norm", 0.0, "> 0 (float('inf'): no clipping)"),
                                ("weight_decay", None, "a finite number >= 0")):
            v = getattr(self, name)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v) and (
                (v > low and (math.isfinite(v) or name == "max_grad_norm")) if low is not None else (0 <= v < math.inf))
            if not ok:
                raise ValueError(f"TrainerConfig.{name} must be {what}, got {v!r}")
        if not isinstance(self.correction, CorrectionConfig):
            # (a None from an empty YAML key, a name, a dict inside a TrainerConfig object: each failed at the
            # first run or step, after the session had started, naming nothing)
            raise ValueError(f"TrainerConfig.correction must be a CorrectionConfig (or, given to connect(), a dict of its "
                             f"fields), got {self.correction!r}")


def _routing_layout(model) -> list:
    """Per MoE router, its class, decoder layer and weight's shape (an FSDP DTensor's global one):
    two models with the same layout can replay one record."""
    from ..replay import moe_routers, router_layers

    routers = moe_routers(model)
    return list(zip([type(r).__name__ for r in routers], router_layers(model) if routers else [],
                    [tuple(getattr(r, "weight", torch.empty(0)).shape) for r in routers]))


def current_rows(batch: dict, version: int) -> torch.Tensor:
    """[rows, 1]: the rows whose every sampled token (version >= 0) was sampled by `version`,
    where routing replay's disagreement is compared. A token an older version sampled (an async
    run's stale groups; a second update's rows, on weights the first moved) was routed by that
    version's router: live routing there differs from the record by the optimizer's moves, and
    flagged a healthy async run at every step (0.24 of the toy's routings after one update at
    lr 1e-3, against the audit's 0.05)."""
    versions = batch["versions"]
    return ((versions < 0) | (versions == version)).all(-1, keepdim=True)


@contextlib.contextmanager
def replayed_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, experts=None, apply_replay: bool = True,
                      positions=None, chunk_mb: float | None = 256.0, packed: bool = False, host_mask=None, compare=None):
    """Yields (log-probs [B, T] with column 0 = 0, ReplayStats) of one forward of `model`, with
    routing replay when `experts` ([B, T, layers, k]) is given; run the backward inside the
    context (activation-checkpoint recomputes must replay too). `apply_replay=False` routes live
    but still counts where live routing disagrees with `experts`. `positions`: where replay
    statistics count (default: the attention mask), `compare` where the disagreement does (default:
    there; routing_replay). `chunk_mb`: the largest fp32 logits chunk
    (trainer/logprobs.py; None: full logits). `packed`: the rows' attended tokens as one row
    (trainer/packing.py); padding positions then get log-prob 0; `host_mask`: the attention mask's
    copy on the host, where the packing plan is made (None: read from the device)."""
    positions = attention_mask if positions is None else positions
    if not packed:
        with routing_replay(model, experts, apply=apply_replay, positions=positions, compare=compare) as stats:
            yield forward_logprobs(model, input_ids, attention_mask, temperature, chunk_mb), stats
        return
    p = pack(input_ids, attention_mask, experts, positions, host_mask, compare)
    with routing_replay(model, p.experts, apply=apply_replay, positions=p.counted, compare=p.compared) as stats:
        with logprob_head(model, p.input_ids, temperature, chunk_mb) as swapped:
            out = packed_forward(model, p).logits
        yield unpack(out if swapped else sampled_logprobs(out, p.input_ids, temperature), p), stats


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, experts=None, apply_replay: bool = True,
                   positions=None, chunk_mb: float | None = 256.0, packed: bool = False, host_mask=None):
    """(log-probs, ReplayStats) of one forward: replayed_logprobs, without a backward."""
    with replayed_logprobs(model, input_ids, attention_mask, temperature, experts, apply_replay, positions,
                           chunk_mb, packed, host_mask) as (lp, stats):
        pass
    return lp, stats


def _once_per_tensor(tensors: dict, convert) -> dict:
    """`convert(name, tensor)` once per tensor: a tied weight stays one tensor under its two names."""
    made: dict = {}
    for k, v in tensors.items():
        if id(v) not in made:
            made[id(v)] = convert(k, v)
    return {k: made[id(v)] for k, v in tensors.items()}


def free_port() -> int:
    """A TCP port free on every interface of this host (a rendezvous on the cluster network
    listens on all of them, not only on loopback)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


RENDEZVOUS_TIMEOUT_S = 600  # how long ranks wait for each other (loading a large model on every rank comes first)


def complete_optimizer_state(optimizer) -> None:
    """Zero state (moments 0, step 0: a fresh AdamW's) for every parameter that has none while
    others have some: AdamW makes none for a parameter whose gradient stayed None (a forward that
    never uses it, e.g. a multimodal checkpoint's vision tower). Saved without it, the checkpoint
    could not be loaded: a fresh optimizer's state dict names every parameter, and
    torch.distributed.checkpoint refused the missing keys, after the crash a resume was for."""
    template = next((st for st in optimizer.state.values() if st), None)
    if template is None:  # nothing yet: TrainerWorker.save's fresh path
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {k: (torch.zeros_like(v) if v.dim() == 0 else torch.zeros_like(p, dtype=v.dtype))
                                      if torch.is_tensor(v) else v for k, v in template.items()}


def _sum_replay(parts: list) -> dict:
    """Per-layer replayed / fallback / disagree / unreplayed counts (ReplayStats or their dicts), summed."""
    keys = ("replayed", "fallback", "disagree", "unreplayed", "compared")
    parts = [{k: getattr(p, k) for k in keys} if isinstance(p, ReplayStats) else p for p in parts]
    return {k: [sum(col) for col in zip(*(p[k] for p in parts))] for k in keys}


def replay_summary(parts: list[dict]) -> dict:
    """Replay statistics summed over ranks: per-layer replayed / fallback / disagree counts,
    the overall disagreement rate (live top-k differs from the recorded one) and per layer: None
    where nothing was replayed (no routing captured: every position fell back, or no MoE layer),
    which read 0.0, a perfect agreement nobody measured, in the monitors and loggers."""
    acc = _sum_replay(parts)
    acc["disagree_rate"] = sum(acc["disagree"]) / sum(acc["compared"]) if sum(acc["compared"]) else None
    acc["disagree_rate_per_layer"] = [d / r if r else None for d, r in zip(acc["disagree"], acc["compared"])]
    return acc


KL_RATIO_CAP = 2.0  # the KL-to-reference term's weight pi / pi_old is truncated here (train_step)


def no_dropout(model) -> list[str]:
    """Switch off what a model does only in training mode besides keeping activations: dropout
    (nn.Dropout modules, attention modules' attention_dropout) and router jitter noise. The
    trainer runs in training mode (gradient checkpointing needs it) while the behaviour
    log-probs come from an engine that never drops out: pi_old, the gradient forward's own
    log-probs, and so every importance ratio and gate decision were noise on such a checkpoint
    (attention_dropout > 0, GPT-2's 0.1s, Mixtral's router_jitter_noise). Returns what it changed."""
    changed = set()
    for name in [k for k, v in vars(model.config).items() if isinstance(v, float) and v > 0
                 and ("dropout" in k or k.endswith("pdrop") or "jitter" in k)]:
        setattr(model.config, name, 0.0)
        changed.add(name)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            module.p = 0.0
            changed.add("nn.Dropout")
        for attr in ("attention_dropout", "jitter_noise", "router_jitter_noise"):
            value = getattr(module, attr, None)
            if isinstance(value, float) and value > 0:
                setattr(module, attr, 0.0)
                changed.add(attr)
    return sorted(changed)


def update_runs(n: int, updates: int) -> list[range]:
    """The rows of each of `updates` optimizer updates over n rows: contiguous runs of near-equal
    size (the longer ones first, one row longer), one a row with fewer rows than updates (an
    empty mini-batch would average a zero gradient norm into the step's). Runs of
    ceil(n / updates) rows took fewer updates than asked: 6 rows in 4 updates were 3 runs of 2,
    10 in 8 were 5."""
    k = min(updates, n) or 1
    sizes = [n // k + (u < n % k) for u in range(k)]
    starts = [sum(sizes[:u]) for u in range(k)]
    return [range(a, a + size) for a, size in zip(starts, sizes)]


def episode_runs(row_keys, updates: int) -> list[list[int]] | None:
    """update_runs cut at episodes: each update's rows whole episodes, near-equal episode counts.
    `row_keys`: each row's (episode id, segment index) (batch_from_groups' row_keys). Cut by rows,
    an episode sealed into many segments filled most of an update alone, and with the update's mean
    over its own episodes it weighed up to twice the others of the step (DESIGN: the episode is the
    unit of credit). An episode's rows are contiguous (batch_from_groups): one starts where the id
    changes or the segment index does not grow (ids may repeat: "" on trajectories built by hand).
    None where rows carry no keys."""
    if not row_keys:
        return None
    episodes: list[list[int]] = []
    for i, key in enumerate(row_keys):
        last = row_keys[i - 1] if i else None
        if last is not None and last[0] == key[0] and key[1] > last[1]:
            episodes[-1].append(i)
        else:
            episodes.append([i])
    return [[i for e in episodes[r.start: r.stop] for i in e] for r in update_runs(len(episodes), updates)]


def host_threads_per_gpu() -> int:
    """This node's cores divided by its GPUs (one trainer rank a GPU)."""
    node = ray.get_runtime_context().get_node_id()
    gpus = next((n.get("Resources", {}).get("GPU", 0) for n in ray.nodes() if n.get("NodeID") == node), 0)
    return max(1, len(os.sched_getaffinity(0)) // max(1, int(gpus)))


def durable(f) -> None:
    """Flush an open file to the disk: a checkpoint's files written but not synced could be empty
    after a power loss or a host crash that kept the renames swapping them in (the old one
    already removed: no checkpoint to resume from)."""
    f.flush()
    os.fsync(f.fileno())


def durable_dir(path: str) -> None:
    """Sync a directory's entries (files made or renamed in it), where the file system can (some
    network and FUSE ones refuse a directory's fsync: EINVAL, ENOTSUP; a save must not fail there)."""
    import errno

    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class PartialUpdate(RuntimeError):
    """A train step that raised after some of its optimizer updates were applied."""


class TrainerOutOfStep(RuntimeError):
    """A train step failed on some ranks while others went on (or finished): the ranks' collectives
    are out of step (a survivor's next collective pairs with the failed rank's next step), so the
    trainer group was stopped. `blocked`: no call can reach the trainer again (the session says so)."""

    blocked = True


# how long a failed step's other ranks are given to fail too (ranks failing together, at one point,
# stay in step: the next step starts clean); past it, the group is out of step
RANKS_AGREE_S = 10.0


class WeightSyncBroken(RuntimeError):
    """The NCCL weight-sync group lost a member: it can never sync again. `blocked`: a broadcast
    failed part-way and trainer rank 0 is stuck inside it for good (NCCL has no timeout), so no
    call can reach the ranks either (no checkpoint, no export: the trainer is gone). Unblocked (a
    member found missing or dead before any broadcast), the ranks still save and export."""

    def __init__(self, message: str, blocked: bool = False):
        super().__init__(message)
        self.blocked = blocked


class TrainerWorker:
    """One rank (Ray actor body). Built in two calls: the constructor only records its place;
    rank 0's `rendezvous()` opens the process group's store on its own node; then every rank's
    `setup(host, port)` joins it, loads and shards the model."""

    def __init__(self, rank: int, world_size: int, model_path: str, cfg: TrainerConfig):
        self.rank, self.world_size, self.cfg, self.model_path = rank, world_size, cfg, model_path
        self._store = None

    def rendezvous(self, local: bool = False) -> tuple[str, int]:
        """Rank 0: the process group's TCP store, listening on this node at a port the OS picks
        here (port 0: free on this node by construction, and held from now on, so no other
        process can take it between choosing and binding). Returns (its address, the port): what
        the other ranks connect to. `local` (a one-node cluster): on 127.0.0.1, else this node's
        IP. The socket is bound here and handed to the store: the store binds the wildcard address
        itself, whatever host it is given, and an unauthenticated store every session opened was
        reachable from the whole network (its keys are gloo's and NCCL's connection endpoints)."""
        import datetime
        import socket

        from torch.distributed import TCPStore

        host = "127.0.0.1" if local else ray.util.get_node_ip_address()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(self.world_size + 8)
            port = listener.getsockname()[1]
        except BaseException:
            listener.close()
            raise
        self._store = TCPStore(host, port, self.world_size, is_master=True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S), master_listen_fd=listener.detach())
        return host, port

    def node(self) -> dict:
        """Where this rank runs: Ray node id and IP, and the process group's backend."""
        import torch.distributed as dist

        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "backend": dist.get_backend() if dist.is_initialized() else None}

    def setup(self, host: str, port: int) -> int:
        """Join the process group at rank 0's store (NCCL on GPUs, gloo on CPU), then load the
        model and shard it."""
        import datetime

        import torch.distributed as dist
        from torch.distributed import TCPStore

        rank, world_size, cfg, model_path = self.rank, self.world_size, self.cfg, self.model_path
        torch.manual_seed(cfg.seed)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
            torch.cuda.set_device(self.device)
            # offloaded parameters and gradients are CPU DTensors: their collectives (clip_grad_norm_'s
            # all-reduce, the state-dict gathers) need a CPU backend beside NCCL
            backend = "cpu:gloo,cuda:nccl" if cfg.cpu_offload else "nccl"
            if cfg.cpu_offload:  # the optimizer steps on the host: this rank's share of the node's cores
                # (Ray gives a num_cpus=0 actor OMP_NUM_THREADS=1: AdamW over a rank's billions of
                # offloaded parameters ran on one core)
                torch.set_num_threads(host_threads_per_gpu())
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            backend = "gloo"
        timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
        store = self._store if rank == 0 else TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        reshard = cfg.reshard_after_forward
        if reshard is None and world_size == 1:  # one rank: see TrainerConfig.reshard_after_forward
            reshard = False
        shard_kwargs = {"reshard_after_forward": reshard}
        if cfg.mixed_precision:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            shard_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.mixed_precision),
                                                             reduce_dtype=torch.float32)
        if cfg.cpu_offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            shard_kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        self.checkpoint_bytes_read = 0
        self.model = self._sharded_model(model_path, shard_kwargs, cfg.activation_checkpointing, cfg.dtype)
        self.ref_model = None
        if cfg.kl_coef > 0:  # frozen, sharded the same way, never in the optimizer
            self.ref_model = self._sharded_model(cfg.ref_model_path or model_path, shard_kwargs, False,
                                                 cfg.ref_dtype or cfg.mixed_precision or cfg.dtype)
            self.ref_model.requires_grad_(False)
        # the reference replays the sampled experts only where it routes as the policy does (its own
        # frozen copy); a dense reference or another MoE routes live (given the policy's experts it
        # raised at every step: no router, or another layer count)
        self.ref_replays = self.ref_model is not None and _routing_layout(self.ref_model) == _routing_layout(self.model)
        self.packing = None  # the packing check's result (pack_sequences=True)
        self.pack = cfg.pack_sequences  # what this rank's forwards do (off where the model mixes packed sequences)
        if cfg.pack_sequences:
            self._check_packing()
        # foreach: torch picks it by default only for CUDA tensors; on CPU each DTensor parameter was
        # updated one op at a time through DTensor's dispatch (toy MoE, 25 parameters: 10.5 ms a
        # step vs 2.6 ms foreach). On GPUs foreach is already the default.
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)
        return rank

    def _check_packing(self) -> None:
        """Packing is exact only where the model keeps packed sequences apart (packing_leak); where
        it does not, this rank's forwards pad instead (self.pack False; micro_batch_tokens then cuts
        rows by the batch's width: _micro), and `packing` says why. Every rank decides alike (the
        measures are all-reduced: the ranks' micro-batches run the same collectives). A KL reference
        of another checkpoint (ref_model_path: another architecture may mix them where the policy's
        does not) is checked too: its forwards are packed as the policy's are, and its log-probs, so
        the KL term and its gradient, were taken partly on another episode's context."""
        import torch.distributed as dist

        models = {"policy": self.model}
        if self.ref_model is not None and self.cfg.ref_model_path:  # (its own frozen copy packs as the policy does)
            models["reference"] = self.ref_model
        self.packing, self.pack = {}, True
        for name, model in models.items():
            measured = torch.tensor(packing_leak(model, model.config.get_text_config().vocab_size, self.device),
                                    device=self.device)
            dist.all_reduce(measured, op=dist.ReduceOp.MAX)
            self._reshard(model)
            leak, noise = measured.tolist()
            if name == "policy":
                self.packing.update(leak=leak, noise=noise)
            else:
                self.packing.update(reference_leak=leak, reference_noise=noise)
            if packing_mixes(leak, noise):
                self.pack, mixes = False, (name, model.config.model_type, leak, noise)
        self.packing["packed"] = self.pack
        if not self.pack and self.rank == 0:
            import sys

            name, model_type, leak, noise = mixes
            print(f"workbench: sequence packing is off for this model ({model_type}{', the KL reference' if name == 'reference' else ''}): a packed "
                  f"sequence's log-probs moved {leak:.3g} nats with the sequence before it (noise {noise:.3g}: its "
                  f"forward does not keep packed sequences apart); rows are padded instead"
                  + (f", micro_batch_tokens {self.cfg.micro_batch_tokens} cut as that many tokens of the batch's width"
                     if self.cfg.micro_batch_tokens else ""), file=sys.stderr)

    def _sharded_model(self, path: str, shard_kwargs: dict, checkpointing: bool, dtype: str):
        """The checkpoint's model in `dtype`, sharded with fully_shard in the units cfg.shard_unit
        says, loaded as cfg.load says ("full", "rank0" or "sharded"; trainer/loading.py)."""
        from torch.distributed.fsdp import fully_shard

        from ..toy.models import load_hf_model
        from .loading import load_from_rank0, load_own_shards, meta_model

        dtype = getattr(torch, dtype)
        if self.cfg.load == "full":
            model = load_hf_model(path, dtype=dtype).to(self.device)
        else:  # no weights anywhere yet: FSDP2 shards the empty parameters
            model = meta_model(path, dtype)
        dropped = no_dropout(model)
        if dropped and self.rank == 0:
            print(f"workbench: trainer: dropout and router noise off ({', '.join(dropped)}): the engine samples "
                  f"without them, and a noised forward made pi_old and every ratio noisy", file=sys.stderr)
        if checkpointing:
            # non-reentrant: the recompute runs inside backward, where routing_replay's hooks
            # still apply because train_step keeps the replay context open across backward
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if (self.cfg.shard_unit or ("model" if self.device.type == "cpu" else "layer")) == "layer":
            for layer in model.get_decoder().layers:  # (a multimodal wrapper's are its language model's)
                fully_shard(layer, **shard_kwargs)
        fully_shard(model, **shard_kwargs)
        if self.cfg.load != "full":
            # this rank's shards, uninitialised: in host memory when FSDP2 offloads them
            model.to_empty(device="cpu" if self.cfg.cpu_offload else self.device)
            if self.cfg.load == "rank0":
                load_from_rank0(model, path, dtype, self.rank)
            else:
                self.checkpoint_bytes_read += load_own_shards(model, path, dtype)
            if self.cfg.cpu_offload:
                # the loaders may hand back shards on the mesh's device (transformers' sharded read
                # did, on an H200: FSDP2 then refused to start, 'parameters should be materialized
                # on CPU'); an offloaded shard lives in host memory
                with torch.no_grad():
                    for module in model.modules():
                        for p in module._parameters.values():
                            if p is not None and p.device.type != "cpu":
                                p.data = p.data.to("cpu")
                        # buffers are no FSDP2 state: to_empty left them in host memory, where the forward
                        # read them beside the device's activations (DeepSeek-V3's, Kimi's and GLM-4.5's router
                        # bias, e_score_correction_bias: a device mismatch at connect's first forward)
                        for name, b in module._buffers.items():
                            if b is not None and b.device != self.device:
                                module._buffers[name] = b.to(self.device)
        return model.eval()

    def footprint(self) -> dict:
        """This rank's memory by what holds it, in bytes per device: the policy's parameter
        shards, its optimizer state (after a step), the reference's shards; their dtypes, the
        FSDP2 policies and units in force, and the checkpoint bytes this rank read (load="sharded")."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        def by_device(tensors) -> dict:
            out = {}
            for t in tensors:
                t = t.to_local() if isinstance(t, DTensor) else t
                out[str(t.device)] = out.get(str(t.device), 0) + t.numel() * t.element_size()
            return out

        group = self.model._get_fsdp_state()._fsdp_param_group
        # AdamW moments (its step counters are scalars kept on the CPU in any case)
        state = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
        ref = list(self.ref_model.parameters()) if self.ref_model is not None else []
        return {"params": by_device(self.model.parameters()), "optimizer": by_device(state),
                "reference": by_device(ref), "param_dtypes": sorted({str(p.dtype) for p in self.model.parameters()}),
                "optimizer_dtypes": sorted({str(v.dtype) for v in state}),
                "reference_dtypes": sorted({str(p.dtype) for p in ref}),
                "compute_dtype": str(group.mp_policy.param_dtype), "offload": type(group.offload_policy).__name__,
                "fsdp_units": sum(isinstance(m, FSDPModule) for m in self.model.modules()),
                "checkpoint_bytes_read": self.checkpoint_bytes_read, "packing": self.packing}

    def _to(self, batch: dict) -> dict:
        """The batch on this rank's device, and its attention mask also on the host
        ("attention_mask_host"): micro-batch cuts and packing plans are made from it there, so
        a GPU step does not wait for the device to read them."""
        host = batch.get("attention_mask_host", batch["attention_mask"]).cpu()
        out = {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items() if k != "attention_mask_host"}
        return {**out, "attention_mask_host": host}

    def _micro(self, batch: dict):
        """The micro-batches of this rank's rows: micro_batch_size rows each, or (with
        micro_batch_tokens) at most that many real tokens each (a longer row alone), as many on every rank."""
        n, budget = batch["input_ids"].shape[0], self.cfg.micro_batch_tokens
        if budget is None or not self.pack:
            # padded rows cost the batch's width each: a token budget is that many rows (every rank
            # has the same width and rows, so as many micro-batches)
            rows = self.cfg.micro_batch_size if budget is None else max(1, budget // batch["input_ids"].shape[1])
            cuts = [range(s, min(s + rows, n)) for s in range(0, n, rows)]
        else:
            import torch.distributed as dist

            lengths = batch["attention_mask_host"].sum(1).tolist()
            count = torch.tensor([len(micro_batches_by_tokens(lengths, budget))], device=self.device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX)  # every rank runs as many forwards (collectives)
            cuts = micro_batches_by_tokens(lengths, budget, int(count))
        for r in cuts:
            yield {k: (v[r.start: r.stop] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    @staticmethod
    def _counted(mb):
        """Positions replay statistics count: real tokens of real rows (Trainer._split's padding
        rows are attended, to avoid NaN, but are neither replays nor fallbacks), but a row's last:
        its logits predict no token, and the engine never fed it (its record is -1): counted, it
        made replay_fallback at least rows x layers at every step, however complete the capture."""
        counted = (mb["attention_mask"] * mb["loss_mask"].any(-1, keepdim=True)).clone()
        last = counted.shape[-1] - 1 - counted.flip(-1).argmax(-1)  # (a row of none: its last column, 0 already)
        counted[torch.arange(counted.shape[0], device=counted.device), last] = 0
        return counted

    def logprobs(self, batch: dict, replay: bool | None = None) -> tuple[torch.Tensor, dict]:
        """Log-probs of this rank's rows (no grad), on CPU, and the replay statistics (summed
        ReplayStats fields, per MoE layer). `replay`: None follows the config."""
        batch = self._to(batch)
        replay = self.cfg.routing_replay if replay is None else replay
        out, stats = [], []
        self.model.eval()
        with torch.no_grad():
            for mb in self._micro(batch):
                lp, st = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], self.cfg.temperature,
                                        mb.get("routed_experts"), apply_replay=replay, positions=self._counted(mb),
                                        chunk_mb=self.cfg.logprob_chunk_mb, packed=self.pack,
                                        host_mask=mb["attention_mask_host"])
                out.append(lp.cpu())
                stats.append(st)
        self._reshard()
        return torch.cat(out), _sum_replay(stats)

    def _reshard(self, model=None) -> None:
        """After no-grad forwards: a unit kept gathered after its forward (reshard_after_forward
        False; the root by default) is resharded by FSDP2 after its backward only, so without
        one its full parameters would stay registered and allocated: the state dict, a checkpoint
        and memory expect the shards (the frozen reference has no backward at all). No
        collective: it frees the gathered copy."""
        from torch.distributed.fsdp import FSDPModule

        for m in (model or self.model).modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    def train_step(self, batch: dict, trainer_version: int, report: bool = False, live_routing: bool = False) -> dict:
        """`_train_step`, from zero gradients: a step that raised part-way (an OOM after some
        micro-batches' backward) left its gradients, which the next step's first update added to
        its own (another batch, an older version), and a checkpoint of an optimizer without state
        took them for a step and saved none (unloadable). One that raised after an optimizer update
        raises PartialUpdate: the weights moved, the driver moves the version with them."""
        self.optimizer.zero_grad(set_to_none=True)
        self._updates_applied = 0
        try:
            return self._train_step(batch, trainer_version, report, live_routing)
        except Exception as e:
            if self._updates_applied:
                raise PartialUpdate(f"trainer rank {self.rank} failed after {self._updates_applied} optimizer update(s) "
                                    f"of this step: {type(e).__name__}: {e}") from e
            raise
        finally:
            self.optimizer.zero_grad(set_to_none=True)

    def _train_step(self, batch: dict, trainer_version: int, report: bool = False, live_routing: bool = False) -> dict:
        """`updates_per_step` optimizer updates on this rank's rows (every rank runs this at
        once). `report`: also return per-token tensors of this step (the token-journey view).
        `live_routing`: also the no-grad forward with live routing for kl_k3_live (MoE with
        recorded experts; the driver decides for every rank at once: it has collectives).

        pi_old (the ratios' denominator) is the policy at the start of the step. With one update
        it is the gradient forward's own log-probs, detached: a separate no-grad forward would
        only repeat it (it cost a quarter of the step; bench/trainer.py). Correction weights are
        per row, so computing them per micro-batch gives the whole batch's."""
        import torch.distributed as dist

        batch = self._to(batch)
        live = None
        if live_routing and self.cfg.routing_replay and batch.get("routed_experts") is not None:
            # on the trained version's own tokens, as kl_k3_current (what it is read beside): over
            # stale tokens too, it added the policy's movement between versions, which replay does
            # not remove, and credited replay with it
            current = batch["loss_mask"] * (batch["versions"] == trainer_version)
            live = dict(zip(("sum", "tokens"), kl_k3_sum(self.logprobs(batch, replay=False)[0].to(self.device),
                                                         batch["behaviour_logprobs"], current)))
        updates = self.cfg.updates_per_step
        # an update's rows on this rank: Trainer._split's share of each run (the same batch rows in
        # each update whatever the rank count; every rank has as many rows, so runs as many updates),
        # or this rank's rows cut into `updates` runs (update_runs: one a row with fewer rows)
        n_rows, per = batch["input_ids"].shape[0], batch.get("rows_per_update")
        runs = [range(i, min(i + per, n_rows)) for i in range(0, n_rows, per)] if per else update_runs(n_rows, updates)
        if updates > 1:
            # pi_old per update, cut into the micro-batches its gradient forwards use: cut otherwise (the
            # whole rank's rows at once), packing put other rows side by side and bf16 rounding alone
            # moved a sequence's mean log-ratio by up to 1.6e-3, past GSPO's clip band (3e-4 / 4e-4):
            # which sequences got no gradient was decided by rounding
            batch["old_logprobs"] = torch.cat([self.logprobs({k: (v[r.start: r.stop] if isinstance(v, torch.Tensor) else v)
                                                              for k, v in batch.items()})[0] for r in runs]).to(self.device)
        surrogate = get_surrogate(self.cfg.surrogate)
        self.model.train()
        # the step's sums stay on the device (a float() per micro-batch would wait for the device
        # each time, draining its queue), read once after the last update is queued
        zero = torch.zeros((), device=self.device, dtype=torch.float64)
        loss_sum, norms, corr_parts, replay, rows, kl_sum, shift_sum = zero, [], [], [], [], zero, zero
        shift_tokens = zero  # the tokens of the updates after the first (whose ratios are all 1: it diluted the mean)
        skipped, carried_total = 0, torch.zeros_like(zero)
        updates = len(runs)
        for u, run in enumerate(runs):
            ub = {k: (v[run.start: run.stop] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
            # the mini-batch's trainable tokens and episodes over all ranks: what its means divide by
            counts = torch.stack([ub["loss_mask"].sum().double(), episode_units(ub["loss_mask"], ub.get("episode_tokens")).sum().double()])
            dist.all_reduce(counts)
            counts = counts.tolist()  # read once per update (micro-batches divide by these)
            carried = torch.zeros((), device=self.device, dtype=torch.float64)  # kept tokens with an advantage
            for mb in self._micro(ub):
                # the replay context spans backward: activation-checkpoint recompute must replay too
                counted = self._counted(mb)
                with replayed_logprobs(self.model, mb["input_ids"], mb["attention_mask"], self.cfg.temperature,
                                       mb.get("routed_experts"), apply_replay=self.cfg.routing_replay,
                                       positions=counted, chunk_mb=self.cfg.logprob_chunk_mb,
                                       packed=self.pack, host_mask=mb["attention_mask_host"],
                                       compare=counted * current_rows(mb, trainer_version) * (u == 0)) as (lp, rstats):
                    old = lp.detach() if updates == 1 else mb["old_logprobs"]
                    corr = correction_weights(old, mb["behaviour_logprobs"], mb["loss_mask"], mb["versions"],
                                              trainer_version, self.cfg.correction)
                    adv = mb["advantages"]
                    if mb.get("teacher_logprobs") is not None:
                        # a per-token estimator (distillation) on pi_old, the policy this step trains from:
                        # its gradient is then the reverse KL's own, E_pi[(log t - log pi) grad log pi], the
                        # IS weight correcting the sampling; on the behaviour log-probs it added
                        # grad KL(pi || behaviour), pushing the policy off every stale token's sampler
                        adv = mb["per_token_advantage"](AdvantageInput(
                            None, None, mb["loss_mask"], logprobs=old, teacher_logprobs=mb["teacher_logprobs"])).float()
                        adv = adv * mb["loss_mask"]
                    tl = surrogate(lp, old, adv, corr.weights, mb["loss_mask"].float(), **self.cfg.surrogate_kwargs)
                    if self.ref_model is not None:
                        ref = self._reference_logprobs(mb)
                        # importance-weighted as the surrogate is: the tokens were sampled by the behaviour
                        # policy, and k3's gradient is grad KL(ref || pi) only in expectation under pi. The
                        # weight pi / mu: the correction's weight (pi_old / mu, truncated, 0 where gated)
                        # times pi / pi_old (1 in a step's first update). Unweighted, the gradient was 30%
                        # off at KL(mu || pi) 0.02 and 101% at 0.18 (exact expectations, in review)
                        # (pi / pi_old truncated at KL_RATIO_CAP, as TIS truncates pi_old / mu: with several
                        # updates a token whose probability rose 100x weighed 100x, unclipped by PPO's clip)
                        kl_weight = corr.weights * torch.exp(lp.detach() - old).clamp(max=KL_RATIO_CAP)
                        tl = tl + self.cfg.kl_coef * kl_penalty(self.cfg.kl_estimator, lp, ref, mb["loss_mask"], kl_weight)
                        # the statistic: KL on every trainable token, the dropped ones too
                        kl_sum = kl_sum + kl_to_reference(self.cfg.kl_estimator, lp.detach(), ref, mb["loss_mask"]).sum()
                    # this rank's share of the mini-batch's loss; x world size because FSDP averages
                    # the ranks' gradients, where the loss is their sum
                    w = aggregation_weights(mb["loss_mask"], self.cfg.loss_aggregation, *counts,
                                            max_len=self.cfg.constant_len, episode_tokens=mb.get("episode_tokens"))
                    (tl * w).sum().mul(self.world_size).backward()
                    # trainable tokens the correction kept that have an advantage: the no-signal warning's count
                    carried = carried + (corr.token_keep & mb["loss_mask"].bool() & (adv != 0) & adv.isfinite()).sum()
                contribution = (tl * w).detach() / updates  # of the step's reported loss (mean over updates)
                if u > 0 or updates == 1:  # (device tensors: read with the step's other sums, once)
                    # (the first of several updates left out of both: its pi_old is another forward's,
                    # whose bf16 rounding alone read as a shift)
                    shift_sum = shift_sum + ((lp.detach() - old).abs() * mb["loss_mask"]).sum()
                    shift_tokens = shift_tokens + mb["loss_mask"].sum()
                loss_sum = loss_sum + contribution.sum()
                corr_parts.append(corr)
                replay.append(rstats)
                if report:
                    rows.append({"trainer_logprobs": old, "is_weight": corr.weights, "gate_keep": corr.token_keep,
                                 "loss_contribution": contribution, "advantages": adv})
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # the global norm: every rank's
            norms.append(norm)
            # A zero gradient (the gate dropped every row, every advantage 0, no KL term) is no update:
            # the backward left zero gradients, not None, and AdamW would still move every weight along
            # its momentum (0.67x the previous real step, in its direction) and decay it. Decided on the
            # norm, not a count, so that a custom surrogate's own gradient is never skipped (one wait
            # for the device per update, before its optimizer step: the norm is every rank's already)
            # A non-finite norm (a NaN or inf gradient: an inf log-prob, a NaN advantage) is no update
            # either: applied, it made every weight NaN while grad_norm read 0.0 (NaN > 0 is False)
            # and updates_skipped 0; skipped, grad_norm reads NaN and the weights stay as they were
            value = float(norm)
            if value == 0.0 or not math.isfinite(value):
                skipped += 1
            else:
                self._updates_applied += 1  # (counted begun: a step that raised part-way may have moved weights)
                self.optimizer.step()
                # (an update skipped trained none of its tokens: counted, they kept the no-signal warning quiet)
                carried_total = carried_total + carried
            self.optimizer.zero_grad(set_to_none=True)
        # (with cpu_offload the gradients, so their norms, are on the host)
        dist.all_reduce(carried_total)  # over the ranks, once a step
        sums = [loss_sum, kl_sum, shift_sum, shift_tokens, carried_total, *(n.double().to(self.device) for n in norms)]
        loss_sum, kl_sum, shift_sum, shift_tokens, carried_total, *norms = torch.stack(sums).tolist()
        # the step's grad_norm: the mean over the updates with a gradient (NaN if any was not finite)
        taken = [n for n in norms if n != 0]
        out = {"loss": loss_sum, "grad_norm": sum(taken) / len(taken) if taken else 0.0, "correction": merge_stats([c.stats for c in corr_parts]),
               "replay": _sum_replay(replay), "kl_k3_live": live,
               "kl_ref": {"sum": kl_sum, "tokens": int(batch["loss_mask"].sum())} if self.ref_model else None,
               # mean |log pi - log pi_old| over the tokens of the updates after the first: 0 with one
               # update per step; how far later updates' ratios move from 1 (where the surrogates'
               # clipping acts) otherwise
               "policy_shift": {"sum": shift_sum, "tokens": int(shift_tokens)},
               # over every rank (all-reduced): kept trainable tokens with an advantage, summed over the
               # updates (the no-signal warning's count; a KL term alone is no learning signal), and
               # the updates skipped for a zero or non-finite gradient
               "signal_tokens_trained": int(carried_total), "updates": updates, "updates_skipped": skipped}
        if report:
            out["report"] = {k: batch[k].cpu() for k in ("input_ids", "loss_mask", "behaviour_logprobs", "versions", "advantages")}
            out["report"].update({k: torch.cat([r[k] for r in rows]).cpu() for k in rows[0]})
            if batch.get("routed_experts") is not None:
                out["report"]["routed_experts"] = batch["routed_experts"].cpu()
        return out

    def _reference_logprobs(self, mb: dict) -> torch.Tensor:
        """The reference's log-probs of the micro-batch's tokens, for the KL penalty (routing
        replayed in the reference too: the same experts the tokens were sampled with)."""
        self.ref_model.eval()
        with torch.no_grad():
            ref, _ = token_logprobs(self.ref_model, mb["input_ids"], mb["attention_mask"], self.cfg.temperature,
                                    mb.get("routed_experts") if self.ref_replays else None, apply_replay=self.cfg.routing_replay,
                                    chunk_mb=self.cfg.logprob_chunk_mb, packed=self.pack,
                                    host_mask=mb["attention_mask_host"])
        self._reshard(self.ref_model)
        return ref

    def probe(self, ids: list[int]) -> list[float]:
        """log p(ids[i+1] | ids[:i+1]) at temperature 1, live routing: what a synced engine's
        probe must match (every rank must call: FSDP forwards are collectives)."""
        self.model.eval()
        with torch.no_grad():
            t = torch.tensor([ids], device=self.device)
            lp, _ = token_logprobs(self.model, t, torch.ones_like(t))
        self._reshard()
        return lp[0, 1:].cpu().tolist()

    def vocab_size(self) -> int:
        return self.model.config.get_text_config().vocab_size  # (a multimodal wrapper's config has none)

    def router_classes(self) -> list[str]:
        """The class names of the model's MoE routers (what replay looks its rules up by)."""
        from ..replay import moe_routers

        return sorted({type(r).__name__ for r in moe_routers(self.model)})

    def add_registries(self, replay_rules: dict, surrogates: dict, sequence_surrogates: set, kl_estimators: dict) -> None:
        """The driver's registered replay rules, surrogates and KL estimators, in this rank's process
        (see Trainer.__init__)."""
        from ..replay import REPLAY_RULES

        REPLAY_RULES.update(replay_rules)
        SURROGATES.update(surrogates)
        SEQUENCE_SURROGATES.update(sequence_surrogates)
        KL_ESTIMATORS.update(kl_estimators)

    # GPU weight sync by NCCL broadcast (rollout/nccl_sync.py); rank 0 joins the engines' group
    def nccl_endpoint(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def connect_nccl(self, cfg, world_size: int) -> None:
        from ..rollout.nccl_sync import TrainerSender

        self._tx = TrainerSender(cfg, world_size, self.rank)
        self._tx.connect()

    def weight_meta(self, wire: str | None) -> dict:
        """Names, dtypes and global shapes of the weights (nothing gathered)."""
        from ..rollout.nccl_sync import TransferMeta, checkpoint_tensors
        from .loading import kept_fp32

        keep = kept_fp32(self.model, getattr(torch, wire)) if wire else []
        # (global shapes on the meta device: what the checkpoint layout makes of them, nothing gathered)
        shapes = ((n, torch.empty(t.shape, dtype=t.dtype, device="meta")) for n, t in self.model.state_dict().items())
        return TransferMeta.from_tensors(checkpoint_tensors(self.model, shapes), wire, keep).update_info()

    def send_weights_nccl(self, meta: dict) -> int:
        """Every rank: gather one tensor at a time; rank 0 broadcasts it to the engines."""
        from ..rollout.nccl_sync import TransferMeta, full_tensors

        return self._tx.send(full_tensors(self.model), TransferMeta(**meta))

    def full_state_dict(self, wire: bool = False, dtypes: dict | None = None, cast: str | None = None):
        """HF-named full tensors on CPU, on rank 0 (every rank must call: it is a collective);
        `wire`: as WireWeights, the weight sync's form in Ray's object store; `dtypes`: each
        tensor cast to its dtype here, before it leaves the rank (an export's); `cast`: the
        engines' half dtype, every floating tensor but what the model keeps in fp32 (a sync's)."""
        from ..rollout.engine import WireWeights

        state = self.model.state_dict()
        # a tied weight (lm_head = embed_tokens) gathered once and sent once under both names: it was
        # gathered twice and put in the object store twice (SmolLM2's 113 MB embedding, tiny Qwen3's
        # 39 MB, at every sync). Decided from the model's parameters, the same on every rank
        tied = tied_names(self.model)
        full = gather_full_tensors({k: v for k, v in state.items() if k not in tied}, self.rank, self.world_size)
        if self.rank != 0:
            return None
        full = {k: full[tied.get(k, k)] for k in state}
        if dtypes:  # (cast per name, a tied weight became two copies, an export saved it twice)
            full = _once_per_tensor(full, lambda k, v: v.to(dtypes.get(k, v.dtype)))
        if cast:
            from ..rollout.nccl_sync import wire_dtype
            from .loading import kept_fp32

            keep = kept_fp32(self.model, getattr(torch, cast))
            full = _once_per_tensor(full, lambda k, v: v if any(p in k for p in keep) else v.to(wire_dtype(v.dtype, cast)))
        return WireWeights.of(full) if wire else full

    def save(self, path: str) -> None:
        """Sharded model + optimizer state with torch.distributed.checkpoint, and this rank's RNG."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.optimizer.zero_grad(set_to_none=True)  # (left by a failed step: read as a step taken, no state saved)
        fresh = not self.optimizer.state
        complete_optimizer_state(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        if fresh:  # get_state_dict made the optimizer's state with a zero-gradient step: AdamW's step
            # counter then read 1, and the first real update was 0.74x (bias-corrected at step 2),
            # here and in a run resumed from this checkpoint. Counters at 0 with zero moments are a
            # fresh AdamW's state
            for st in list(self.optimizer.state.values()) + list(optim_sd.get("state", {}).values()):
                if torch.is_tensor(st.get("step")):
                    st["step"].zero_()
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
        with open(os.path.join(path, f"rng_rank{self.rank}.pt"), "wb") as f:
            torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}, f)
            durable(f)

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        self.optimizer.zero_grad(set_to_none=True)  # (with gradients left, a fresh optimizer's state dict holds no
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)  # moments: a restore dropped them all)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        for group in self.optimizer.param_groups:  # the run's config, not the checkpoint's: a resume with a lower
            group["lr"], group["weight_decay"] = self.cfg.lr, self.cfg.weight_decay  # lr kept the old one, silently
        rng_file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if not os.path.isfile(rng_file):  # a checkpoint of fewer ranks: this rank keeps its seed
            return
        rng = torch.load(rng_file, weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def tied_names(model: torch.nn.Module) -> dict:
    """Each parameter name that is another's parameter (tied embeddings), to the first name of it."""
    first, tied = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied[name] = first[id(p)]
        else:
            first[id(p)] = name
    return tied


def gather_full_tensors(state: dict, rank: int, world_size: int) -> dict | None:
    """The full tensors of an FSDP2 state dict on CPU, on rank 0 (None elsewhere); every rank calls.

    Why not DTensor.full_tensor() per tensor: each call is its own collective behind DTensor's
    redistribute machinery, ~0.7 ms on gloo whatever the size; the toy MoE's 25 tensors (2.5 MB)
    took 17-19 ms that way on 2 ranks, one gather of every shard 2.1-2.4 ms (on 1 rank the local
    shard is the tensor: no collective at all). fully_shard splits dim 0 as torch.chunk does
    (rank r holds rows [r*c, min((r+1)*c, n)), c = ceil(n / world)), so each rank sends its shards
    padded to c rows, one buffer per dtype, and rank 0 cuts them apart. Tensors sharded any other
    way (a 2-D mesh, another dim) take full_tensor()."""
    import math

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    def flat_sharded(v) -> bool:
        return (isinstance(v, DTensor) and v.device_mesh.ndim == 1 and v.device_mesh.size() == world_size
                and tuple(v.placements) == (Shard(0),))

    if world_size > 1 and torch.cuda.is_available():
        # On GPUs one tensor at a time, each to the host as soon as it is whole: the bucketed gather
        # below holds world_size x the model on rank 0's device, then a second copy (fp32 Qwen3-8B:
        # 2 x 32.8 GB beside the shards and AdamW). NCCL's per-call cost is small; gloo's is not
        out = {}
        for k, v in state.items():
            t = (v.full_tensor() if isinstance(v, DTensor) else v).detach()
            if rank == 0:
                out[k] = t.cpu()
            del t
        return out if rank == 0 else None
    full, buckets = {}, {}  # dtype -> [(name, the DTensor, c: rows per full shard, elements per row)]
    for k, v in state.items():
        if flat_sharded(v) and world_size == 1:  # the one shard is the whole tensor
            full[k] = v.to_local().detach()
        elif flat_sharded(v):
            rows, c, row = v.shape[0], -(-v.shape[0] // world_size), math.prod(v.shape[1:])
            if v.to_local().shape[0] != max(0, min(c, rows - rank * c)):  # a guard, should FSDP2 ever split otherwise
                raise RuntimeError(f"{k}: rank {rank} holds {v.to_local().shape[0]} of {rows} rows, not torch.chunk's split")
            buckets.setdefault(v.dtype, []).append((k, v, c, row))
        else:
            full[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach()
    for dtype, items in buckets.items():
        flat = torch.zeros(sum(c * row for _, _, c, row in items), dtype=dtype, device=items[0][1].to_local().device)
        at = 0
        for _, v, c, row in items:
            local = v.to_local().detach().reshape(-1)
            flat[at:at + local.numel()] = local
            at += c * row
        parts = [torch.empty_like(flat) for _ in range(world_size)] if rank == 0 else None
        dist.gather(flat, parts, dst=0)
        if rank == 0:
            at = 0
            for k, v, c, row in items:
                pieces = [parts[r][at:at + max(0, min(c, v.shape[0] - r * c)) * row] for r in range(world_size)]
                full[k] = torch.cat(pieces).view(v.shape)
                at += c * row
    return {k: full[k].cpu() for k in state} if rank == 0 else None


def _get_all(refs: list) -> list:
    """ray.get of every ref, raising as soon as any fails: a rank that fails to load leaves the
    others waiting in the rendezvous, so waiting on them in order would hang until its timeout."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)
    return ray.get(refs)


class Trainer:
    """Driver-side handle over `world_size` TrainerWorker actors."""

    def __init__(self, model_path: str, world_size: int = 2, cfg: TrainerConfig | None = None, profile=None,
                 actor_options: list[dict] | None = None):
        """`actor_options`: per rank, Ray actor options that place it (workbench.placement's
        Placement.options("trainer", rank): its GPU and placement-group bundle); None: one GPU per
        rank where the cluster has GPUs, Ray chooses where.

        The ranks meet at rank 0: it opens the process group's store on its own node (its IP, a
        port free there), so ranks on other nodes can join; nothing of the driver's host is used.

        `profile` (workbench.profiles.ModelProfile; None: read off the checkpoint): an MoE
        profile that captures experts must name a router whose replay rule is registered, or
        routing replay could not reproduce the rollout's forward (refused here, not mid-run)."""
        from ..profiles import ProfileError, profile_for
        from ..replay import REPLAY_RULES

        if profile is None:  # a checkpoint no family claims still trains; replay then checks its routers itself
            try:
                profile = profile_for(model_path)
            except ProfileError:
                profile = None
        self.profile = profile
        if profile is not None and profile.capture_experts and profile.replay_rule not in REPLAY_RULES:
            raise ValueError(f"profile {profile.family!r} captures experts for routing replay, but its router rule "
                             f"{profile.replay_rule!r} is not registered (known: {sorted(REPLAY_RULES)}); register one "
                             f"with workbench.replay.register_replay_rule or set capture_experts=False in the profile")
        self.cfg = cfg or TrainerConfig()
        self.version = 0
        self.steps_done = 0  # train_step calls of this Trainer: the live-routing forward's cadence
        self.model_path = str(model_path)
        self.nccl = None  # NcclSyncConfig once init_nccl_sync ran (GPU weight sync)
        # the object-store sync's dtype (weights_and_probe): the engines' half dtype, where they hold one
        # and the trainer fp32 master weights (half the bytes in Ray's object store and each engine's
        # /dev/shm file; vLLM's loader casts to it anyway); None: the trainer's own
        self.sync_dtype: str | None = None
        self.nccl_broken: str | None = None  # why the NCCL group can sync no more (WeightSyncBroken)
        self.nccl_blocked = False  # rank 0 stuck in a failed broadcast: no rank answers any call
        self.stopped = False  # the group was stopped (a step failed on some ranks only: TrainerOutOfStep)
        from ..cluster import cluster_gpus

        if actor_options is not None and len(actor_options) != world_size:
            raise ValueError(f"actor_options has {len(actor_options)} entries for {world_size} ranks")
        # one GPU per rank where the cluster has GPUs (NCCL), none on CPU (gloo)
        gpus = cluster_gpus()
        default = {"num_cpus": 0, "num_gpus": 1 if gpus else 0}
        if self.cfg.keep_freed_memory and not gpus:
            default["runtime_env"] = {"env_vars": CPU_MALLOC_ENV}
        self.workers = [ray.remote(TrainerWorker).options(**{**default, **(actor_options[r] if actor_options else {})})
                        .remote(r, world_size, str(model_path), self.cfg) for r in range(world_size)]
        try:
            # one node: the store on its loopback (every rank is there); several: rank 0's node IP
            local = sum(1 for n in ray.nodes() if n.get("Alive")) <= 1
            self.rendezvous = tuple(ray.get(self.workers[0].rendezvous.remote(local)))
            _get_all([w.setup.remote(*self.rendezvous) for w in self.workers])
            # the registries as the driver holds them: a rank imports workbench.replay and the losses afresh,
            # so a replay rule or a surrogate registered in a notebook passed the checks here and the rank's
            # first step raised (after a whole rollout), and a sequence-level surrogate of the user's got
            # token_mean in the ranks (its length weighting, what GSPO's default aggregation avoids)
            # (the config's entries only: another registered one that cannot be pickled, or imported on a
            # rank's node, failed every Trainer's start)
            s, k = self.cfg.surrogate, self.cfg.kl_estimator
            _get_all([w.add_registries.remote(dict(REPLAY_RULES) if self.cfg.routing_replay else {}, {s: SURROGATES[s]},
                                              {s} & SEQUENCE_SURROGATES, {k: KL_ESTIMATORS[k]}) for w in self.workers])
            if profile is not None and profile.capture_experts and self.cfg.routing_replay:
                # the model's own routers, not the profile's name for their rule: replay looks a rule up by
                # the router's class, and a profile naming another (an override) failed the first step
                unknown = sorted(set(ray.get(self.workers[0].router_classes.remote())) - set(REPLAY_RULES))
                if unknown:
                    raise ValueError(f"routing replay has no rule for this model's router class(es) {unknown} (known: "
                                     f"{sorted(REPLAY_RULES)}): register one with workbench.replay.register_replay_rule, "
                                     f"or set capture_experts=False in the profile")
        except BaseException:
            for w in self.workers:
                ray.kill(w)
            raise

    def nodes(self) -> list[dict]:
        """Per rank: its Ray node id, IP and process-group backend."""
        return ray.get([w.node.remote() for w in self.workers])

    def _split(self, batch: dict, updates: int = 1) -> tuple[list[dict], torch.Tensor]:
        """Rows split evenly over ranks, and where each went (`order`: the batch row of each row
        of the ranks' parts in turn, -1 for padding). Short ranks get all-masked padding rows, so
        every rank runs the same number of forwards (FSDP collectives would hang otherwise).
        With `updates` > 1, optimizer update u takes the batch's u-th run of rows (update_runs; of
        whole episodes where the rows name theirs, episode_runs),
        spread over the ranks whatever their number: each rank's part is its share of each
        update's rows in turn (a rank's contiguous rows cut into updates made each update's rows
        depend on the rank count, so a resume onto other ranks followed another SGD path). The
        price: each update's share is padded to as many rows on every rank, up to 2x the rows
        (16 rows, 8 ranks, 4 updates: 32), each a full forward and backward (a padding row must
        carry a gradient graph: one attended position left a rank's loss without one)."""
        n, w = batch["input_ids"].shape[0], len(self.workers)
        if updates <= 1:
            per = -(-n // w)
            shares = [list(range(r * per, min((r + 1) * per, n))) for r in range(w)]
        else:
            runs = episode_runs(batch.get("row_keys"), updates) or [list(r) for r in update_runs(n, updates)]
            per_rank = -(-max(len(r) for r in runs) // w)
            shares = [[i for run in runs for i in (run[r * per_rank:(r + 1) * per_rank] + [-1] * per_rank)[:per_rank]]
                      for r in range(w)]
        rows = max(len(x) for x in shares)
        order = torch.tensor([i for x in shares for i in x + [-1] * (rows - len(x))], dtype=torch.long)
        take = torch.where(order < 0, n, order)  # row n: the padding row
        parts = [{} for _ in range(w)]
        for k, v in batch.items():
            if not isinstance(v, torch.Tensor):
                if isinstance(v, str) or callable(v):  # of the whole batch (per_token_advantage): every rank's
                    for part in parts:
                        part[k] = v
                continue
            pad = torch.zeros((1, *v.shape[1:]), dtype=v.dtype)
            if k == "routed_experts":
                pad -= 1
            if k == "attention_mask":  # a fully masked row makes attention NaN, and NaN * 0 is NaN
                pad += 1
            rows_of = torch.cat([v, pad])[take]
            for r in range(w):
                parts[r][k] = rows_of[r * rows:(r + 1) * rows]
        if updates > 1:  # the update's share of this rank's rows (runs of it, padded alike)
            for part in parts:
                part["rows_per_update"] = per_rank
        return parts, order

    @staticmethod
    def _unsplit(parts: list[torch.Tensor], order: torch.Tensor) -> torch.Tensor:
        """The ranks' row outputs back in the batch's row order (padding rows dropped)."""
        rows = torch.cat(parts)
        out = torch.empty((int((order >= 0).sum()), *rows.shape[1:]), dtype=rows.dtype)
        out[order[order >= 0]] = rows[order >= 0]
        return out

    def logprobs(self, batch: dict, replay: bool | None = None, with_stats: bool = False):
        """Trainer log-probs of every row ([B, T]). `replay`: None follows the config; False routes
        live. `with_stats`: also return the replay statistics (per MoE layer; see replay_summary)."""
        parts, order = self._split(batch)
        outs = ray.get([wk.logprobs.remote(part, replay) for wk, part in zip(self.workers, parts)])
        lp = self._unsplit([o[0] for o in outs], order)
        return (lp, replay_summary([o[1] for o in outs])) if with_stats else lp

    def train_step(self, batch: dict, report: bool = False) -> dict:
        """One optimizer step on `batch` (see tokens.training_tensors, plus "advantages").
        Returns the step's statistics; with `report`, also per-token tensors of every row
        (trainer log-prob, IS weight, gate decision, advantage, loss contribution, ...)."""
        parts, order = self._split(batch, self.cfg.updates_per_step)
        every = int(self.cfg.measure_live_routing)
        live = bool(every) and self.steps_done % every == 0  # decided here once, for every rank
        # it is measured on the trained version's tokens: a step with none (async, every token one
        # version stale) has nothing to measure, and it read 0.0 beside kl_k3_current None
        versions, mask = batch.get("versions"), batch.get("loss_mask")
        if live and versions is not None and mask is not None:
            live = bool(((versions == self.version) & mask.bool()).any())
        self.steps_done += 1
        refs = [wk.train_step.remote(p, self.version, report, live) for wk, p in zip(self.workers, parts)]
        try:
            stats = ray.get(refs)
        except Exception as error:
            if not isinstance(error, ray.exceptions.RayActorError):  # (a dead rank: the loop's TrainerWatch says so)
                self._stop_if_out_of_step(refs, error)
            if isinstance(error, PartialUpdate):  # (Ray's error is an instance of the rank's) the weights moved: so does the version
                self.version += 1
            raise
        except (KeyboardInterrupt, SystemExit):
            # submitted, the ranks update whatever the driver does (Ctrl-C in ray.get): the version moves
            # with them. Left behind, the engines kept the old weights under the new weights' label
            # (a sync compares versions) and every token read one version fresher than it was. (A rank's
            # own error, an OOM before the optimizer step, updated nothing: the version stays.)
            self.version += 1
            raise
        trained = self.version
        # every update skipped (a zero or non-finite gradient: the gate dropped every row, every
        # advantage 0): the weights did not move, so neither does the version. Bumped, the engines
        # took a full sync of the same weights, and every token sampled before read one version
        # stale (at max_staleness 1 in a run of flat groups the gate dropped fresh samples)
        if stats[0]["updates_skipped"] < stats[0]["updates"]:
            self.version += 1
        out = {"version": self.version, "trained_version": trained, "loss": sum(s["loss"] for s in stats), "grad_norm": stats[0]["grad_norm"],
               "correction": merge_stats([s["correction"] for s in stats]),
               "replay": replay_summary([s["replay"] for s in stats]),
               "signal_tokens_trained": stats[0]["signal_tokens_trained"], "updates": stats[0]["updates"], "updates_skipped": stats[0]["updates_skipped"]}
        for key in ("kl_k3_live", "kl_ref", "policy_shift"):  # token-weighted over ranks
            vals = [s[key] for s in stats if s[key] is not None]
            tokens = sum(x["tokens"] for x in vals)
            out[key] = sum(x["sum"] for x in vals) / tokens if tokens else None  # (no tokens: nothing measured, not 0)
        if report:
            out["report"] = {k: self._unsplit([s["report"][k] for s in stats], order) for k in stats[0]["report"]}
        return out

    def probe(self, ids: list[int]) -> list[float]:
        return ray.get([w.probe.remote(ids) for w in self.workers])[0]

    @functools.cached_property
    def vocab_size(self) -> int:
        return ray.get(self.workers[0].vocab_size.remote())

    def state_dict(self) -> dict:
        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def weights_and_probe(self, ids: list[int]) -> tuple[Any, Any, list]:
        """References to rank 0's full state dict and to probe(ids), without waiting: both are
        collectives, queued on every rank in the same order, the gather first, so that an engine
        can load the weights while the ranks compute the probe (loop.sync_engines). The weights
        stay in Ray's object store, where the engines read them; the driver never copies them
        (the CPU weight sync). The third item holds every rank's part of both but rank 0's weights:
        ray.get it for the ranks' errors (rank 0's gather fails the engines reading its weights; with
        it in, the driver fetched the whole model at every sync, over the network from another node)."""
        weights = [w.full_state_dict.remote(True, None, self.sync_dtype) for w in self.workers]
        probes = [w.probe.remote(ids) for w in self.workers]
        return weights[0], probes[0], weights[1:] + probes

    def footprint(self) -> list[dict]:
        """Per rank: the bytes its parameter shards, optimizer state and reference hold, by
        device, with their dtypes and the FSDP2 policies in force (TrainerWorker.footprint)."""
        return ray.get([w.footprint.remote() for w in self.workers])

    def init_nccl_sync(self, engines: list, engine_world_sizes: list[int] | None = None, **cfg_kwargs) -> None:
        """GPU: one NCCL group of trainer rank 0 and every engine worker (engines started with
        weight_transfer="nccl"). Afterwards loop.sync_engines uses sync_weights_nccl.
        `engine_world_sizes`: each engine's workers (None: asked of each, its info()["workers"]; read
        as 1 each, a tensor-parallel engine's workers took ranks of the next engine's: a hung rendezvous)."""
        from ..rollout.nccl_sync import NcclSyncConfig, group_layout

        host, port = ray.get(self.workers[0].nccl_endpoint.remote())
        cfg = NcclSyncConfig(master_port=port, master_address=host, **cfg_kwargs)
        if engine_world_sizes is None:
            engine_world_sizes = [int(i.get("workers", 1)) for i in ray.get([e.info.remote() for e in engines])]
        offsets, world = group_layout(engine_world_sizes)
        # both sides meet in the same rendezvous: launch them together, then wait for all
        ray.get([w.connect_nccl.remote(cfg, world) for w in self.workers]
                + [e.init_nccl.remote(cfg, off, world) for e, off in zip(engines, offsets)])
        self.nccl = cfg
        self._nccl_engines = list(engines)  # the group's members: a broadcast needs every one of them

    def _stop_if_out_of_step(self, refs: list, error: BaseException) -> None:
        """A step raised on some rank: where every rank raised too (within RANKS_AGREE_S) the group is in
        step and the error is the caller's; where a rank went on (waiting in a collective the failed rank
        never entered) or finished, the next call's collectives would pair with this one's (an update
        from two batches' gradients, then a hang until the collective timeout and a process group no
        save could use): the group is stopped and TrainerOutOfStep raised."""
        done, pending = ray.wait(refs, num_returns=len(refs), timeout=RANKS_AGREE_S)
        went_on = list(pending)
        for ref in done:
            try:
                ray.get(ref)
                went_on.append(ref)
            except Exception:
                pass
        if not went_on:
            return
        self.stopped = True
        for w in self.workers:  # the whole group (a rank waiting in a collective would wait out its timeout)
            with contextlib.suppress(Exception):
                ray.kill(w, no_restart=True)
        ranks = [i for i, r in enumerate(refs) if r not in went_on]
        raise TrainerOutOfStep(
            f"trainer rank(s) {ranks} of {len(refs)} failed a train step that the other ranks did not (their collectives "
            f"would pair with the next step's): the trainer group was stopped. What was recorded stays recorded; resume "
            f"from the last checkpoint (a session: workbench.connect(run_dir=..., resume=True)). Cause: "
            f"{(str(error).strip().splitlines() or ['?'])[-1][:400]}") from error  # (its last line: a Ray error's is the rank's)

    def sync_weights_nccl(self, engines: list, version: int, expected_probe=None, tol: float = 1e-3) -> list:
        """Broadcast the weights to the engines (each pauses, receives, bumps its version, resumes
        and checks its probe). The names are checked here first: a refusal inside an engine
        would leave trainer rank 0 blocked in a broadcast, and NCCL has no timeout."""
        from ..rollout.nccl_sync import TransferMeta, check_meta, hf_meta, plan_buckets

        # A member missing or dead: the broadcast would wait for it for ever (rank 0 stuck inside it, the
        # live engines paused in theirs, the next sync or probe queued behind rank 0). Refused before
        # any NCCL call; a failure once it started breaks the group (the session says so).
        if self.nccl_broken:
            raise WeightSyncBroken(self.nccl_broken, self.nccl_blocked)
        if [e._actor_id for e in engines] != [e._actor_id for e in self._nccl_engines]:
            self.nccl_broken = (f"the NCCL weight-sync group was made with {len(self._nccl_engines)} engine(s) and "
                                f"{len(engines)} of them are left: an NCCL group cannot lose a member")
            raise WeightSyncBroken(self.nccl_broken)
        from ..rollout.router import engine_info

        refs = [e.info.remote() for e in engines]
        try:
            for engine, ref in zip(engines, refs):
                engine_info(engine, ref, timeout=60)  # (unavailable: asked again first, a blip between nodes)
        except (ray.exceptions.ActorUnavailableError, ray.exceptions.GetTimeoutError) as e:
            # no NCCL call was made: the group is whole, and the next sync tries again (marked broken,
            # one blip between nodes ended every later sync of the session)
            raise RuntimeError(f"an engine of the NCCL weight-sync group did not answer before the broadcast "
                               f"({type(e).__name__}: {e}); nothing was sent: sync again") from e
        except Exception as e:
            self.nccl_broken = f"an engine of the NCCL weight-sync group did not answer before the broadcast: {type(e).__name__}: {e}"
            raise WeightSyncBroken(self.nccl_broken) from e
        meta = ray.get(self.workers[0].weight_meta.remote(self.nccl.wire_dtype))
        check_meta(TransferMeta(**meta), hf_meta(self.model_path))
        if self.nccl.packed:
            plan_buckets(TransferMeta(**meta), self.nccl.bucket_bytes)
        receive = [e.update_weights_nccl.remote(meta, version, expected_probe, None, tol) for e in engines]
        send = [w.send_weights_nccl.remote(meta) for w in self.workers]
        # the first failure on either side is raised as it happens: waiting on the senders first hung
        # for ever when an engine failed before joining the broadcast (rank 0 stays blocked in it;
        # the error at least says why)
        try:
            return _get_all(receive + send)[:len(receive)]
        except Exception as e:
            # the broadcast went through (an engine's probe refused after it: the group holds, the error is
            # the engine's own) only where every send returned, and returned no error (a rank's own failure
            # part-way left the engines inside the broadcast). A few seconds for the senders' replies: a
            # probe's error can reach the driver first
            finished, _ = ray.wait(send, num_returns=len(send), timeout=5)
            try:
                sent = len(finished) == len(send) and ray.get(send) is not None
            except Exception:
                sent = False
            if sent:
                raise
            self.nccl_broken, self.nccl_blocked = f"an NCCL weight sync failed part-way: {type(e).__name__}: {e}", True
            raise WeightSyncBroken(self.nccl_broken, blocked=True) from e

    def export_hf(self, path: str, dtype: str | None = None) -> str:
        """The trained policy as a Hugging Face checkpoint directory: safetensors in the source
        checkpoint's layout (transformers writes fused MoE experts back per expert), config,
        generation config, and the source's tokenizer and chat-template files. Loadable by
        transformers and vLLM. `dtype`: the weights' dtype on disk (default: the trainer's;
        "bfloat16" halves an fp32 trainer's export). Every rank takes part (a gather)."""
        import shutil

        from transformers import AutoConfig, GenerationConfig

        from .loading import meta_model

        dtype = getattr(torch, dtype or self.cfg.dtype)
        config = AutoConfig.from_pretrained(self.model_path)
        # the weights written are dense: a quantized source's quantization_config (gpt-oss's mxfp4)
        # would send loaders looking for its blocks and scales
        if getattr(config, "quantization_config", None) is not None:
            del config.quantization_config
        model = meta_model(self.model_path, dtype, config)  # (no second copy: the gathered tensors are assigned)
        # the dtype of each parameter as the model keeps it (DeepSeek-V3's router bias stays fp32: a bf16
        # export rounded it, and with it which experts every token routes to)
        kept = {k: t.dtype for k, t in model.state_dict().items()}
        # rank 0's gathered, HF-named tensors on CPU, cast there: an fp32 trainer's bf16 export crossed
        # Ray's object store (and a Ray client's connection) in fp32, twice its bytes, into the driver
        full = ray.get([w.full_state_dict.remote(False, kept) for w in self.workers])[0]
        model.load_state_dict({k: v.to(kept.get(k, dtype)) for k, v in full.items()}, strict=True, assign=True)
        if os.path.isfile(os.path.join(self.model_path, "generation_config.json")):
            # the source's (its eos list: Qwen3's <|endoftext|> besides <|im_end|>, sampling defaults);
            # one derived from config.json lost them, and every session started from the export with them
            model.generation_config = GenerationConfig.from_pretrained(self.model_path)
        os.makedirs(path, exist_ok=True)
        model.save_pretrained(path, safe_serialization=True)
        # (the source's weight indexes and workbench's own marks describe other weights: a kept policy's
        # copied mark claimed its step, version and probe for the export)
        skip = ("config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json",
                "workbench_policy.json", "workbench_export.json")
        for name in os.listdir(self.model_path):  # tokenizer, chat template, special tokens, ...
            src = os.path.join(self.model_path, name)
            if os.path.isfile(src) and name not in skip and not name.endswith((".safetensors", ".bin", ".pt", ".pth")):
                shutil.copy2(src, os.path.join(path, name))
        return path

    def save(self, path: str, run_state: dict | None = None) -> str:
        """Checkpoint to `path` (a directory every rank can reach): sharded weights and optimizer
        (torch.distributed.checkpoint), per-rank RNG, and run_state.json (the trainer version
        plus whatever the caller passes: step, data position, ...)."""
        import json

        os.makedirs(path, exist_ok=True)
        ray.get([w.save.remote(path) for w in self.workers])
        with open(os.path.join(path, "run_state.json"), "w") as f:
            json.dump({**(run_state or {}), "version": self.version, "world_size": len(self.workers)}, f)
            durable(f)
        for d in (os.path.join(path, "dcp"), path):  # their entries (DCP syncs its files, not its directory)
            durable_dir(d)
        return path

    @staticmethod
    def run_state(path: str) -> dict:
        """A checkpoint's run_state.json (FileNotFoundError: none there), read before any rank loads."""
        import json

        state_file = os.path.join(path, "run_state.json")
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"no checkpoint at {path!r} (run_state.json missing)")
        with open(state_file) as f:
            return json.load(f)

    def restore(self, path: str) -> dict:
        """Load a checkpoint written by save(); returns its run_state."""
        run_state = self.run_state(path)
        # torch.distributed.checkpoint reshards on load: a checkpoint of N ranks restores onto M
        # (each rank reads the pieces of the saved shards that make up its own); only the per-rank
        # RNG states do not carry over (load says which ranks kept their seed)
        ray.get([w.load.remote(path) for w in self.workers])
        self.version = run_state["version"]
        return run_state

    def shutdown(self) -> None:
        try:
            if not self.nccl_blocked and not self.stopped:  # (rank 0 stuck in a broadcast: its call would wait 60 s in vain;
                # a group stopped out of step: killed already)
                ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        finally:
            for w in self.workers:
                ray.kill(w)
