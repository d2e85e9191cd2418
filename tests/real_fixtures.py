"""Test helpers for the real-template tier (tests/test_real_templates.py, test_profiles.py,
test_real_loopback.py): canitoolcall's recorded real-model outputs per family
(`fixtures(family, ...)`) and vLLM's tool / reasoning parsers run standalone on them
(`parse_vllm`), compared with the recorded parse (`same_parse`). Families, tokenizers and
templates are workbench.real_models'."""

from __future__ import annotations

import glob
import json
from pathlib import Path

from workbench.real_models import FAMILIES, Family, _pkg_dir, harmony_encoding


# ------------------------------------------------------------------ recorded outputs (canitoolcall)
def fixtures_dir() -> Path:
    return _pkg_dir("canitoolcall") / "_data" / "fixtures"


def fixtures(name: str, folder: str | None = None, with_expected: bool | None = None) -> list[dict]:
    """Recorded real-model outputs whose token ids come from this family's vocabulary. Each is
    canitoolcall's record: id, raw_output, output_token_ids, tools, generation_prompt, thinking,
    expected {content, reasoning_content, tool_calls} or expected_error, tags, provenance."""
    spec = FAMILIES[name]
    out = []
    for fam, repos in spec.fixtures.items():
        if folder and fam != folder:
            continue
        for f in sorted(glob.glob(str(fixtures_dir() / fam / "*.jsonl"))):
            for line in open(f, encoding="utf-8"):
                d = json.loads(line)
                if d["tokenizer"].get("repo") not in repos:
                    continue
                if with_expected is not None and ("expected" in d) != with_expected:
                    continue
                d["_file"] = f"{fam}/{Path(f).name}"
                out.append(d)
    return out


# ------------------------------------------------------------------ vLLM's parsers, standalone
# Which vLLM tool / reasoning parser reads which recorded-output folder (and sub-format).
PARSERS = {  # (family, fixture folder, tokenizer repo or None for all) -> (tool parser, reasoning parser)
    ("qwen3", "qwen3-hermes", None): ("hermes", "qwen3"),
    ("qwen3", "qwen3-xml", None): ("qwen3_coder", None),
    ("llama3.1", "llama", None): ("llama3_json", None),
    ("mistral-v3", "mistral", None): ("mistral", None),
    ("gpt-oss", "gpt-oss", None): ("harmony", "harmony"),  # vLLM's "openai" tool parser is a stub: harmony
    ("deepseek-v3.1", "deepseek", "deepseek-ai/DeepSeek-V3-0324"): ("deepseek_v3", None),
    ("deepseek-v3.1", "deepseek", "deepseek-ai/DeepSeek-V3.1"): ("deepseek_v31", "deepseek_v3"),
}


def parser_for(family: str, fixture: dict) -> tuple[str | None, str | None] | None:
    folder = fixture["_file"].split("/")[0]
    return PARSERS.get((family, folder, fixture["tokenizer"]["repo"])) or PARSERS.get((family, folder, None))



def _norm(parse: dict) -> dict:
    """A parse in comparable form: stripped strings, None for empty, arguments as objects."""
    def s(x):
        return (x or "").strip() or None

    calls = []
    for c in parse.get("tool_calls") or []:
        args = c.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass
        calls.append({"name": c.get("name"), "arguments": args})
    return {"content": s(parse.get("content")), "reasoning_content": s(parse.get("reasoning_content")), "tool_calls": calls}


def same_parse(got: dict, expected: dict) -> bool:
    return _norm(got) == _norm(expected)


