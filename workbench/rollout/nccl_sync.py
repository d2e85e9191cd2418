"""GPU weight sync: trainer rank 0 broadcasts full tensors to the vLLM workers over NCCL, into
vLLM 0.32's own weight-transfer engine (engine arg `weight_transfer_config={"backend": "nccl"}`).

One NCCL group: trainer rank 0 is rank 0, the engines' workers follow (`group_layout`). Each
step runs on both sides at once (they meet inside the same NCCL calls):
    init:  engines `NcclReceiver.init()`             ||  trainer `TrainerSender.connect()`
    sync:  engines pause -> `receive_update(meta)`   ||  every trainer rank `send(full_tensors(model), meta)`
           -> reset prefix cache -> resume -> probe check (as on the CPU file path)
The metadata goes to the engines first (through Ray): vLLM sizes its receive buffers and cuts its
packed chunks from it, and `plan_buckets` cuts the same chunks on the sending side.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Iterable, Iterator

import torch

from .engine import WeightsNotLoaded

CPU_PATH = ("On CPU use the file path instead: RolloutEngine.update_weights(state_dict) / "
            "rollout.actor.sync_weights(engines, trainer.state_dict()) (safetensors in /dev/shm, "
            "loaded by vllm_engine.WorkerExtension.load_weights_file).")
WIRE_DTYPES = (None, "float32", "bfloat16", "float16")


def require_cuda(side: str, available: bool) -> None:
    if not available:
        raise RuntimeError(f"NCCL weight sync needs CUDA GPUs, and the {side} has none. {CPU_PATH}")


def _is_int(v, lo: int, hi: float = math.inf) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi


@dataclass
class NcclSyncConfig:
    master_port: int  # a free port on trainer rank 0's host, which serves the rendezvous store
    master_address: str = "127.0.0.1"  # trainer rank 0's address, as the engines reach it
    packed: bool = True  # a few large broadcasts instead of one per tensor (hundreds of launches)
    # 256 MiB rather than vLLM's 1 GiB: each engine allocates it beside its KV cache and the trainer
    # holds a bucket of gathered tensors plus its packed copy; NCCL is at full speed far below that.
    bucket_bytes: int = 256 << 20
    # None sends the trainer's dtype. "bfloat16" halves the bytes when the trainer keeps fp32 weights
    # for a bf16 engine (vLLM's loader casts anyway); keep None if the engine holds fp32 parameters.
    wire_dtype: str | None = None

    def __post_init__(self):
        if not isinstance(self.master_address, str) or not self.master_address.strip():
            raise ValueError(f"master_address must be a host name or IP, got {self.master_address!r}")
        if not _is_int(self.master_port, 1, 65535):
            raise ValueError(f"master_port must be an int in 1..65535 (a free port on trainer rank 0's host, "
                             f"e.g. workbench.trainer.fsdp.free_port()), got {self.master_port!r}")
        if not _is_int(self.bucket_bytes, 1):
            raise ValueError(f"bucket_bytes must be a positive int, got {self.bucket_bytes!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be one of {WIRE_DTYPES}, got {self.wire_dtype!r}")

    def worker_init_info(self, rank_offset: int, world_size: int) -> dict:
        """vLLM's NCCLWeightTransferInitInfo: the packing is fixed at init, for both sides."""
        return dict(master_address=self.master_address, master_port=self.master_port, rank_offset=rank_offset,
                    world_size=world_size, packed=self.packed, packed_buffer_size_bytes=self.bucket_bytes)


def group_layout(engine_world_sizes: list[int]) -> tuple[list[int], int]:
    """Each engine's rank offset (its workers hold offset .. offset + size - 1) and the group size."""
    if not engine_world_sizes or not all(_is_int(n, 1) for n in engine_world_sizes):
        raise ValueError(f"need one positive worker count (TP x PP x DP) per engine, got {engine_world_sizes!r}")
    return [1 + sum(engine_world_sizes[:i]) for i in range(len(engine_world_sizes))], 1 + sum(engine_world_sizes)


def wire_dtype(dtype: torch.dtype, wire: str | None) -> torch.dtype:
    return getattr(torch, wire) if wire and dtype.is_floating_point else dtype  # ints are never cast


