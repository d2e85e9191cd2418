"""Filling an FSDP2 model that was built on the meta device and sharded empty
(TrainerConfig.load): "rank0" (rank 0 reads the whole checkpoint and broadcasts it, each rank
keeping its shard) or "sharded" (each rank reads from the safetensors only the dim-0 slices it
owns; no rank ever holds a full copy). Imports only torch, transformers and safetensors:
scripts/gpu_check.py loads this file on a machine without the rest of workbench's dependencies."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

import torch


def kept_fp32(model, dtype: torch.dtype) -> list[str]:
    """Name patterns of what the model keeps in fp32 at a half `dtype` (transformers' dtype plan:
    DeepSeek-V3's router bias e_score_correction_bias, which picks the top-k experts)."""
    return list(model._get_dtype_plan(dtype)) if hasattr(model, "_get_dtype_plan") else []


def meta_model(path: str, dtype: torch.dtype, config=None):
    """The checkpoint's model with shapes only (no weights anywhere yet); `config`: its config,
    changed (None: read from `path`)."""
    from transformers import AutoConfig

    from ..toy.models import attention_kwargs, meta_hf_model

    config = config or AutoConfig.from_pretrained(path)
    model = meta_hf_model(config, dtype=dtype, **attention_kwargs(config))
    # what from_pretrained keeps in fp32 at a half dtype (load="full"), from_config does not: the
    # model's _keep_in_fp32_modules_strict (DeepSeek V3's router bias e_score_correction_bias, which
    # picks the top-k experts: rounded to bf16, routing differed between load modes and from the engine)
    keep = kept_fp32(model, dtype)
    for prefix, module in model.named_modules() if keep else ():
        for store in (module._parameters, module._buffers):
            for n, t in list(store.items()):
                if t is not None and t.is_floating_point() and t.dtype != torch.float32 \
                        and any(k in f"{prefix}.{n}" for k in keep):
                    store[n] = torch.nn.Parameter(t.float(), requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else t.float()
    return model


def load_from_rank0(model, path: str, dtype: torch.dtype, rank: int) -> None:
    """Rank 0 reads the checkpoint through transformers (which also converts its layout, e.g.
    per-expert tensors into fused MoE parameters) into host memory, one copy on the node, and
    broadcasts it tensor by tensor into every rank's shards."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    full = AutoModelForCausalLM.from_pretrained(path, dtype=dtype) if rank == 0 else None
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # buffers outside the state dict (rotary inv_freq, ...) were left empty by to_empty: rank 0's values
    names = [n for n, _ in model.named_buffers()]
    values = [[dict(full.named_buffers())[n].cpu() for n in names] if full is not None else None]
    dist.broadcast_object_list(values, src=0)
    with torch.no_grad():
        for (_, buf), value in zip(model.named_buffers(), values[0]):
            buf.copy_(value.to(buf.device, buf.dtype))


class _CountingSlice:
    """A safetensors slice that counts the bytes actually read through it."""

    def __init__(self, part, counter: list[int]):
        self.part, self.counter = part, counter

    def get_shape(self):
        return self.part.get_shape()

    def get_dtype(self):
        return self.part.get_dtype()

    def __getitem__(self, index):
        t = self.part[index]
        self.counter[0] += t.numel() * t.element_size()
        return t


def load_own_shards(model, path: str, dtype: torch.dtype) -> int:
    """Every rank reads from the checkpoint's safetensors only the slices its FSDP2 shards hold
    (dim 0 of each parameter; whole experts of a fused MoE parameter) and sets them as its local
    DTensor shards. Returns the bytes this rank read.

    The reading is transformers' own (core_model_loading, the path of from_pretrained onto a
    model already sharded with DTensors, transformers 5.16-5.19): it renames and fuses the
    checkpoint's tensors as from_pretrained does and slices each on read."""
    from safetensors import safe_open
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"load='sharded' reads safetensors; none in {path!r}")
    quantized = getattr(model.config, "quantization_config", None)
    if quantized:
        # (read without transformers' quantizer, FP8 codes were cast to the trainer's dtype without their
        # scales, the *_scale_inv tensors left over unsaid: weights off by 1/scale, found only as a failed
        # probe at the first sync, blamed on the engine)
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else getattr(quantized, "quant_method", "?")
        raise ValueError(f"load='sharded' of {path!r}: the checkpoint is quantized ({method}); it reads the tensors as "
                         f"stored. Train from a dequantized (bf16) checkpoint of the same model")
    # a rank FSDP gave no slice of a parameter (dim 0 split as torch.chunk splits it: 4 experts on 3
    # ranks are 2, 2, 0): transformers' fused-expert merge stacked nothing and raised on that rank
    # alone, the others waiting in their next collective
    empty = [n for n, p in model.named_parameters() if hasattr(p, "to_local") and p.dim() and p.shape[0] and not p.to_local().shape[0]]
    if empty:
        raise ValueError(f"load='sharded' of {path!r}: this rank holds no slice of {empty[:3]} (dim 0 of "
                         f"{model.get_parameter(empty[0]).shape[0]} split over the ranks leaves the last ones none): "
                         f"use load='rank0', or a number of ranks that divides it")
    local = next(p.to_local() for p in model.parameters())  # the device the shards live on
    read = [0]
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(f), "pt")) for f in files]
        state = {k: _CountingSlice(h.get_slice(k), read) for h in handles for k in h.keys()}
        info, _ = convert_and_load_state_dict_in_model(
            model, state, LoadStateDictConfig(dtype=dtype, device_map={"": local.device},
                                              weight_mapping=get_model_conversion_mapping(model)))
    model.tie_weights()  # a tied output embedding is the input one, loaded once under its name
    names_of = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), set()).add(name)
    missing = {k for k in info.missing_keys if not any(k in names and names - info.missing_keys for names in names_of.values())}
    # tensors read and put nowhere that are a quantization's (a scale without its config): refused too
    scales = sorted(k for k in getattr(info, "unexpected_keys", ()) or () if re.search(r"_scale(_inv)?$|_blocks$|_scales$", k))
    if missing or info.mismatched_keys or info.conversion_errors or scales:
        raise ValueError(f"load='sharded' of {path!r}: missing {sorted(missing)[:5]}, mismatched "
                         f"{sorted(info.mismatched_keys)[:5]}, conversion errors {info.conversion_errors}"
                         + (f", quantization tensors {scales[:5]} (a quantized checkpoint: dequantize it first)" if scales else ""))
    # the non-persistent buffers (rotary frequencies) are computed, not read: transformers'
    # own initialisation of those modules, as its meta-device loading does
    for module in model.modules():
        if module._buffers:
            model._init_weights(module)
    return read[0]
