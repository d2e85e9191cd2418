"""GPU checks for the cluster path, on one GPU with torch and transformers only (no vLLM, no Ray:
the lent GPU machine has neither; /work/shared/FACTS.md). Run through scripts/gpu_check.sh.

Sections, each printed as one JSON line ("check": name, figures):
- fsdp: FSDP2 (fully_shard) on NCCL, bf16 mixed precision with fp32 reduce and fp32 master
  weights, a few AdamW steps on an MoE built from a config (loss, step time, peak memory).
- routing: how often bf16 routing picks a different top-k than fp32 routing on the same MoE
  (the failure routing replay exists to fix), and the bf16-vs-fp32 log-prob gap without and
  with replay of the fp32 experts (workbench/replay.py's routing_replay, on GPU).
- logprobs: peak memory of the trainer's log-probs with full [B, T, vocab] fp32 logits vs in
  chunks (workbench/trainer/logprobs.py), at Qwen3's vocabulary.
- load: meta-device init, fully_shard on the empty model, rank 0's weights broadcast into the
  shards (the mechanism of TrainerConfig.load="rank0"); the gathered weights equal the source.
  load_sharded: the same weights saved as safetensors, each rank reading only its own slices
  (TrainerConfig.load="sharded", workbench/trainer/loading.py itself); equal, and the bytes read.
- trainer: workbench's own TrainerWorker.train_step (trainer/fsdp.py: FSDP2 per layer, bf16
  compute with fp32 master weights, rows packed without padding, chunked log-probs) against a
  plain HF loop on the same tokens (fp32 weights under bf16 autocast, micro-batches padded to the
  batch's width, full logits), on a Qwen3-0.6B-shaped model with rows of 256-1024 tokens: tokens/s
  of each and their ratio (issue 13 item 7: target >= 1.0); also the trainer computing the padded
  batch (pack_sequences=False), by a token budget of as many tokens a forward as the plain loop's
  padded micro-batch (micro_batch_tokens), and with full logits (GPU_CHECK_VARIANTS); the host's
  waits on the device a step. One rank only.
- replay: forward + backward of the log-probs on the MoE with routing replay on vs off (the
  recorded experts of the same batch); target <= 1.05.

`--cpu` runs the same on CPU with gloo (a smoke test of the script itself, not a GPU figure).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 512  # sequence length of the checks; --cpu: 64 (a smoke test on a small machine)


# the checkout's own modules (these import only torch; workbench/__init__ imports nothing until a
# name is used, so the session's dependencies, which the GPU machine lacks, are not pulled in)
sys.path.insert(0, str(ROOT))
from workbench import replay  # noqa: E402
from workbench.trainer import loading, logprobs  # noqa: E402


def other_workbench(root: str | None):
    """Another checkout's workbench (root/workbench) imported as the package "workbench_ab", or
    None: an A/B of two versions of the code in one process (--ab). A ratio between two runs in
    two processes moved ~15% for the same code on this host-bound step (docs/cluster.md)."""
    if not root:
        return None
    import importlib
    import importlib.util

    where = Path(root).resolve() / "workbench"
    spec = importlib.util.spec_from_file_location("workbench_ab", where / "__init__.py", submodule_search_locations=[str(where)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["workbench_ab"] = package  # its modules import each other relatively, inside this package
    spec.loader.exec_module(package)
    return package


def moe_config(vocab: int = 4096, layers: int = 4):
    from transformers import Qwen3MoeConfig

    small = TOKENS < 512  # --cpu
    return Qwen3MoeConfig(vocab_size=vocab, hidden_size=128 if small else 512, intermediate_size=256 if small else 1024,
                          moe_intermediate_size=64 if small else 256, num_hidden_layers=2 if small else layers,
                          num_attention_heads=4 if small else 8, num_key_value_heads=2 if small else 4, head_dim=32 if small else 64,
                          num_experts=16 if small else 64, num_experts_per_tok=4 if small else 8, decoder_sparse_step=1, max_position_embeddings=4096,
                          tie_word_embeddings=False)


def build(cfg, dtype, device, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it lives: a 0.6B model's init on the host takes long
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def peak(device) -> float | None:
    """GiB of GPU memory at the peak since reset(); None on CPU (not measured there)."""
    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def reset(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def emit(check: str, **figures) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(json.dumps({"check": check, **figures}), flush=True)


def check_fsdp(device, backend: str, steps: int = 5) -> None:
    steps = steps if TOKENS >= 512 else 2
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = build(moe_config(), torch.float32, device)  # fp32 parameters: the master weights
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, 4096, (4, TOKENS), generator=g).to(device)
    losses, times = [], []
    reset(device)
    for _ in range(steps):
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
        losses.append(float(out.loss))
    p = next(model.parameters())
    emit("fsdp", backend=dist.get_backend(), world_size=dist.get_world_size(), param_dtype=str(p.dtype),
         compute_dtype="bfloat16", losses=[round(x, 4) for x in losses], loss_fell=losses[-1] < losses[0],
         step_s=round(sorted(times)[len(times) // 2], 4), peak_gib=peak(device))


def check_routing(device) -> None:
    cfg = moe_config()
    fp32 = build(cfg, torch.float32, device).eval()
    bf16 = build(cfg, torch.bfloat16, device).eval()
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in fp32.state_dict().items()})
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (8, TOKENS), generator=g).to(device)
    mask = torch.ones_like(ids)
    caps = {name: replay.RouterCapture(m) for name, m in (("fp32", fp32), ("bf16", bf16))}
    lps = {}
    with torch.no_grad():
        for name, m in (("fp32", fp32), ("bf16", bf16)):
            caps[name].active = True
            lps[name] = logprobs.forward_logprobs(m, ids, mask, 1.0, None).float()
            caps[name].active = False
        e32, e16 = caps["fp32"].pop(), caps["bf16"].pop()  # [B*S, layers, k]
        same = (e32.sort(-1).values == e16.sort(-1).values).all(-1)  # [B*S, layers]
        experts = e32.view(ids.shape[0], ids.shape[1], *e32.shape[1:])
        with replay.routing_replay(bf16, experts, positions=mask) as stats:
            lp_replayed = logprobs.forward_logprobs(bf16, ids, mask, 1.0, None).float()
    gap = (lps["bf16"] - lps["fp32"])[:, 1:].abs()
    gap_r = (lp_replayed - lps["fp32"])[:, 1:].abs()
    emit("routing", positions=int(same.numel()), flip_rate=round(1 - float(same.float().mean()), 5),
         flip_rate_per_layer=[round(1 - float(x), 5) for x in same.float().mean(0)],
         logprob_gap_mean=float(gap.mean()), logprob_gap_max=float(gap.max()),
         replayed_gap_mean=float(gap_r.mean()), replayed_gap_max=float(gap_r.max()),
         replayed_disagree_rate=stats.disagreement_rate)


def check_logprobs(device) -> None:
    cfg = moe_config(vocab=151936 if TOKENS >= 512 else 16384, layers=2)  # Qwen3's vocabulary: the logits are what costs
    model = build(cfg, torch.bfloat16, device)
    ids = torch.randint(0, cfg.vocab_size, (4, 2 * TOKENS)).to(device)
    mask = torch.ones_like(ids)
    out = {}
    for name, chunk in (("full", None), ("chunked_256mb", 256.0)):
        reset(device)
        lp = logprobs.forward_logprobs(model, ids, mask, 1.0, chunk)
        lp.float().sum().backward()
        model.zero_grad(set_to_none=True)
        out[name] = {"peak_gib": peak(device), "sum": float(lp.detach().float().sum())}
    emit("logprobs", tokens=int(ids.numel()), vocab=cfg.vocab_size, **out,
         equal=abs(out["full"]["sum"] - out["chunked_256mb"]["sum"]) <= 1e-3 * abs(out["full"]["sum"]))


def check_load(device) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    cfg = moe_config()
    source = build(cfg, torch.float32, torch.device("cpu"), seed=7) if dist.get_rank() == 0 else None
    reset(device)
    t = time.perf_counter()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    set_model_state_dict(model, source.state_dict() if source is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    seconds = time.perf_counter() - t
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in model.state_dict().items()}
    equal = source is None or all(torch.equal(full[k], v) for k, v in source.state_dict().items())
    emit("load", seconds=round(seconds, 3), peak_gib=peak(device), equal=bool(equal),
         params=sum(v.numel() for v in full.values()))
    del model, full
    # the sharded load: the source as safetensors in a directory every rank sees (one machine)
    import tempfile

    directory = [tempfile.mkdtemp(prefix="wb-load-") if source is not None else None]
    dist.broadcast_object_list(directory, src=0)
    if source is not None:
        source.save_pretrained(directory[0])
    dist.barrier()
    reset(device)
    t = time.perf_counter()
    model = loading.meta_model(directory[0], torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)
    read = loading.load_own_shards(model, directory[0], torch.float32)
    seconds = time.perf_counter() - t
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).cpu() for k, v in model.state_dict().items()}
    equal = source is None or all(torch.equal(full[k], v) for k, v in source.state_dict().items())
    emit("load_sharded", seconds=round(seconds, 3), peak_gib=peak(device), equal=bool(equal), bytes_read=read,
         checkpoint_bytes=sum(v.numel() * v.element_size() for v in full.values()))
    dist.barrier()
    if source is not None:
        import shutil

        shutil.rmtree(directory[0])


def check_replay(device, steps: int = 10, ab=None) -> None:
    steps = steps if TOKENS >= 512 else 2
    model = build(moe_config(), torch.bfloat16, device).train()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 4096, (8, TOKENS), generator=g).to(device)
    mask = torch.ones_like(ids)
    cap = replay.RouterCapture(model)
    cap.active = True
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    cap.remove()
    experts = cap.pop().view(*ids.shape, -1, model.config.num_experts_per_tok)

    def fwd_bwd(e, code=replay):
        with code.routing_replay(model, e, positions=mask) as stats:
            logprobs.forward_logprobs(model, ids, mask, 1.0, 256.0).float().sum().backward()
        stats.replayed  # the counts read once a step, as the trainer reads them
        model.zero_grad(set_to_none=True)

    runs = {"off": lambda: fwd_bwd(None), "on": lambda: fwd_bwd(experts)}
    if ab is not None:  # the other checkout's routing_replay, interleaved with this one's
        import importlib

        runs["on_ab"] = lambda code=importlib.import_module("workbench_ab.replay"): fwd_bwd(experts, code)
    times = interleaved(runs, device, 3, steps)
    for k in ("off", "on"):  # where the difference goes: $OUT/profile_replay_{off,on}.txt
        profile_step(f"replay_{k}", runs[k], device)
    emit("replay", tokens=int(ids.numel()), off_s=times["off"], on_s=times["on"],
         ratio_on_off=round(times["on"] / times["off"], 4),
         **({"on_ab_s": times["on_ab"], "ratio_on_ab_off": round(times["on_ab"] / times["off"], 4)} if ab else {}))


def interleaved(runs: dict, device, warmup: int, steps: int) -> dict:
    """Step i of every variant, then step i + 1 of each, ...: medians in seconds (the GPU synced)."""
    times = {k: [] for k in runs}
    for i in range(warmup + steps):
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times[k].append(time.perf_counter() - t)
    return {k: round(sorted(v)[len(v) // 2], 4) for k, v in times.items()}


def profile_step(name: str, fn, device) -> dict:
    """One step under torch.profiler: its wall time against the device's busy time (the sum of
    kernel times: a step far longer than its kernels waits on the host), and the top ops by
    device time in $OUT/profile_<name>.txt."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
    tables = [events.table(sort_by="self_cpu_time_total", row_limit=25)]
    if device.type == "cuda":
        try:
            tables.insert(0, events.table(sort_by="self_device_time_total", row_limit=25))
        except Exception:  # older torch: the CUDA name
            tables.insert(0, events.table(sort_by="self_cuda_time_total", row_limit=25))
    (Path(os.environ.get("OUT", ".")) / f"profile_{name}.txt").write_text("\n\n".join(tables))
    return {"wall_s": round(wall, 4), "device_busy_s": round(busy, 4)}


