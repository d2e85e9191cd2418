"""The NCCL weight-sync path's CPU-testable parts (workbench/rollout/nccl_sync.py): config, metadata,
bucketing, name checks, the refusal without CUDA, and the wire format end to end: our sender over
gloo (trainer rank 0 + two engine workers, threads) into vLLM's own NCCLWeightTransferEngine
receive code, with only its CUDA stream calls stubbed. No engine start; Ray only for the group's member guard."""

from __future__ import annotations

import asyncio
import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from workbench.rollout import nccl_sync as ns
from workbench.rollout.nccl_sync import NcclReceiver, NcclSyncConfig, TrainerSender, TransferMeta


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        # sizes keep every tensor aligned inside its packed bucket (see test_misaligned_packing_is_refused)
        "model.embed_tokens.weight": torch.randn(36, 5, generator=g),
        "model.norm.weight": torch.randn(300, generator=g).to(torch.bfloat16),
        "counts": torch.randint(-9, 9, (4, 4), generator=g),  # ints are never cast
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
        "big": torch.randn(2000, generator=g),  # 8000 bytes: alone bigger than a 4096-byte bucket
        "lm_head.weight": torch.randn(3, 7, generator=g).to(torch.float16),
    }


@pytest.mark.parametrize("kwargs, match", [
    (dict(master_port=0), "master_port"),
    (dict(master_port=70000), "master_port"),
    (dict(master_port="29500"), "master_port"),
    (dict(master_port=29500, master_address=" "), "master_address"),
    (dict(master_port=29500, bucket_bytes=0), "bucket_bytes"),
    (dict(master_port=29500, wire_dtype="fp32"), "wire_dtype"),
    (dict(master_port=29500, wire_dtype="int8"), "wire_dtype"),
])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        NcclSyncConfig(**kwargs)


def test_group_layout():
    assert ns.group_layout([1]) == ([1], 2)
    assert ns.group_layout([2, 1, 4]) == ([1, 3, 4], 8)  # engine i's workers follow engine i-1's
    for bad in ([], [0], [1, -2]):
        with pytest.raises(ValueError, match="worker count"):
            ns.group_layout(bad)


def test_metadata_round_trips_through_vllm_types():
    from dataclasses import asdict

    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    sd = _tensors()
    meta = TransferMeta.from_tensors(sd.items())
    assert meta.names == list(sd) and meta.shapes[3] == [] and meta.dtype_names[:3] == ["float32", "bfloat16", "int64"]
    assert meta.nbytes() == [t.numel() * t.element_size() for t in sd.values()]
    vinfo = NCCLWeightTransferUpdateInfo(**meta.update_info())  # the dict vLLM's worker parses
    assert TransferMeta(**asdict(vinfo)) == meta
    cast = TransferMeta.from_tensors(sd.items(), wire="bfloat16")
    assert cast.dtype_names == ["bfloat16", "bfloat16", "int64", "bfloat16", "bfloat16", "bfloat16", "bfloat16"]
    init = NCCLWeightTransferInitInfo(**NcclSyncConfig(29500, packed=True, bucket_bytes=4096).worker_init_info(3, 8))
    assert (init.rank_offset, init.world_size, init.packed, init.packed_buffer_size_bytes) == (3, 8, True, 4096)


