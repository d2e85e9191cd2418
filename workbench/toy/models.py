"""Tiny checkpoints for tests and the embedded default, built in code (no weights can be downloaded).

`toy_model_path("moe")` returns a directory that HF transformers and vLLM both load: config,
safetensors weights (fp32), the toy tokenizer with its chat template, and a generation config.
It is built once into a cache directory keyed by a hash of everything that determines it, under
an inter-process file lock (pytest, Ray actors and vLLM workers may ask at the same time).

The build ends with a short supervised warm start on the toy conversations so the model closes
its turns with <|im_end|> and emits <tool_call> syntax; multi-turn demos are meaningless otherwise.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

BUILD_VERSION = 1  # bump when the build recipe changes in a way the spec does not capture


@dataclass(frozen=True)
class ToyModelSpec:
    """Everything that determines a tiny checkpoint. CPU vLLM needs head_dim >= 32 and MoE sizes
    in multiples of 32 (see FACTS.md)."""

    arch: str  # "qwen3" (dense) or "qwen3_moe"
    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    max_position_embeddings: int = 1024
    seed: int = 0
    warm_start_steps: int = 300
    warm_start_batch: int = 32
    warm_start_lr: float = 3e-3

    def key(self) -> str:
        blob = json.dumps({"spec": dataclasses.asdict(self), "build": BUILD_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


TOY_MODELS = {
    "dense": ToyModelSpec(arch="qwen3"),
    "moe": ToyModelSpec(arch="qwen3_moe"),
}


def cache_root() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench"))


def toy_model_path(name: str = "moe", spec: ToyModelSpec | None = None, progress: bool = True) -> Path:
    """Directory of the tiny checkpoint `name` ("dense" or "moe"), building it if missing."""
    if spec is None:
        if name not in TOY_MODELS:
            raise ValueError(f"unknown toy model {name!r}; choose one of {sorted(TOY_MODELS)}")
        spec = TOY_MODELS[name]
    return build_once(cache_root() / "toy" / f"{name}-{spec.key()}", lambda tmp: _build(spec, tmp, name, progress))


def build_once(out: Path, build, done: str = "config.json") -> Path:
    """`out`, made by `build(staging_dir)` unless it holds `done` already: one builder at a time
    across processes (a lock file beside it; the others wait, then use its result), whole or not
    at all (built beside, renamed in; a killed build's staging directory is removed by the next)."""
    if (out / done).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / done).exists():  # another process may have built it meanwhile
            for stale in out.parent.glob(f".{out.name}.tmp*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp = out.parent / f".{out.name}.tmp{os.getpid()}"
            build(tmp)
            shutil.rmtree(out, ignore_errors=True)  # (an incomplete one, from before builds were atomic)
            os.replace(tmp, out)
    return out


def make_config(spec: ToyModelSpec, tokenizer):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),  # equal to the tokenizer: no undecodable ids can be sampled
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    if spec.arch == "qwen3":
        return Qwen3Config(intermediate_size=spec.intermediate_size, **common)
    if spec.arch == "qwen3_moe":
        return Qwen3MoeConfig(
            intermediate_size=spec.intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_intermediate_size=spec.moe_intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            norm_topk_prob=True,
            output_router_logits=False,
            **common,
        )
    raise ValueError(f"unknown toy arch {spec.arch!r}")


def _build(spec: ToyModelSpec, out: Path, name: str, progress: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from .tokenizer import build_tokenizer

    t0 = time.time()
    out.mkdir(parents=True)
    tokenizer = build_tokenizer(out, seed=spec.seed)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(make_config(spec, tokenizer), dtype=torch.float32)
    warm_start(model, tokenizer, spec, desc=f"warm start {name}" if progress else None)
    model.save_pretrained(str(out))
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    ).save_pretrained(str(out))
    (out / "workbench_spec.json").write_text(
        json.dumps({"name": name, "spec": dataclasses.asdict(spec), "build_seconds": time.time() - t0}, indent=1)
    )


def warm_start(model, tokenizer, spec: ToyModelSpec, desc: str | None = "warm start") -> list[float]:
    """Short supervised run on whole toy conversations (template included); returns the losses."""
    import torch

    from .tasks import CALC_TOOL, warm_start_conversations

    convs = warm_start_conversations(spec.warm_start_steps * spec.warm_start_batch, seed=spec.seed + 1)
    seqs = [
        tokenizer.apply_chat_template(c, tools=[CALC_TOOL] if c[0]["content"].endswith("arithmetic.") else None)[
            "input_ids"
        ]
        for c in convs
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=spec.warm_start_lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=spec.warm_start_lr, total_steps=spec.warm_start_steps)
    model.train()
    losses = []
    bar = tqdm(range(spec.warm_start_steps), desc=desc, disable=desc is None)
    for step in bar:
        batch = seqs[step * spec.warm_start_batch : (step + 1) * spec.warm_start_batch]
        width = max(map(len, batch))
        ids = torch.full((len(batch), width), tokenizer.pad_token_id)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return losses


# tokenizer_config.json classes that carry no model-specific code: loaded directly, without
# AutoTokenizer's import (it pulls in transformers' modeling code and torch: ~6 s of CPU in every
# process that loads a tokenizer, e.g. each rollout runner); any other class goes through AutoTokenizer
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    import json

    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in GENERIC_TOKENIZER_CLASSES:
        import transformers

        return getattr(transformers, name).from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_hf_model(path: str | Path, dtype=None):
    """The HF transformers model of a checkpoint directory, in eval mode (fp32 by default)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=dtype or torch.float32,
                                                 **attention_kwargs(config))
    return model.eval()


def checkpoint_format(model, weights: dict) -> dict:
    """HF-named tensors as transformers holds them in memory (`model.state_dict()`) -> the names
    and layout of the model's checkpoint files, which is what vLLM's loaders read. transformers 5
    renames and fuses at load time (Mixtral's `block_sparse_moe` is `mlp`, its experts one fused
    `gate_up_proj`): vLLM refused Mixtral's in-memory names ("no module named layers.0.mlp"), after
    its layerwise reload had begun. Reverted as save_pretrained reverts them; tensors already in
    checkpoint form pass unchanged. `model`: any instance of the model's class (a meta one)."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(weights))


def meta_hf_model(config, **kwargs):
    """The model of an HF config, with shapes only (what checkpoint_format needs of it; the
    trainer's loading.meta_model builds on it). `kwargs`: from_config's (dtype, attention)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def attention_kwargs(config) -> dict:
    """The attention implementation the trainer's and the reference sampler's forward must use to
    compute the engine's: eager where the model soft-caps attention logits (Gemma 2), which
    transformers' default SDPA path leaves out and vLLM applies (log-probs 0.3 nat apart)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"attn_implementation": "eager"} if getattr(text, "attn_logit_softcapping", None) else {}