def count_syncs(fn, device) -> int | None:
    """The host's waits on the device in one call of fn (.item(), .cpu(), a boolean mask...):
    torch.cuda's sync debug mode warns at each. None on CPU, where nothing waits."""
    if device.type != "cuda":
        return None
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def check_trainer(device, steps: int = 5, overrides: dict | None = None, ab=None) -> None:
    """TrainerWorker itself joins its own process group (one rank): the script's is closed first,
    and this check runs last. Ray is not on the GPU machine; the worker needs it only to find its
    node's IP (rendezvous(), not called here: the store is made below)."""
    import dataclasses
    import tempfile
    import types

    from torch.distributed import TCPStore
    from transformers import Qwen3Config

    if dist.get_world_size() != 1:
        return emit("trainer", skipped="one rank only")
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.modules["ray"] = types.ModuleType("ray")
    from workbench.tokens import Segment, training_tensors
    from workbench.trainer.fsdp import TrainerConfig, TrainerWorker
    from workbench.trainer.packing import micro_batches_by_tokens

    small = TOKENS < 512  # --cpu
    steps = steps if not small else 2
    cfg = Qwen3Config(vocab_size=8192 if small else 151936, hidden_size=64 if small else 1024,
                      intermediate_size=128 if small else 3072, num_hidden_layers=2 if small else 28,
                      num_attention_heads=4 if small else 16, num_key_value_heads=2 if small else 8,
                      head_dim=16 if small else 128, max_position_embeddings=4096, tie_word_embeddings=True)
    directory = tempfile.mkdtemp(prefix="wb-trainer-")
    plain = build(cfg, torch.float32, device)
    plain.save_pretrained(directory)
    rows, lo, hi, micro = (16, 32, 2 * TOKENS, 4) if small else (64, 256, 2 * TOKENS, 8)
    g = torch.Generator().manual_seed(3)
    segs = []
    for _ in range(rows):
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        p = n // 4
        segs.append(Segment(torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist(), [0] * p + [1] * (n - p),
                            [0.0] * n, [-1] * p + [0] * (n - p)))
    batch = training_tensors(segs)
    batch["advantages"] = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * batch["loss_mask"]
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):  # behaviour log-probs ~ the model's
        lp = logprobs.forward_logprobs(plain, batch["input_ids"].to(device), batch["attention_mask"].to(device), 1.0, 256.0)
    batch["behaviour_logprobs"] = (lp.float().cpu() * batch["loss_mask"])
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-6, weight_decay=0.0)
    on_device = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def plain_step():
        plain.train()
        b = on_device
        for s in range(0, rows, micro):
            c = slice(s, s + micro)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = plain(input_ids=b["input_ids"][c], attention_mask=b["attention_mask"][c]).logits
            lp = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, b["input_ids"][c, 1:, None])[..., 0]
            ratio = torch.exp(lp - lp.detach())
            (-(ratio * b["advantages"][c, 1:] * b["loss_mask"][c, 1:]).sum() / b["loss_mask"].sum()).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    dist.destroy_process_group()
    # load="sharded": meta-device init, the rank reads its shards (a full load initialises 0.6B
    # parameters on the host first: most of this check's two minutes of set-up)
    base = TrainerConfig(**{"lr": 1e-6, "micro_batch_size": micro, "mixed_precision": "bfloat16", "load": "sharded",
                            **(overrides or {})})
    worker = TrainerWorker(0, 1, directory, base)
    worker._store = TCPStore("127.0.0.1", 0, 1, is_master=True)
    worker.setup("127.0.0.1", worker._store.port)
    variants = {"trainer": base, "trainer_padded": dataclasses.replace(base, pack_sequences=False),
                "trainer_full_logits": dataclasses.replace(base, logprob_chunk_mb=None),
                # as many tokens a forward as the plain loop's padded micro-batch (the same activation
                # memory): packed, the batch's real tokens take fewer forwards
                "trainer_budget": dataclasses.replace(base, micro_batch_tokens=micro * batch["input_ids"].shape[1])}

    # GPU_CHECK_VARIANTS="trainer,trainer_full_logits": others than the default three (trainer_padded always runs)
    keep = os.environ.get("GPU_CHECK_VARIANTS", "trainer,trainer_budget").split(",")
    variants = {k: v for k, v in variants.items() if k in keep or k == "trainer_padded"}

    def trainer_step(c):
        worker.cfg = c
        return worker.train_step(batch, 0)

    # packed vs padded log-probs of the same rows on this device (equal to bf16 rounding)
    worker.cfg = variants["trainer_padded"]
    padded = worker.logprobs(batch)[0]
    worker.cfg = base
    diff = (worker.logprobs(batch)[0] - padded).abs()[batch["loss_mask"].bool()]
    runs = {"plain": plain_step, **{k: (lambda c=c: trainer_step(c)) for k, c in variants.items()}}
    if ab is not None:
        import importlib

        # the other checkout's train_step on this worker's own state (model, optimizer, config):
        # only the code differs, and its steps interleave with this one's
        other = object.__new__(importlib.import_module("workbench_ab.trainer.fsdp").TrainerWorker)
        other.__dict__ = worker.__dict__

        def other_step(c):
            other.cfg = c
            return other.train_step(batch, 0)

        runs.update({f"ab_{k}": (lambda c=variants[k]: other_step(c)) for k in ("trainer", "trainer_budget") if k in variants})
    reset(device)
    times = interleaved(runs, device, 2, steps)
    profiled = ("plain", "trainer", "trainer_budget", "ab_trainer", "ab_trainer_budget")
    profiles = {k: profile_step(k, runs[k], device) for k in profiled if k in runs}
    syncs = {k: count_syncs(runs[k], device) for k in profiled if k in runs}
    tokens = int(batch["attention_mask"].sum())
    emit("trainer", params=sum(p.numel() for p in plain.parameters()), rows=rows, tokens=tokens,
         padded_tokens=int(batch["input_ids"].numel()), step_s=times,
         tokens_per_s={k: round(tokens / v) for k, v in times.items()},
         ratio_vs_plain={k: round(times["plain"] / v, 3) for k, v in times.items() if k != "plain"},
         peak_gib=peak(device), fsdp_units=worker.footprint()["fsdp_units"],
         overrides=overrides or {}, profiled=profiles, syncs_per_step=syncs, micro_batches={"plain": -(-rows // micro), "trainer_budget": len(micro_batches_by_tokens(
             batch["attention_mask"].sum(1).tolist(), micro * batch["input_ids"].shape[1]))},
         packed_vs_padded_logprob_diff={"mean": float(diff.mean()), "max": float(diff.max())})
    import shutil

    shutil.rmtree(directory)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU: a smoke test of this script")
    ap.add_argument("--trainer-cfg", type=json.loads, default={},
                    help="TrainerConfig fields for the trainer check, as JSON (e.g. '{\"shard_unit\": \"model\"}')")
    ap.add_argument("--ab", metavar="DIR",
                    help="another checkout (DIR/workbench): its replay and train_step run interleaved with this "
                         "one's in the same process (ab_* figures), e.g. git archive BRANCH workbench | tar -x -C DIR")
    ap.add_argument("--only", nargs="*", default=["fsdp", "routing", "logprobs", "load", "replay", "trainer"],
                    help="trainer runs last: it closes this script's process group and joins its own")
    args = ap.parse_args()
    global TOKENS
    TOKENS = 64 if args.cpu else TOKENS
    gpu = torch.cuda.is_available() and not args.cpu
    if not gpu and not args.cpu:
        sys.exit("no GPU visible (torch.cuda.is_available() is False); --cpu runs the smoke test")
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local % torch.cuda.device_count()) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo")
    ab = other_workbench(args.ab)
    emit("env", torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(device) if gpu else "cpu",
         world_size=dist.get_world_size())
    for name in args.only:
        t = time.perf_counter()
        try:
            {"fsdp": lambda: check_fsdp(device, "nccl" if gpu else "gloo"), "routing": lambda: check_routing(device),
             "logprobs": lambda: check_logprobs(device), "load": lambda: check_load(device),
             "replay": lambda: check_replay(device, ab=ab),
             "trainer": lambda: check_trainer(device, overrides=args.trainer_cfg, ab=ab)}[name]()
        except Exception as e:  # report and go on: one failing check must not hide the others
            emit(name, error=f"{type(e).__name__}: {e}"[:500])
        emit(f"{name}_time", seconds=round(time.perf_counter() - t, 2))
    if dist.is_initialized():  # the trainer check's own group, where it ran
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