def test_a_bf16_wire_keeps_what_the_model_keeps_in_fp32():
    """DeepSeek-V3's router bias (e_score_correction_bias, which picks the experts) is fp32 in the
    engine too: a bf16 wire rounded it at every sync, and routing drifted from the trainer's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from workbench.trainer.loading import kept_fp32

    cfg = AutoConfig.for_model("deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                               num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1, q_lora_rank=None,
                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=256)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    meta = TransferMeta.from_tensors(model.state_dict().items(), "bfloat16", kept_fp32(model, torch.bfloat16))
    dtypes = dict(zip(meta.names, meta.dtype_names))
    assert dtypes["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert {d for n, d in dtypes.items() if "e_score_correction_bias" not in n} == {"bfloat16"}


@pytest.mark.parametrize("args, match", [
    ((["a", "b"], ["float32"], [[1], [2]]), "lengths"),
    ((["a", "a"], ["float32"] * 2, [[1], [2]]), "duplicate"),
    ((["a"], ["float33"], [[1]]), "unknown dtype"),
])
def test_metadata_validation(args, match):
    with pytest.raises(ValueError, match=match):
        TransferMeta(*args)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@pytest.mark.parametrize("bucket_bytes", [1, 100, 4096, 10_000, 1 << 30, None])
def test_buckets_cover_every_tensor_once_and_match_vllm_packing(bucket_bytes):
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    g = torch.Generator().manual_seed(1)
    sd = {f"t{i}": torch.zeros(int(n)) for i, n in enumerate(torch.randint(0, 900, (40,), generator=g))}
    meta = TransferMeta.from_tensors(sd.items())
    if bucket_bytes is None:  # exactly full after 5 tensors: a bucket closes only when *over*
        bucket_bytes = sum(meta.nbytes()[:5])
    buckets = ns.plan_buckets(meta, bucket_bytes)
    assert [i for b in buckets for i in b] == list(range(len(sd)))  # all, once, in order
    sizes = meta.nbytes()
    for b in buckets[:-1]:  # a bucket closes right after the tensor that takes it over the limit
        assert sum(sizes[i] for i in b) > bucket_bytes >= sum(sizes[i] for i in b[:-1])
    it, vllm_chunks = iter(sd.items()), []  # vLLM's own packer cuts the same chunks
    while (chunk := pack_tensors(it, lambda item: item[1], bucket_bytes)) is not None:
        vllm_chunks.append(chunk.names)
    assert vllm_chunks == [[meta.names[i] for i in b] for b in buckets]


def _tiny_moe(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, intermediate_size=32, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)
    cfg.save_pretrained(tmp_path)
    return AutoModelForCausalLM.from_config(cfg)


def test_names_are_checked_against_the_engine_model(tmp_path):
    model = _tiny_moe(tmp_path)
    expected = ns.hf_meta(str(tmp_path))
    sent = TransferMeta.from_tensors(ns.checkpoint_tensors(model, model.state_dict().items()), wire="bfloat16")
    assert (sent.names, sent.shapes) == (expected.names, expected.shapes)
    ns.check_meta(sent, expected)  # dtype differences are fine: vLLM's loader casts
    compiled = TransferMeta([f"_orig_mod.{n}" for n in sent.names], sent.dtype_names, sent.shapes)
    with pytest.raises(ValueError, match=r"missing \['model.embed_tokens.weight'.*unexpected \['_orig_mod.model"):
        ns.check_meta(compiled, expected)
    shapes = [list(s) for s in sent.shapes]
    shapes[0][0] += 1
    with pytest.raises(ValueError, match=r"shape mismatches \['model.embed_tokens.weight \[65, 32\] != \[64, 32\]'"):
        ns.check_meta(TransferMeta(sent.names, sent.dtype_names, shapes), expected)


def test_refuses_without_cuda_naming_the_cpu_path(monkeypatch):
    cfg = NcclSyncConfig(29500)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"the trainer has none.*sync_weights.*/dev/shm"):
        TrainerSender(cfg, world_size=2).connect()
    monkeypatch.setattr(ns, "_engine_has_gpu", lambda: False)
    with pytest.raises(RuntimeError, match=r"rollout engine has none.*RolloutEngine.update_weights"):
        asyncio.run(NcclReceiver(None, cfg, 1, 2).init())
    TrainerSender(cfg, world_size=2, rank=1).connect()  # other trainer ranks never join: no refusal


def test_engine_kwargs_build_vllm_config():
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import AsyncEngineArgs

    kw = ns.engine_kwargs()
    assert WeightTransferConfig(**kw["weight_transfer_config"]).backend == "nccl"
    args = AsyncEngineArgs(model="unused-not-loaded", **kw)
    assert isinstance(args.weight_transfer_config, WeightTransferConfig)
    assert args.weight_transfer_config.backend in WeightTransferEngineFactory._registry


def test_misaligned_packing_is_refused_before_any_broadcast(monkeypatch):
    from vllm.distributed.weight_transfer.packed_tensor import unpack_tensor

    sd = {"norm": torch.ones(3, dtype=torch.bfloat16), "router": torch.ones(2)}  # fp32 at byte 6
    meta = TransferMeta.from_tensors(sd.items())
    with pytest.raises(ValueError, match="'router' .float32. would start at byte 6 .* packed=False"):
        ns.plan_buckets(meta, 4096)
    # Why: vLLM 0.32's own unpack fails on this layout (vllm PR #57665). When this stops raising,
    # the refusal in plan_buckets can go.
    packed = torch.cat([t.view(-1).view(torch.uint8) for t in sd.values()])
    with pytest.raises(RuntimeError, match="storage_offset"):
        unpack_tensor(packed, meta.names, meta.shapes, [torch.bfloat16, torch.float32], meta.nbytes())
    rec = _Recorder()
    with pytest.raises(ValueError, match="byte 6"):
        TrainerSender(NcclSyncConfig(29500), 2, group=rec).send(sd.items(), meta)
    assert rec.sizes == []
    monkeypatch.setattr(ns, "_engine_has_gpu", lambda: True)
    llm = _FakeLLM()
    with pytest.raises(ValueError, match="byte 6"):
        asyncio.run(NcclReceiver(llm, NcclSyncConfig(29500), 1, 2).receive_update(meta.names, meta.dtype_names, meta.shapes, 1))
    assert llm.calls == []
    TrainerSender(NcclSyncConfig(29500, packed=False), 2, group=rec).send(sd.items(), meta)  # one by one: fine
    assert rec.sizes == [3, 2]


class _FakeLLM:
    """Records the AsyncLLM calls; the test checks that AsyncLLM really has each method."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        async def call(*args):
            self.calls.append((name, args))
        return call


