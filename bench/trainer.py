"""Trainer benchmark, each number against a baseline measured in the same run:

1. tokens/s of `Trainer.train_step` (FSDP2 ranks in Ray actors) vs a plain HF loop on the same
   model and batches (forward, log-prob gather, policy-gradient loss, backward, clip, AdamW);
   target >= 1.0. The trainer packs each micro-batch's rows into one padding-free row
   (TrainerConfig.pack_sequences, trainer/packing.py); `trainer_wsN_padded` is the same trainer
   computing the padded batch as the plain loop does, `--micro-tokens N` adds token-budget
   micro-batches. (The trainer takes its old log-probs from the gradient forward itself, one
   optimizer update per batch; a separate no-grad forward had cost it a quarter of the step.)
2. routing replay on vs off (tiny MoE): forward + backward of token_logprobs; target <= 1.1.
3. weight sync seconds per MB into one vLLM engine, and into the reference backend.
4. peak memory of the trainer's log-prob forward + backward with full [batch, length, vocab]
   fp32 logits vs in chunks (TrainerConfig.logprob_chunk_mb, trainer/logprobs.py), on a tiny
   Qwen3 with Qwen3's real vocabulary size (151,936), each in a fresh process (peak RSS above
   the loaded model); `--logprob-memory-only` runs just this part.
5. TrainerConfig.keep_freed_memory (glibc keeps freed memory mapped in CPU ranks) on vs off:
   SmolLM2-135M's train_step on a batch like its recipe's, one rank each, step time and page
   faults per step; `--malloc-only` runs just this part (~3 min).

    .venv/bin/python bench/trainer.py [--steps 10] [--batch 32] [--seq-len 256] [--model moe]
                                      [--world-size 2] [--experts] [--skip-sync]

On 2 cores, 2 ranks x 1 thread is what the loop and tests run (the default); `--world-size 1 2`
adds 1 rank x 2 threads, the like-for-like comparison with the plain loop (one process, 2
threads). Fixed costs per step and per micro-batch (the Ray call, gloo collectives) weigh less
as micro-batches and batches grow (with --micro 8 the ratio was 0.88-0.91x, with 16 0.94-0.97x). Timed steps of all variants are interleaved, so other work on a shared machine
hits each alike; medians are reported, and ratios of the best (least disturbed) steps too.
Results go to bench/results/trainer.json (`--malloc-only`: trainer_malloc.json; `--logprob-memory-only`:
trainer_logprob_memory.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time
from pathlib import Path

import torch

from workbench.cluster import init_ray, shutdown_ray
from workbench.correction import CorrectionConfig
from workbench.replay import RouterCapture
from workbench.rollout.actor import launch_engine, stop_engine, sync_weights
from workbench.rollout.engine import expected_probe_logprobs, probe_ids
from workbench.tokens import Segment, training_tensors
from workbench.toy.models import load_hf_model, toy_model_path
from workbench.trainer.fsdp import Trainer, TrainerConfig, token_logprobs


def synthetic_batch(path: str, rows: int, seq_len: int, seed: int = 0, min_len: int | None = None) -> dict:
    """training_tensors' keys: random ids, lengths in [min_len, seq_len] (default seq_len/2; right padding as in
    real batches), the first quarter prompt (loss_mask 0), behaviour log-probs of the initial
    model (correction weights ~1), advantages +-1 per row."""
    g = torch.Generator().manual_seed(seed)
    model, segs = load_hf_model(path), []
    for _ in range(rows):
        n = int(torch.randint(seq_len // 2 if min_len is None else min_len, seq_len + 1, (1,), generator=g))
        p, ids = n // 4, torch.randint(0, model.config.vocab_size, (n,), generator=g)
        with torch.no_grad():
            lp = token_logprobs(model, ids[None], torch.ones(1, n, dtype=torch.long))[0][0]
        segs.append(Segment(ids.tolist(), [0] * p + [1] * (n - p), [0.0] * p + lp[p:].tolist(), [-1] * p + [0] * (n - p)))
    b = training_tensors(segs)
    b["advantages"] = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None] * b["loss_mask"]
    return b


class PlainLoop:
    """The baseline: a stock HF model and AdamW in this process, same micro-batches, lr, clip."""

    def __init__(self, path: str, lr: float, micro: int):
        self.model, self.micro = load_hf_model(path), micro
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def logprobs(self, ids, attn):
        logits = self.model(input_ids=ids, attention_mask=attn).logits
        return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]

    def step(self, b: dict) -> None:
        chunks = [slice(s, s + self.micro) for s in range(0, b["input_ids"].shape[0], self.micro)]
        self.model.train()
        for c in chunks:
            lp = self.logprobs(b["input_ids"][c], b["attention_mask"][c])
            ratio = torch.exp(lp - lp.detach())  # the PPO ratio at one update per batch, as the trainer forms it
            (-(ratio * b["advantages"][c, 1:] * b["loss_mask"][c, 1:]).sum() / b["loss_mask"].sum()).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _stepped(trainer, batch: dict) -> dict:
    """One train_step that updated the weights (a skipped update times no optimizer step)."""
    stats = trainer.train_step(batch)
    if stats["updates_skipped"]:
        raise RuntimeError(f"the trainer skipped {stats['updates_skipped']} update(s): the timing would omit AdamW")
    return stats


def timed(fn, *a) -> float:
    t0 = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t0


def interleaved(runs: dict, arg, warmup: int, steps: int) -> dict:
    """Step i of every variant, then step i + 1 of every variant, ...; {name: {median_s, min_s}}."""
    times = {k: [] for k in runs}
    for i in range(warmup + steps):
        for k, fn in runs.items():
            t = timed(fn, arg)
            if i >= warmup:
                times[k].append(t)
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "steps_s": v} for k, v in times.items()}


def bench_trainer(args, path: str, batch: dict) -> dict:
    """Trainer variants vs the plain loop. `trainer_wsN`: the default config (sequences packed,
    trainer/packing.py); `trainer_wsN_padded`: pack_sequences=False, every row computed at the
    batch's padded width as the plain loop does."""
    # no correction, no gate: the same batch trains every step, so its behaviour log-probs and version 0
    # fall out of the default geo band after one update and past max_staleness after four; every row
    # weighed 0, the update was skipped (no AdamW step) while the plain loop's stepped: a biased ratio
    cfg = TrainerConfig(micro_batch_size=args.micro, reshard_after_forward=False if args.reshard_after_backward else None,
                        correction=CorrectionConfig(enabled=False, max_staleness=None))
    variants = {"": cfg, "_padded": dataclasses.replace(cfg, pack_sequences=False)}
    if args.micro_tokens:
        variants["_tokens"] = dataclasses.replace(cfg, micro_batch_tokens=args.micro_tokens)
    runs = {"plain": PlainLoop(path, cfg.lr, args.micro).step}
    trainers = {}
    try:
        for ws in args.world_size:
            for suffix, c in variants.items():
                trainers[f"trainer_ws{ws}{suffix}"] = Trainer(path, world_size=ws, cfg=c)
                runs[f"trainer_ws{ws}{suffix}"] = functools.partial(_stepped, trainers[f"trainer_ws{ws}{suffix}"])
        out = interleaved(runs, batch, args.warmup, args.steps)
        for ws in args.world_size:  # what the loop does before every sync
            out[f"trainer_ws{ws}"]["state_dict_gather_s"] = timed(trainers[f"trainer_ws{ws}"].state_dict)
    finally:
        for t in trainers.values():
            t.shutdown()
    for r in out.values():
        r["tokens_per_s"] = int(batch["attention_mask"].sum()) / r["median_s"]
    return out