def parse_harmony(ids: list[int], stream: bool = False) -> dict:
    """gpt-oss: how vLLM parses harmony (token by token, openai_harmony's StreamableParser)."""
    from openai_harmony import Role, StreamableParser

    p = StreamableParser(harmony_encoding(), role=Role.ASSISTANT)
    for i in ids:
        p.process(i)
    msgs = list(p.messages)
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    for m in msgs + ([None] if p.current_content else []):
        channel = p.current_channel if m is None else m.channel
        recipient = p.current_recipient if m is None else m.recipient
        text = p.current_content if m is None else "".join(getattr(c, "text", "") for c in m.content)
        if recipient and recipient.startswith("functions."):
            out["tool_calls"].append({"name": recipient.split(".", 1)[1], "arguments": text})
        elif channel == "analysis":
            out["reasoning_content"] += text
        else:
            out["content"] += text
    return out


def parse_vllm(family: Family, fixture: dict, stream: bool = False) -> dict:
    """Parse a recorded output with vLLM's registered parsers, as vLLM's OpenAI server would:
    reasoning first, then tool calls on what is left. `stream=True` feeds it one token at a
    time through the streaming methods and assembles the deltas."""
    tool, reasoning = parser_for(family.name, fixture) or (None, None)
    ids, text = fixture["output_token_ids"], fixture["raw_output"]
    if tool == "harmony":
        return parse_harmony(ids, stream)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=fixture.get("tools") or None)
    thinking = fixture.get("thinking")
    if thinking is None:  # the 2507 models: thinking when the generation prompt opens <think>
        thinking = "<think>" in (fixture.get("generation_prompt") or "")
    kw = {"enable_thinking": bool(thinking), "thinking": bool(thinking)}
    rp = ReasoningParserManager.get_reasoning_parser(reasoning)(family.tokenizer, chat_template_kwargs=kw) if reasoning else None
    tp = ToolParserManager.get_tool_parser(tool)(family.tokenizer, tools=req.tools) if tool else None
    if not stream:
        r, content = rp.extract_reasoning(text, req) if rp else (None, text)
        out = {"content": content, "reasoning_content": r, "tool_calls": []}
        if tp and content is not None:
            got = tp.extract_tool_calls(content, req)
            out["content"] = got.content
            out["tool_calls"] = [{"name": c.function.name, "arguments": c.function.arguments} for c in got.tool_calls]
        return out
    # streamed: one token per delta, reasoning parser first, the tool parser on the content part
    out = {"content": "", "reasoning_content": "", "tool_calls": []}
    calls: dict[int, dict] = {}
    prev_text, prev_ids, cprev_text, cprev_ids = "", [], "", []
    in_reasoning = rp is not None
    decode = family.tokenizer.backend_tokenizer.decode
    for k in range(len(ids)):
        cur_ids = ids[: k + 1]
        cur_text = decode(cur_ids, skip_special_tokens=False)
        if cur_text.endswith("\ufffd") and k + 1 < len(ids):  # an incomplete character: hold it back
            continue
        delta, delta_ids = cur_text[len(prev_text):], ids[len(prev_ids): k + 1]
        if in_reasoning:
            d = rp.extract_reasoning_streaming(prev_text, cur_text, delta, prev_ids, cur_ids, delta_ids)
            if d is not None:
                out["reasoning_content"] += getattr(d, "reasoning", None) or getattr(d, "reasoning_content", None) or ""
                content_delta = d.content or ""
            else:
                content_delta = ""
            if rp.is_reasoning_end(cur_ids):
                in_reasoning = False
        else:
            content_delta = delta
        prev_text, prev_ids = cur_text, cur_ids
        if not content_delta:
            continue
        if tp is None:
            out["content"] += content_delta
            continue
        ctext = cprev_text + content_delta
        cids = cprev_ids + delta_ids
        d = tp.extract_tool_calls_streaming(cprev_text, ctext, content_delta, cprev_ids, cids, delta_ids, req)
        cprev_text, cprev_ids = ctext, cids
        if d is None:
            continue
        out["content"] += d.content or ""
        for tc in d.tool_calls or []:
            c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            if tc.function is not None:
                c["name"] += tc.function.name or ""
                c["arguments"] += tc.function.arguments or ""
    out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out