def test_receiver_drives_asyncllm_weight_update_api(monkeypatch, tmp_path):
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
    from vllm.v1.engine.async_llm import AsyncLLM

    monkeypatch.setattr(ns, "_engine_has_gpu", lambda: True)
    model = _tiny_moe(tmp_path)
    meta = TransferMeta.from_tensors(ns.checkpoint_tensors(model, model.state_dict().items()))
    llm = _FakeLLM()
    rx = NcclReceiver(llm, NcclSyncConfig(29501, bucket_bytes=4096), 3, 8, expected=ns.hf_meta(str(tmp_path)))
    asyncio.run(rx.init())
    asyncio.run(rx.receive_update(meta.names, meta.dtype_names, meta.shapes, version=7))
    asyncio.run(rx.close())
    names = [c[0] for c in llm.calls]
    assert names == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                     "finish_weight_update", "shutdown_weight_transfer_engine"]
    assert all(callable(getattr(AsyncLLM, n)) for n in names)
    assert llm.calls[0][1][0].init_info["rank_offset"] == 3
    NCCLWeightTransferUpdateInfo(**llm.calls[2][1][0].update_info)
    assert llm.calls[3][1] == ("7",)
    llm.calls.clear()  # a wrong name is refused before any NCCL call
    with pytest.raises(ValueError, match="unexpected"):
        asyncio.run(rx.receive_update(["module." + n for n in meta.names], meta.dtype_names, meta.shapes, 8))
    assert llm.calls == []


class _Gloo:
    """A gloo group with PyNcclCommunicator's broadcast signature (own store: no global state)."""

    def __init__(self, address, port, rank, world):
        self.store = dist.TCPStore(address, port, world, is_master=rank == 0, timeout=timedelta(seconds=30))
        self.pg = dist.ProcessGroupGloo(self.store, rank, world, timedelta(seconds=30))

    def broadcast(self, tensor, src, stream=None):
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self.pg.broadcast([tensor], opts).wait()


class _Collector:
    def __init__(self):
        self.got = {}

    def load_weights(self, weights):
        for name, t in weights:
            self.got[name] = t.clone()  # packed tensors are views of a receive buffer