def record_experts(model, batch: dict) -> torch.Tensor:
    """The MoE's own routing of the batch, [B, T, layers, top_k] int16, as a rollout records it."""
    cap = RouterCapture(model)
    cap.active = True
    with torch.no_grad():
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    cap.remove()
    return cap.pop().reshape(*batch["input_ids"].shape, -1, model.config.num_experts_per_tok)


def bench_replay(args, batch: dict) -> dict:
    """Same model, same batch; the only difference is the routing_replay hooks."""
    model = load_hf_model(toy_model_path("moe")).train()
    ids, attn, experts = batch["input_ids"], batch["attention_mask"], record_experts(model, batch)

    def fwd_bwd(e):
        lp, _ = token_logprobs(model, ids, attn, experts=e)
        (lp * batch["loss_mask"]).sum().backward()
        model.zero_grad(set_to_none=True)

    r = interleaved({"off": lambda _: fwd_bwd(None), "on": lambda _: fwd_bwd(experts)}, None, args.warmup, args.steps)
    return {**r, "ratio_on_off": r["on"]["median_s"] / r["off"]["median_s"]}


def bench_sync(args, path: str) -> dict:
    """sync_weights wall time (ray.put, pause, load, version, resume, probe check) per backend."""
    import ray

    model = load_hf_model(path)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"state_dict_mb": sum(v.numel() * v.element_size() for v in sd.values()) / 1e6}
    expected = expected_probe_logprobs(model, probe_ids(model.config.vocab_size))
    for backend in ("vllm", "reference"):
        engine = launch_engine(backend, model_path=path, env={"VLLM_LOGGING_LEVEL": "WARNING"})
        try:
            v = ray.get(engine.info.remote())["version"]
            walls, inside = [], []
            for i in range(1 + args.syncs):  # the first is a warm-up
                t0 = time.perf_counter()
                report = sync_weights([engine], sd, version=v + 1 + i, expected_probe=expected, tol=1e-3)[0]
                walls.append(time.perf_counter() - t0)
                inside.append(report.seconds)
        finally:
            stop_engine(engine)
        med = statistics.median(walls[1:])
        out[backend] = {"median_s": med, "s_per_mb": med / out["state_dict_mb"], "engine_side_s": statistics.median(inside[1:])}
    return out


