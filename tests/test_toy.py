"""The tiny tokenizer and checkpoints: deterministic, template-correct, loadable, warm-started."""

import json

import torch

from workbench.toy.models import TOY_MODELS, load_hf_model, load_tokenizer, toy_model_path
from workbench.toy.tasks import CALC_TOOL, arithmetic_problem, tool_conversation, tokenizer_corpus
from workbench.toy.tokenizer import CHAT_TEMPLATE, train_tokenizer


def test_tokenizer_is_deterministic_and_sized():
    a, b = train_tokenizer(tokenizer_corpus()), train_tokenizer(tokenizer_corpus())
    assert a.get_vocab() == b.get_vocab()
    assert len(a) == 512


def test_checkpoint_tokenizer_matches_model(moe_path, dense_path):
    for path in (moe_path, dense_path):
        tok, cfg = load_tokenizer(path), json.loads((path / "config.json").read_text())
        assert cfg["vocab_size"] == len(tok)  # no sampled id the tokenizer cannot decode
        assert tok.chat_template == CHAT_TEMPLATE
        assert cfg["eos_token_id"] == tok.convert_tokens_to_ids("<|im_end|>")


def test_chat_template_renders_roles_and_tool_calls(moe_path):
    import random

    tok = load_tokenizer(moe_path)
    conv = tool_conversation(random.Random(3))
    text = tok.apply_chat_template(conv, tools=[CALC_TOOL], tokenize=False)
    assert text.startswith("<|im_start|>system\n") and "# Tools\n" in text
    expr = conv[2]["tool_calls"][0]["function"]["arguments"]["expression"]
    assert f'<tool_call>{{"name": "calc", "arguments": {{"expression": "{expr}"}}}}</tool_call><|im_end|>\n' in text
    assert "<|im_start|>tool\n" in text and text.endswith("<|im_end|>\n")
    # string arguments (what the OpenAI wire format carries) render identically
    conv[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"expression": expr})
    assert tok.apply_chat_template(conv, tools=[CALC_TOOL], tokenize=False) == text
    prompt = tok.apply_chat_template(conv[:2], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_unknown_role_is_refused(moe_path):
    import pytest

    tok = load_tokenizer(moe_path)
    with pytest.raises(Exception, match="unknown role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}], tokenize=False)


def test_byte_level_bpe_does_not_round_trip(moe_path):
    """The drift the token-identity invariant exists for: ids sampled one digit at a time
    decode to text whose canonical tokenization is different (merged) ids."""
    tok = load_tokenizer(moe_path)
    merged = tok("1234", add_special_tokens=False)["input_ids"]
    split = [tok.convert_tokens_to_ids(c) for c in "1234"]
    assert tok.decode(split) == "1234" and merged != split


def test_cache_is_keyed_by_spec(tmp_path, monkeypatch):
    from dataclasses import replace

    assert TOY_MODELS["moe"].key() != replace(TOY_MODELS["moe"], seed=1).key()
    assert toy_model_path("moe") == toy_model_path("moe")  # built once, then reused


def test_models_load_and_warm_start_closes_turns(moe_path, dense_path):
    """Greedy decoding of the warm-started models answers an arithmetic prompt and ends the turn."""
    import random

    for path in (moe_path, dense_path):
        tok, model = load_tokenizer(path), load_hf_model(path)
        p = arithmetic_problem(random.Random(0))
        ids = tok.apply_chat_template(p.messages, add_generation_prompt=True)["input_ids"]
        out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
        assert tok.eos_token_id in out, tok.decode(out)
        assert tok.decode(out[: out.index(tok.eos_token_id)]).strip().lstrip("-").isdigit(), tok.decode(out)


def test_a_cached_checkpoint_is_built_once_whole_by_concurrent_first_callers(tmp_path):
    """Two first-time callers of tiny_qwen3_path raced: the loser's rename onto the winner's
    directory raised (smollm2_path's moved its copy inside the winner's). build_once (which the
    toy, tiny Qwen3 and SmolLM2 caches go through) builds once under a lock, beside, then renames;
    a killed build's staging directory is cleared by the next."""
    import subprocess
    import sys

    out = tmp_path / "cache" / "model"
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / ".model.tmp999").mkdir()  # a killed build's leftover
    code = f"""
import os, time
from pathlib import Path
from workbench.toy.models import build_once
def build(tmp):
    tmp.mkdir()
    with open({str(tmp_path / "builds")!r}, "a") as f:
        f.write(str(os.getpid()) + "\\n")
    time.sleep(1.0)
    (tmp / "config.json").write_text("{{}}")
print(build_once(Path({str(out)!r}), build))
"""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in results]
    assert [o.strip() for o, _ in results] == [str(out)] * 2
    assert len((tmp_path / "builds").read_text().split()) == 1  # built once; the other used it
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [".model.lock", "model"]