@pytest.mark.parametrize("packed, wire", [(True, None), (False, None), (True, "bfloat16"), (False, "float16")])
def test_broadcast_end_to_end_into_vllm_receiver(monkeypatch, packed, wire):
    from vllm.config import WeightTransferConfig
    from vllm.distributed.weight_transfer import nccl_engine, packed_tensor

    class NoStream:
        def synchronize(self):
            pass

    # vLLM's receive code is device-agnostic except for CUDA stream bookkeeping: stub only that.
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(packed_tensor, "_get_streams", lambda idx, n: tuple(NoStream() for _ in range(n)))
    monkeypatch.setattr(nccl_engine, "worker_init_process_group",  # the rendezvous, over gloo
                        lambda info, pc: _Gloo(info.master_address, info.master_port, pc.rank + info.rank_offset, info.world_size))

    cfg = NcclSyncConfig(_port(), packed=packed, bucket_bytes=4096, wire_dtype=wire)
    offsets, world = ns.group_layout([1, 1])  # trainer + two engines of one worker each
    sd = _tensors()
    meta = TransferMeta.from_tensors(sd.items(), wire=cfg.wire_dtype)

    def engine_worker(offset):
        model = _Collector()
        vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(rank=0), model_config=None)
        eng = nccl_engine.NCCLWeightTransferEngine(WeightTransferConfig(backend="nccl"), vllm_config, torch.device("cpu"), model)
        eng.init_transfer_engine(eng.parse_init_info(cfg.worker_init_info(offset, world)))
        eng.update_weights(meta.update_info())
        return model.got

    def trainer():
        sender = TrainerSender(cfg, world, group=_Gloo(cfg.master_address, cfg.master_port, 0, world))
        sender.connect()
        return sender.send(iter(sd.items()), meta)

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(engine_worker, o) for o in offsets] + [pool.submit(trainer)]
        results = [f.result(timeout=60) for f in futures]
    assert results[-1] == sum(meta.nbytes())
    for got in results[:-1]:
        assert list(got) == list(sd)
        for name, t in sd.items():
            want = t.to(ns.wire_dtype(t.dtype, wire))
            assert got[name].dtype == want.dtype and torch.equal(got[name], want), name


class _Recorder:
    def __init__(self):
        self.sizes = []

    def broadcast(self, tensor, src, stream=None):
        self.sizes.append(tensor.numel())


def test_sender_checks_iteration_against_metadata():
    sd = _tensors()
    meta = TransferMeta.from_tensors(sd.items())
    cfg = NcclSyncConfig(29500, bucket_bytes=4096)
    swapped = [(n, t) for n, t in sd.items()]
    swapped[0], swapped[1] = swapped[1], swapped[0]
    with pytest.raises(RuntimeError, match="tensor #0 is 'model.norm.weight'.*expect 'model.embed_tokens.weight'"):
        TrainerSender(cfg, 2, group=_Recorder()).send(swapped, meta)
    with pytest.raises(RuntimeError, match="tensor #6 is None"):
        TrainerSender(cfg, 2, group=_Recorder()).send(list(sd.items())[:-1], meta)
    with pytest.raises(RuntimeError, match="more tensors"):
        TrainerSender(cfg, 2, group=_Recorder()).send([*sd.items(), ("extra", torch.ones(1))], meta)
    drained = iter(sd.items())  # other trainer ranks only run the gathers
    assert TrainerSender(cfg, 2, rank=1).send(drained, meta) == 0 and next(drained, None) is None
    rec = _Recorder()
    TrainerSender(cfg, 2, group=rec).send(sd.items(), meta)
    assert rec.sizes == [sum(meta.nbytes()[i] for i in b) for b in ns.plan_buckets(meta, 4096)]


def test_full_tensors_yields_state_dict_in_order():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    assert [n for n, _ in ns.full_tensors(model)] == list(model.state_dict())