def logprob_memory_child(args) -> None:
    """One fwd + bwd of the trainer's log-prob path; prints peak RSS above the loaded model (MB)."""
    import resource

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from workbench.trainer.logprobs import forward_logprobs

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151_936, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32))
    rows, tokens = args.logprob_shape
    ids = torch.randint(0, 151_936, (rows, tokens))
    attn = torch.ones_like(ids)
    chunk = None if args.logprob_child < 0 else args.logprob_child
    forward_logprobs(model, ids[:, :8], attn[:, :8], 1.0, chunk).sum().backward()  # warm up, grads allocated
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t = time.perf_counter()
    lp = forward_logprobs(model, ids, attn, 1.0, chunk)
    lp.sum().backward()
    secs = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"peak_above_model_mb": peak - base, "seconds": secs, "logprob_sum": float(lp.sum())}))


def report_logprob_memory(args) -> dict:
    import subprocess
    import sys

    from workbench.trainer.fsdp import TrainerConfig

    chunk = TrainerConfig().logprob_chunk_mb
    out = {}
    for name, c in (("full_logits", -1.0), (f"chunked_{chunk:g}mb", chunk)):
        r = subprocess.run([sys.executable, __file__, "--logprob-child", str(c), "--logprob-shape",
                            *map(str, args.logprob_shape)], capture_output=True, text=True, check=True)
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
    full, chunked = out["full_logits"], out[f"chunked_{chunk:g}mb"]
    rows, tokens = args.logprob_shape
    print(f"\nlog-prob fwd+bwd, {rows} x {tokens} tokens, vocab 151,936 "
          f"({rows * tokens * 151_936 * 4 / 2**20:.0f} MB of fp32 logits):")
    for k, v in out.items():
        print(f"  {k:<16} peak {v['peak_above_model_mb']:>7.0f} MB above the model, {v['seconds']:.2f} s")
    out["ratio_peak_chunked_full"] = chunked["peak_above_model_mb"] / full["peak_above_model_mb"]
    out["ratio_time_chunked_full"] = chunked["seconds"] / full["seconds"]
    out["max_abs_logprob_sum_diff"] = abs(full["logprob_sum"] - chunked["logprob_sum"])
    print(f"  chunked / full: peak memory {out['ratio_peak_chunked_full']:.3f}x, time {out['ratio_time_chunked_full']:.2f}x")
    return out


