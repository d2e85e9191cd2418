"""Tool-call parsers, matched to the chat template that taught the model its tool-call syntax.
A parser turns sampled text into (content, calls); calls are {"name", "arguments" (dict)}.
Register new ones with `@register_tool_parser(name)`."""

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
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(args, dict):
            return text, []
        calls.append({"name": obj["name"], "arguments": args})
    return _HERMES.sub("", text).strip(), calls


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; registered: {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