@dataclass
class TransferMeta:
    """What the engines must know before the bytes arrive (vLLM's NCCLWeightTransferUpdateInfo)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self):
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"metadata lengths differ: {len(self.names)} names, {len(self.dtype_names)} dtypes, "
                             f"{len(self.shapes)} shapes")
        if len(set(self.names)) != len(self.names):
            raise ValueError("duplicate parameter names in the metadata")
        if bad := [d for d in self.dtype_names if not isinstance(getattr(torch, d, None), torch.dtype)]:
            raise ValueError(f"unknown dtype names {bad}")

    @classmethod
    def from_tensors(cls, named: Iterable[tuple[str, torch.Tensor]], wire: str | None = None,
                     keep: Iterable[str] = ()) -> "TransferMeta":
        """Reads .dtype/.shape only (an FSDP DTensor reports its global shape): nothing is gathered.
        `keep`: name patterns sent in their own dtype whatever the wire's (what the model keeps in
        fp32: rounded to bf16 on every sync, DeepSeek-V3's router bias moved which experts route)."""
        keep = list(keep)
        rows = [(n, str(t.dtype if any(k in n for k in keep) else wire_dtype(t.dtype, wire)).removeprefix("torch."),
                 list(t.shape)) for n, t in named]
        return cls(*map(list, zip(*rows))) if rows else cls([], [], [])

    def update_info(self) -> dict:
        return asdict(self)

    def nbytes(self) -> list[int]:
        return [math.prod(s) * getattr(torch, d).itemsize for d, s in zip(self.dtype_names, self.shapes)]


def plan_buckets(meta: TransferMeta, bucket_bytes: int) -> list[list[int]]:
    """Indices per packed broadcast, cut as vLLM's consumer cuts them: a bucket closes right after
    the tensor that takes it *over* bucket_bytes. Refuses a tensor whose byte offset in its bucket
    is not a multiple of its element size: vLLM 0.32's unpack views the bytes in place and raises
    there (vllm PR #57665), on every engine, after the broadcast has begun."""
    buckets, cur, size = [], [], 0
    for i, n in enumerate(meta.nbytes()):
        if size % (item := getattr(torch, meta.dtype_names[i]).itemsize):
            raise ValueError(f"packed transfer: {meta.names[i]!r} ({meta.dtype_names[i]}) would start at byte {size} "
                             f"of its bucket, not a multiple of {item}, which vLLM cannot unpack; use packed=False")
        cur, size = cur + [i], size + n
        if size > bucket_bytes:
            buckets, cur, size = buckets + [cur], [], 0
    return buckets + [cur] if cur else buckets


def check_meta(sent: TransferMeta, expected: TransferMeta) -> None:
    """Names and shapes must be the engine model's HF names (dtypes may differ: the loader casts).
    An unknown name fails deep in vLLM's loader and a missing one silently keeps its old weights;
    refuse both before any NCCL call, while failing is still clean."""
    got, want = dict(zip(sent.names, sent.shapes)), dict(zip(expected.names, expected.shapes))
    missing, extra = [n for n in want if n not in got], [n for n in got if n not in want]
    shapes = [f"{n} {got[n]} != {want[n]}" for n in want if n in got and list(got[n]) != list(want[n])]
    if missing or extra or shapes:
        raise WeightsNotLoaded(f"weights do not match the engine's model (nothing loaded): missing {missing[:5]} ({len(missing)}), "
                         f"unexpected {extra[:5]} ({len(extra)}), shape mismatches {shapes[:5]} "
                         "(a wrapper prefix such as '_orig_mod.' or 'module.' shows as both)")


@functools.lru_cache(maxsize=4)
def hf_meta(model_path: str) -> TransferMeta:
    """The engine's expectation: its model's checkpoint names and shapes (vLLM's loaders read the
    checkpoint's layout), from its HF model built on the meta device. Once per checkpoint: every
    NCCL sync checks against it (a 30B MoE's meta model and its ~18k expert names, each sync)."""
    return model_meta(_meta_model(model_path))


def model_meta(model: torch.nn.Module) -> TransferMeta:
    """A (meta-device) HF model's tensors' names and shapes in the checkpoint layout vLLM's loaders
    read: what a sync must send, checked by check_meta (here and in the engine's worker)."""
    return TransferMeta.from_tensors(checkpoint_tensors(model, model.state_dict().items()))


@functools.lru_cache(maxsize=4)
def _meta_model(model_path: str):
    from transformers import AutoConfig

    from ..toy.models import meta_hf_model

    return meta_hf_model(AutoConfig.from_pretrained(model_path))


def sent_meta(model_path: str, state_dict: dict) -> TransferMeta:
    """The names and shapes of HF-named tensors (as transformers holds them) in the checkpoint
    layout the engine reads: what check_meta compares with hf_meta(model_path)."""
    return TransferMeta.from_tensors(checkpoint_tensors(_meta_model(model_path), state_dict.items()))