def rank_faults(trainer) -> list[int]:
    """Minor page faults so far in each of the trainer's rank processes."""
    import ray

    return ray.get([w.__ray_call__.remote(lambda self: __import__("resource").getrusage(0).ru_minflt) for w in trainer.workers])


def bench_malloc(args) -> dict:
    """Part 5: TrainerConfig.keep_freed_memory on vs off (glibc's default), one rank each, on
    SmolLM2-135M (fp32) with a batch like its recipe's: the step time and the page faults per step."""
    from workbench.checkpoints import smollm2_path

    path = str(smollm2_path())
    rows, seq_len = args.malloc_batch
    batch = synthetic_batch(path, rows, seq_len, min_len=seq_len - 16)
    trainers, faults = {}, {}
    try:
        for keep in (True, False):
            trainers[keep] = Trainer(path, world_size=1, cfg=TrainerConfig(lr=5e-5, micro_batch_size=rows, keep_freed_memory=keep,
                                                                           correction=CorrectionConfig(enabled=False, max_staleness=None)))

        def step(keep):
            def run(b):
                f0 = rank_faults(trainers[keep])[0]
                _stepped(trainers[keep], b)
                faults.setdefault(keep, []).append(rank_faults(trainers[keep])[0] - f0)
            return run

        out = interleaved({"keep_freed_memory": step(True), "glibc_default": step(False)}, batch, args.warmup + 1, args.steps)
    finally:
        for t in trainers.values():
            t.shutdown()
    for name, keep in (("keep_freed_memory", True), ("glibc_default", False)):
        out[name]["page_faults_per_step"] = statistics.median(faults[keep][args.warmup + 1:])
    out["ratio_default_over_keep"] = out["glibc_default"]["median_s"] / out["keep_freed_memory"]["median_s"]
    out["tokens"] = int(batch["attention_mask"].sum())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32, help="rows (segments) per batch")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=None, help="rows' shortest length (default seq-len/2; agent "
                    "episodes spread wider, e.g. 16, which is where packing pays)")
    ap.add_argument("--micro", type=int, default=16, help="micro-batch size, both loops (16: the rows one of 2 ranks holds)")
    ap.add_argument("--model", default="moe", choices=["moe", "dense"])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2])
    ap.add_argument("--micro-tokens", type=int, default=None,
                    help="also a trainer with TrainerConfig(micro_batch_tokens=N) (token-budget micro-batches)")
    ap.add_argument("--experts", action="store_true", help="moe: batches carry recorded experts (the trainer "
                    "replays them and runs its live-routing KL forward; the plain loops route live)")
    ap.add_argument("--reshard-after-backward", action="store_true",
                    help="TrainerConfig(reshard_after_forward=False): keep gathered layers until backward")
    ap.add_argument("--syncs", type=int, default=3)
    ap.add_argument("--skip-sync", action="store_true")
    ap.add_argument("--logprob-memory-only", action="store_true", help="only part 4")
    ap.add_argument("--logprob-shape", type=int, nargs=2, default=[4, 1024], metavar=("ROWS", "TOKENS"))
    ap.add_argument("--malloc-only", action="store_true", help="only part 5 (keep_freed_memory on vs off)")
    ap.add_argument("--malloc-batch", type=int, nargs=2, default=[16, 130], metavar=("ROWS", "TOKENS"),
                    help="part 5's batch: rows of about TOKENS tokens (SmolLM2's recipe: 16 x ~130)")
    ap.add_argument("--logprob-child", type=float, default=None, help=argparse.SUPPRESS)  # -1: full logits
    args = ap.parse_args()
    if args.logprob_child is not None:
        return logprob_memory_child(args)
    if args.logprob_memory_only:
        return save_results("trainer_logprob_memory.json", args, {"logprob_memory": report_logprob_memory(args)})
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    init_ray()
    if args.malloc_only:
        try:
            return save_results("trainer_malloc.json", args, {"malloc": report_malloc(bench_malloc(args))})
        finally:
            shutdown_ray()
    # Ray starts its workers (the trainer's ranks) at its own niceness + 15. The plain loop runs
    # here, so it takes the same (after init_ray, else Ray would add 15 on top; before torch's
    # first op, so its threads inherit it): other work on a shared machine then slows both alike.
    os.nice(15)
    try:
        path = str(toy_model_path(args.model))
        batch = synthetic_batch(path, args.batch, args.seq_len, min_len=args.min_len)
        moe_batch = batch if args.model == "moe" else synthetic_batch(str(toy_model_path("moe")), args.batch, args.seq_len)
        if args.experts and args.model == "moe":
            batch = {**batch, "routed_experts": record_experts(load_hf_model(path), batch)}
        # The plain loop uses torch's default threads (= cores), a trainer rank cores / world_size
        # (fsdp.py): every variant uses all cores and no more.
        print(f"{args.model}, {args.batch} rows x <= {args.seq_len} tokens ({int(batch['attention_mask'].sum())} tokens), "
              f"{torch.get_num_threads()} torch threads here, {os.cpu_count()} cores")
        res = {"trainer": bench_trainer(args, path, batch)}
        res["replay"] = bench_replay(args, moe_batch)
        if not args.skip_sync:
            res["sync"] = bench_sync(args, path)
        res["logprob_memory"] = report_logprob_memory(args)
        res["malloc"] = bench_malloc(args)
    finally:
        shutdown_ray()

    tr, res["ratios"] = res["trainer"], {}
    print(f"\n{'variant':<20} {'tokens/s':>10} {'median s':>9} {'min s':>7}")
    for k, r in tr.items():
        print(f"{k:<20} {r['tokens_per_s']:>10.0f} {r['median_s']:>9.3f} {r['min_s']:>7.3f}")
    for ws in args.world_size:  # a tokens/s ratio is the inverse ratio of step times
        k = f"trainer_ws{ws}"
        r = {f"{k}/plain{best}": tr["plain"][stat] / tr[k][stat] for stat, best in (("median_s", ""), ("min_s", " best"))}
        res["ratios"].update(r)
        print(f"{k}: {r[f'{k}/plain']:.2f}x plain (target >= 1.0; best steps {r[f'{k}/plain best']:.2f}x); "
              f"state_dict gather {tr[k]['state_dict_gather_s']:.3f} s")
        for suffix in ("_padded", "_tokens"):
            if k + suffix in tr:
                res["ratios"][f"{k}{suffix}/plain"] = tr["plain"]["median_s"] / tr[k + suffix]["median_s"]
                print(f"{k}{suffix}: {res['ratios'][f'{k}{suffix}/plain']:.2f}x plain; {k} takes "
                      f"{tr[k]['median_s'] / tr[k + suffix]['median_s']:.2f}x its step time")
    rp = res["replay"]
    print(f"routing replay on/off, moe fwd+bwd: {rp['on']['median_s']:.3f} / {rp['off']['median_s']:.3f} s = "
          f"{rp['ratio_on_off']:.2f}x (target <= 1.1)")
    if "sync" in res:
        s = res["sync"]
        for b in ("vllm", "reference"):
            print(f"weight sync {b:<9}: {s[b]['s_per_mb']:.3f} s/MB ({s[b]['median_s']:.3f} s for {s['state_dict_mb']:.1f} MB, "
                  f"{s[b]['engine_side_s']:.3f} s inside the engine)")
        print(f"ratio vllm / reference s/MB: {s['vllm']['s_per_mb'] / s['reference']['s_per_mb']:.2f}x")
    report_malloc(res["malloc"])
    save_results("trainer.json", args, res)


def save_results(name: str, args, res: dict) -> dict:
    """bench/results/<name>: the arguments and results (a part run alone writes its own file, not
    trainer.json: it printed its figures and kept none)."""
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / name).write_text(json.dumps({"args": vars(args), **res}, indent=1))
    print(out / name)
    return res


def report_malloc(m: dict) -> dict:
    k, d = m["keep_freed_memory"], m["glibc_default"]
    print(f"SmolLM2 train_step, 1 rank, {m['tokens']} tokens: keep_freed_memory {k['median_s']:.2f} s "
          f"({k['page_faults_per_step']:.0f} page faults a step), glibc's default {d['median_s']:.2f} s "
          f"({d['page_faults_per_step']:.0f}): the default takes {m['ratio_default_over_keep']:.2f}x")
    return m


if __name__ == "__main__":
    main()