def test_the_wire_carries_the_checkpoints_names_and_layout(moe_path):
    """vLLM loads checkpoint names and layouts; transformers 5 holds others in memory (fused
    experts; Mixtral's block_sparse_moe renamed mlp, which vLLM refused mid-reload). What the
    trainer sends, tensor by tensor, is the checkpoint file's own: names, shapes and values."""
    from safetensors import safe_open

    from workbench.rollout.nccl_sync import check_meta, checkpoint_tensors, hf_meta
    from workbench.toy.models import load_hf_model

    model = load_hf_model(moe_path)
    sent = dict(checkpoint_tensors(model, model.state_dict().items()))
    with safe_open(str(moe_path / "model.safetensors"), "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys()}
    assert sorted(sent) == sorted(disk) and all(torch.equal(sent[k], disk[k]) for k in disk)
    meta = TransferMeta.from_tensors(checkpoint_tensors(model, model.state_dict().items()))
    check_meta(meta, hf_meta(str(moe_path)))  # the engine's expectation: the same names and shapes
    # Mixtral, from its in-memory names
    from transformers import AutoModelForCausalLM, MixtralConfig

    cfg = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=16, num_local_experts=2, num_experts_per_tok=1)
    mixtral = AutoModelForCausalLM.from_config(cfg)
    assert "model.layers.0.mlp.experts.gate_up_proj" in mixtral.state_dict()
    names = [n for n, _ in checkpoint_tensors(mixtral, mixtral.state_dict().items())]
    assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in names and not any(".mlp." in n for n in names)


def test_a_side_failing_to_join_the_nccl_group_is_said_at_once(ray_local):
    """Both sides of the rendezvous are waited on together: an engine failing to join at once is
    raised at once, with its own error (a review read ray.get of the list as waiting out rank 0's
    300 s store timeout first; Ray raises the first failure as it comes)."""
    import time

    import ray

    from workbench.trainer.fsdp import Trainer

    @ray.remote(num_cpus=0)
    class Rank:
        def nccl_endpoint(self):
            return "127.0.0.1", 1

        def connect_nccl(self, cfg, world):
            time.sleep(60)  # (the master's store waiting for members that never come)

    @ray.remote(num_cpus=0)
    class Engine:
        def init_nccl(self, cfg, offset, world):
            raise RuntimeError("this engine cannot join")

    t = object.__new__(Trainer)
    rank, engine = Rank.remote(), Engine.remote()
    t.workers = [rank]
    started = time.monotonic()
    with pytest.raises(Exception, match="this engine cannot join"):
        t.init_nccl_sync([engine], [1])
    assert time.monotonic() - started < 30
    ray.kill(rank)
    ray.kill(engine)


