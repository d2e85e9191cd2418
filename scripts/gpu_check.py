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

`--cpu` runs the same on CPU with gloo (a smoke test of the script itself, not a GPU figure).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 512  # sequence length of the checks; --cpu: 64 (a smoke test on a small machine)


def _load(name: str, rel: str):
    """A workbench module by file (these two import only torch): importing the package would
    pull the session's dependencies, which the GPU machine does not have."""
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


replay = _load("wb_replay", "workbench/replay.py")
logprobs = _load("wb_logprobs", "workbench/trainer/logprobs.py")
loading = _load("wb_loading", "workbench/trainer/loading.py")


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
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="gloo on CPU: a smoke test of this script")
    ap.add_argument("--only", nargs="*", default=["fsdp", "routing", "logprobs", "load"])
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
    emit("env", torch=torch.__version__, cuda=torch.version.cuda, device=torch.cuda.get_device_name(device) if gpu else "cpu",
         world_size=dist.get_world_size())
    for name in args.only:
        t = time.perf_counter()
        try:
            {"fsdp": lambda: check_fsdp(device, "nccl" if gpu else "gloo"), "routing": lambda: check_routing(device),
             "logprobs": lambda: check_logprobs(device), "load": lambda: check_load(device)}[name]()
        except Exception as e:  # report and go on: one failing check must not hide the others
            emit(name, error=f"{type(e).__name__}: {e}"[:500])
        emit(f"{name}_time", seconds=round(time.perf_counter() - t, 2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