def checkpoint_tensors(model: torch.nn.Module, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) as transformers holds them -> as the checkpoint files hold them, one at a time
    (a fused expert tensor becomes its per-expert ones; Mixtral's `mlp` is `block_sparse_moe`
    again): vLLM loads checkpoint names, and refused Mixtral's in-memory ones after its layerwise
    reload had begun (on NCCL, with the trainer's rank 0 blocked in the broadcast)."""
    from ..toy.models import checkpoint_format

    for name, t in named:
        yield from checkpoint_format(model, {name: t}).items()


# ---- engine side: in the process that owns the AsyncLLM ----
def engine_kwargs() -> dict:
    """Extra AsyncEngineArgs: each vLLM worker then creates its NCCL weight-transfer engine."""
    return {"weight_transfer_config": {"backend": "nccl"}}


def _engine_has_gpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cuda_alike()


class NcclReceiver:
    def __init__(self, llm, cfg: NcclSyncConfig, rank_offset: int, world_size: int, expected: TransferMeta | None = None):
        self.llm, self.cfg, self.rank_offset, self.world_size, self.expected = llm, cfg, rank_offset, world_size, expected

    async def init(self) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        require_cuda("rollout engine", _engine_has_gpu())
        info = self.cfg.worker_init_info(self.rank_offset, self.world_size)
        await self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info))

    async def receive_update(self, names, dtypes, shapes, version: int) -> None:
        """Call with generation paused; returns when the trainer's broadcast is loaded."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        meta = TransferMeta(list(names), list(dtypes), [list(s) for s in shapes])
        if self.expected is not None:
            check_meta(meta, self.expected)
        if self.cfg.packed:
            plan_buckets(meta, self.cfg.bucket_bytes)  # the sender refuses the same layouts
        await self.llm.start_weight_update()  # vLLM's layerwise reload of checkpoint-format names
        await self.llm.update_weights(WeightTransferUpdateRequest(update_info=meta.update_info()))
        await self.llm.finish_weight_update(str(version))  # also the version new tokens record

    async def close(self) -> None:
        await self.llm.shutdown_weight_transfer_engine()


# ---- trainer side ----
def full_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-named full tensors gathered one at a time (a collective: every rank iterates in
    step), so rank 0 holds one gathered parameter (one bucket while packing), never a second model
    copy."""
    gathered = ((name, (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()) for name, t in model.state_dict().items())
    yield from checkpoint_tensors(model, gathered)


class TrainerSender:
    """`group`: anything with `broadcast(tensor, src)`; by default vLLM's PyNcclCommunicator."""

    def __init__(self, cfg: NcclSyncConfig, world_size: int, rank: int = 0, group=None):
        self.cfg, self.world_size, self.rank, self.group = cfg, world_size, rank, group

    def connect(self) -> None:
        if self.rank != 0 or self.group is not None:
            return  # only trainer rank 0 joins the transfer group
        require_cuda("trainer", torch.cuda.is_available())
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init(dict(master_address=self.cfg.master_address, master_port=self.cfg.master_port,
                                       world_size=self.world_size))

    def send(self, named: Iterable[tuple[str, torch.Tensor]], meta: TransferMeta) -> int:
        """Broadcast in `meta` order (call on every trainer rank); returns the bytes sent."""
        it = iter(named)
        if self.rank != 0:
            for _ in it:  # run the FSDP gathers rank 0 waits on
                pass
            return 0
        if self.group is None:
            raise RuntimeError("TrainerSender.send before connect()")
        packed, sent = self.cfg.packed, 0
        for bucket in plan_buckets(meta, self.cfg.bucket_bytes) if packed else [[i] for i in range(len(meta.names))]:
            parts = []
            for i in bucket:
                name, t = next(it, (None, None))
                if name != meta.names[i] or list(t.shape) != list(meta.shapes[i]):
                    raise RuntimeError(f"tensor #{i} is {name!r} {None if t is None else list(t.shape)}, the engines "
                                       f"expect {meta.names[i]!r} {meta.shapes[i]}; the transfer group is now unusable")
                if torch.cuda.is_available():  # an offloaded (cpu_offload) parameter gathers on the host:
                    t = t.to("cuda")  # to the GPU first, then cast there
                t = t.to(getattr(torch, meta.dtype_names[i])).contiguous()  # NCCL reads numel from data_ptr
                parts.append(t.view(-1).view(torch.uint8) if packed else t)
            buf = torch.cat(parts) if packed else parts[0]
            self.group.broadcast(buf, src=0)
            sent += buf.numel() * buf.element_size()
        if next(it, None) is not None:
            raise RuntimeError(f"more tensors than the {len(meta.names)} announced to the engines")
        if torch.cuda.is_available():  # broadcasts are only enqueued; the weights may change after return
            torch.cuda.current_stream().synchronize()
        return sent