def test_a_group_that_lost_an_engine_is_refused_before_any_broadcast(ray_local, monkeypatch):
    """An NCCL group cannot lose a member: with an engine dropped (found dead while idle) or dead
    in the list (killed during a rollout), the broadcast waited for it for ever, trainer rank 0
    stuck inside it and the next sync or probe queued behind rank 0. Trainer.sync_weights_nccl
    refuses both before any NCCL call (a ping, then the member list) and remembers the group is
    broken (the session reads that as a trainer it cannot train with; shutdown does not wait on
    rank 0). Real Ray actors stand in for engines: nothing here reaches NCCL."""
    import ray

    from workbench.trainer.fsdp import Trainer, WeightSyncBroken

    @ray.remote(num_cpus=0)
    class Engine:
        def info(self):
            return {"version": 0}

    def trainer_over(engines):
        t = object.__new__(Trainer)  # (no ranks: the refusals come before any rank is called)
        t.nccl, t.nccl_broken, t.nccl_blocked, t._nccl_engines, t.workers = NcclSyncConfig(master_port=1), None, False, list(engines), []
        return t

    a, b = Engine.remote(), Engine.remote()
    t = trainer_over([a, b])
    with pytest.raises(WeightSyncBroken, match="made with 2 engine.* 1 of them are left"):
        t.sync_weights_nccl([a], version=1)
    with pytest.raises(WeightSyncBroken, match="made with 2"):  # and stays refused
        t.sync_weights_nccl([a, b], version=1)
    t = trainer_over([a, b])
    ray.kill(b)
    with pytest.raises(WeightSyncBroken, match="did not answer before the broadcast") as refused:
        t.sync_weights_nccl([a, b], version=1)
    assert t.nccl_broken and not refused.value.blocked and not t.nccl_blocked  # the ranks still save and export
    # Ray's "unavailable" is transient (a blip between nodes): asked again, and where it lasts the sync
    # fails alone, nothing sent. Taken as a broken group, one blip ended every later sync of the session
    from workbench.loop import engines_version

    c = Engine.remote()
    t, real_get, blips = trainer_over([a, c]), ray.get, [3]

    def flaky(ref, *args, **kw):
        if blips[0] > 0:
            blips[0] -= 1
            raise ray.exceptions.ActorUnavailableError("a blip", None)
        return real_get(ref, *args, **kw)

    monkeypatch.setattr(ray, "get", flaky)
    monkeypatch.setattr("time.sleep", lambda s: None)
    with pytest.raises(RuntimeError, match="nothing was sent: sync again"):
        t.sync_weights_nccl([a, c], version=1)
    assert t.nccl_broken is None
    blips[0] = 1
    with pytest.raises(IndexError):  # past the ping, on to the ranks (none here)
        t.sync_weights_nccl([a, c], version=1)
    assert t.nccl_broken is None
    engines, lost, blips[0] = [c], [], 2  # nor is an engine dropped (killed) at a blip
    assert engines_version(engines, lost) == 0 and engines == [c] and lost == []
    monkeypatch.undo()
    ray.kill(a)
    ray.kill(c)


def test_a_broadcast_that_failed_part_way_blocks_the_trainer_and_one_that_went_through_does_not(ray_local, monkeypatch):
    """An engine failing while rank 0's send is still inside the broadcast leaves rank 0 stuck for
    good, and a rank failing part-way leaves the engines inside it: WeightSyncBroken(blocked) (the session stops calling the ranks: a checkpoint queued
    behind the send hung wb.wait() and wb.shutdown()). An engine's probe refused after the
    broadcast went through is its own error: the group holds. (Actors stand in for the ranks and
    engines; the metadata checks are stubbed: nothing reaches NCCL.)"""
    import time

    import ray

    from workbench.trainer.fsdp import Trainer, WeightSyncBroken

    monkeypatch.setattr(ns, "check_meta", lambda *a: None)
    monkeypatch.setattr(ns, "hf_meta", lambda path: None)
    monkeypatch.setattr(ns, "TransferMeta", lambda **kw: None)

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, send_s):
            self.send_s = send_s

        def weight_meta(self, wire):
            return {}

        def send_weights_nccl(self, meta):
            if self.send_s < 0:  # the rank's own failure part-way (an OOM in a later bucket)
                raise RuntimeError("out of memory in bucket 3")
            time.sleep(self.send_s)
            return 0

    @ray.remote(num_cpus=0)
    class Engine:
        def info(self):
            return {"version": 0}

        def update_weights_nccl(self, meta, version, expected, probe, tol):
            time.sleep(0.5)
            raise RuntimeError("probe refused")

    for send_s, blocked in ((30.0, True), (0.0, False), (-1.0, True)):
        engine, rank = Engine.remote(), Rank.remote(send_s)
        t = object.__new__(Trainer)
        t.nccl, t.nccl_broken, t.nccl_blocked = NcclSyncConfig(master_port=1, packed=False), None, False
        t._nccl_engines, t.workers, t.model_path = [engine], [rank], "unused"
        with pytest.raises(WeightSyncBroken if blocked else RuntimeError) as raised:
            t.sync_weights_nccl([engine], version=1)
        assert ("probe refused" in str(raised.value) or "bucket 3" in str(raised.value)) and t.nccl_blocked == blocked
        assert bool(t.nccl_broken) == blocked
        if blocked:
            assert raised.value.blocked
            t.shutdown()  # returns at once: the stuck rank is killed, not asked to shut down
        for actor in (engine, rank):
            ray.kill(actor)
