"""Tool-call parsers, matched to the chat template that taught the model its tool-call syntax.
A parser turns sampled text into (content, calls); calls are {"name", "arguments" (dict)}.
Register new ones with `@register_tool_parser(name)`.

Only `hermes` is our own (the toy's and Qwen's `<tool_call>{json}</tool_call>` syntax): on
Qwen3's recorded real outputs it parses the tool calls of 41 of 43, as vLLM's hermes parser
(docs/ARCHITECTURE.md, real templates): the recording cut in its second call stays content, as
vLLM leaves it (the agent is told the reply was cut, and the next turn extends it). Every other name (a model profile's `tool_parser`:
`llama3_json`, `mistral`, `deepseek_v31`, `qwen3_coder`, ...) is vLLM's registered parser of that
name, run standalone on the reply's text with the policy's tokenizer."""

from __future__ import annotations

import json
import re
from typing import Callable

ToolParser = Callable[[str], "tuple[str, list[dict]]"]
TOOL_PARSERS: dict[str, ToolParser] = {}


def register_tool_parser(name: str):
    def deco(fn: ToolParser) -> ToolParser:
        TOOL_PARSERS[name] = fn
        return fn

    return deco


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


@register_tool_parser("hermes")
def parse_hermes(text: str) -> tuple[str, list[dict]]:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the toy template's and
    Qwen's syntax). If any block is not a JSON object with a string "name", nothing is parsed:
    the whole text stays content, as the model wrote it."""
    blocks = _HERMES.findall(text)
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        # an unclosed last block: whole when its JSON is (a reply ended by the stop string
        # "</tool_call>", which vLLM's hermes reads as a call too; one cut by max_tokens never
        # reaches a parser: LoopbackServer._reply); else a call cut mid-way. Parsed, the agent ran
        # the first calls and got the cut one's markup as text, and the next turn rendered the
        # calls before that text, an order the policy never sampled
        head, _, tail = rest.rpartition("<tool_call>")
        try:
            json.loads(tail)
        except json.JSONDecodeError:
            return text, []
        if "<tool_call>" in head:
            return text, []
        blocks, rest = blocks + [tail.strip()], head
    if not blocks:
        return text, []
    calls = []
    for b in blocks:
        try:
            obj = json.loads(b)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        if "arguments" not in obj and set(obj) != {"name"}:
            # arguments under another key ("parameters"): calling with {} ran a call the model did
            # not write; the text stays content, as vLLM's hermes parser leaves it
            return text, []
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append({"name": obj["name"], "arguments": args})
    return rest.strip(), calls


def get_tool_parser(name: str) -> ToolParser | None:
    """Our parser of that name; None for one of vLLM's registered names (the loopback runs those
    through vLLM's ParserManager: workbench.loopback.parsing); a clear error for any other name."""
    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    if name not in ToolParserManager.list_registered():
        raise ValueError(f"unknown tool parser {name!r}: neither ours ({sorted(TOOL_PARSERS)}) nor one of vLLM's "
                         f"({sorted(ToolParserManager.list_registered())})")
    return None
