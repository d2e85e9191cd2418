"""The FSDP2 trainer: a Ray actor group of N ranks (gloo on CPU, NCCL on GPU) over an HF
transformers causal LM, dense or MoE.

Each rank shards every decoder layer and the root with `fully_shard`. A step, on one batch
(rows = segments, see tokens.training_tensors), split evenly over ranks:

    old log-probs (no grad, routing replayed)  ->  correction weights (workbench.correction)
    -> per micro-batch: log-probs (grad, routing replayed) -> surrogate -> backward
    -> clip grad norm -> optimizer step

Log-probs are of the sampled tokens under logits / sampling temperature (what the engine's
processed log-probs are, for top_p = 1), aligned per token: column i is token i's log-prob
given tokens < i; column 0 is 0.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch

from ..correction import CorrectionConfig, correction_weights, merge_stats
from ..replay import routing_replay
from .losses import aggregate, get_surrogate

@dataclass
class TrainerConfig:
    lr: float = 1e-4
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    micro_batch_size: int = 8
    temperature: float = 1.0  # the sampling temperature: trainer log-probs use logits / T
    surrogate: str = "ppo_clip"
    surrogate_kwargs: dict = field(default_factory=dict)
    aggregation: str = "token_mean"
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    routing_replay: bool = True  # MoE: replay the rollout's expert ids when the batch has them
    dtype: str = "float32"  # "bfloat16" on GPU
    seed: int = 0


def token_logprobs(model, input_ids, attention_mask, temperature: float = 1.0, experts=None):
    """Per-token log-probs of `input_ids` under `model` ([B, T], column 0 = 0), with routing
    replay when `experts` ([B, T, layers, k]) is given. Returns (logprobs, ReplayStats)."""
    with routing_replay(model, experts) as stats:
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    lp = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    picked = lp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1), stats


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TrainerWorker:
    """One rank (Ray actor body)."""

    def __init__(self, rank: int, world_size: int, init_method: str, model_path: str, cfg: TrainerConfig):
        import torch.distributed as dist
        from torch.distributed.fsdp import fully_shard

        from ..toy.models import load_hf_model

        self.rank, self.world_size, self.cfg = rank, world_size, cfg
        torch.manual_seed(cfg.seed)
        if torch.cuda.is_available():
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
            backend = "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
        self.model = load_hf_model(model_path, dtype=getattr(torch, cfg.dtype)).to(self.device)
        for layer in self.model.model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def ready(self) -> int:
        return self.rank

    def _to(self, batch: dict) -> dict:
        return {k: (v.to(self.device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def _micro(self, batch: dict):
        n = batch["input_ids"].shape[0]
        for s in range(0, n, self.cfg.micro_batch_size):
            yield {k: (v[s: s + self.cfg.micro_batch_size] if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}

    def _experts(self, mb):
        return mb.get("routed_experts") if self.cfg.routing_replay else None

    def logprobs(self, batch: dict) -> torch.Tensor:
        """Log-probs of this rank's rows (no grad), on CPU."""
        batch = self._to(batch)
        out = []
        self.model.eval()
        with torch.no_grad():
            for mb in self._micro(batch):
                lp, _ = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], self.cfg.temperature, self._experts(mb))
                out.append(lp.cpu())
        return torch.cat(out)

    def train_step(self, batch: dict, trainer_version: int, global_tokens: int) -> dict:
        """One optimizer step on this rank's rows. `global_tokens`: trainable tokens over all
        ranks, so that a token_mean loss is the same whatever the split."""
        batch = self._to(batch)
        old = self.logprobs(batch).to(self.device)
        corr = correction_weights(old, batch["behaviour_logprobs"], batch["loss_mask"], batch["versions"],
                                  trainer_version, self.cfg.correction)
        batch["old_logprobs"], batch["weights"] = old, corr.weights.to(self.device)
        surrogate = get_surrogate(self.cfg.surrogate)
        self.model.train()
        total, disagree, replayed = 0.0, 0, 0
        for mb in self._micro(batch):
            lp, rstats = token_logprobs(self.model, mb["input_ids"], mb["attention_mask"], self.cfg.temperature, self._experts(mb))
            tl = surrogate(lp, mb["old_logprobs"], mb["advantages"], mb["weights"], mb["loss_mask"].float(), **self.cfg.surrogate_kwargs)
            if self.cfg.aggregation == "token_mean":  # sum / global tokens; FSDP averages grads over ranks
                loss = tl.sum() * self.world_size / max(global_tokens, 1)
            else:
                loss = aggregate(tl, mb["loss_mask"], self.cfg.aggregation) * mb["input_ids"].shape[0] / batch["input_ids"].shape[0]
            loss.backward()
            total += float(loss)
            disagree, replayed = disagree + sum(rstats.disagree), replayed + sum(rstats.replayed)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"loss": total, "grad_norm": float(grad_norm), "correction": corr.stats,
                "replay_disagree": disagree, "replay_positions": replayed}

    def probe(self, ids: list[int]) -> list[float]:
        """log p(ids[i+1] | ids[:i+1]) at temperature 1, live routing: what a synced engine's
        probe must match (every rank must call: FSDP forwards are collectives)."""
        self.model.eval()
        with torch.no_grad():
            t = torch.tensor([ids], device=self.device)
            lp, _ = token_logprobs(self.model, t, torch.ones_like(t))
        return lp[0, 1:].cpu().tolist()

    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def full_state_dict(self) -> dict | None:
        """HF-named full tensors on CPU, on rank 0 (every rank must call: it is a collective)."""
        full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                for k, v in self.model.state_dict().items()}
        return full if self.rank == 0 else None

    def save(self, path: str) -> None:
        """Sharded model + optimizer state with torch.distributed.checkpoint, and this rank's RNG."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(path, "dcp"))
        torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   os.path.join(path, f"rng_rank{self.rank}.pt"))

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=os.path.join(path, "dcp"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng = torch.load(os.path.join(path, f"rng_rank{self.rank}.pt"), weights_only=False)
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state_all(rng["cuda"])

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


class Trainer:
    """Driver-side handle over `world_size` TrainerWorker actors."""

    def __init__(self, model_path: str, world_size: int = 2, cfg: TrainerConfig | None = None, address: str = "127.0.0.1"):
        import ray

        self.cfg = cfg or TrainerConfig()
        self.version = 0
        init_method = f"tcp://{address}:{free_port()}"
        actor = ray.remote(TrainerWorker).options(num_cpus=0, num_gpus=1 if torch.cuda.is_available() else 0)
        self.workers = [actor.remote(r, world_size, init_method, str(model_path), self.cfg) for r in range(world_size)]
        ray.get([w.ready.remote() for w in self.workers])

    def _split(self, batch: dict) -> list[dict]:
        """Rows split evenly over ranks; short ranks get all-masked padding rows, so every rank
        runs the same number of forwards (FSDP collectives would hang otherwise)."""
        n, w = batch["input_ids"].shape[0], len(self.workers)
        per = -(-n // w)
        padded = {}
        for k, v in batch.items():
            if not isinstance(v, torch.Tensor):
                continue
            pad = torch.zeros((per * w - n, *v.shape[1:]), dtype=v.dtype)
            if k == "routed_experts":
                pad -= 1
            if k == "attention_mask":  # a fully masked row makes attention NaN, and NaN * 0 is NaN
                pad += 1
            padded[k] = torch.cat([v, pad])
        return [{k: v[r * per: (r + 1) * per] for k, v in padded.items()} for r in range(w)]

    def logprobs(self, batch: dict) -> torch.Tensor:
        import ray

        n = batch["input_ids"].shape[0]
        return torch.cat(ray.get([wk.logprobs.remote(part) for wk, part in zip(self.workers, self._split(batch))]))[:n]

    def train_step(self, batch: dict) -> dict:
        import ray

        tokens = int(batch["loss_mask"].sum())
        parts = self._split(batch)
        stats = ray.get([wk.train_step.remote(p, self.version, tokens) for wk, p in zip(self.workers, parts)])
        self.version += 1
        return {"version": self.version, "loss": sum(s["loss"] for s in stats), "grad_norm": stats[0]["grad_norm"],
                "replay_disagree": sum(s["replay_disagree"] for s in stats),
                "replay_positions": sum(s["replay_positions"] for s in stats),
                "correction": merge_stats([s["correction"] for s in stats])}

    def probe(self, ids: list[int]) -> list[float]:
        import ray

        return ray.get([w.probe.remote(ids) for w in self.workers])[0]

    @property
    def vocab_size(self) -> int:
        import ray

        return ray.get(self.workers[0].vocab_size.remote())

    def state_dict(self) -> dict:
        import ray

        return ray.get([w.full_state_dict.remote() for w in self.workers])[0]

    def save(self, path: str, run_state: dict | None = None) -> str:
        """Checkpoint to `path` (a directory every rank can reach): sharded weights and optimizer
        (torch.distributed.checkpoint), per-rank RNG, and run_state.json (the trainer version
        plus whatever the caller passes: step, data position, ...)."""
        import json

        import ray

        os.makedirs(path, exist_ok=True)
        ray.get([w.save.remote(path) for w in self.workers])
        with open(os.path.join(path, "run_state.json"), "w") as f:
            json.dump({**(run_state or {}), "version": self.version, "world_size": len(self.workers)}, f)
        return path

    def restore(self, path: str) -> dict:
        """Load a checkpoint written by save(); returns its run_state."""
        import json

        import ray

        state_file = os.path.join(path, "run_state.json")
        if not os.path.isfile(state_file):
            raise FileNotFoundError(f"no checkpoint at {path!r} (run_state.json missing)")
        with open(state_file) as f:
            run_state = json.load(f)
        if run_state["world_size"] != len(self.workers):
            raise ValueError(f"checkpoint {path!r} was written by {run_state['world_size']} ranks, this trainer has "
                             f"{len(self.workers)} (resharding a checkpoint is not supported yet)")
        ray.get([w.load.remote(path) for w in self.workers])
        self.version = run_state["version"]
        return run_state

    def shutdown(self) -> None:
        import ray

        try:
            ray.get([w.shutdown.remote() for w in self.workers], timeout=60)
        finally:
            for w in self.workers:
                ray.kill(w)
