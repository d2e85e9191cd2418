"""Helpers shared by the example agents."""

from __future__ import annotations

import ast
import operator
import random
import re

from ..agents import Task
from ..toy.tasks import CALC_TOOL, TOOL_SYSTEM_PROMPT, arithmetic_problem

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calc(expression: str) -> str:
    """Evaluate + - * on integers, nothing else (the calculator tool; never eval())."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("unsupported expression")

    try:
        return str(ev(ast.parse(str(expression), mode="eval")))
    except (SyntaxError, ValueError, RecursionError):
        return "error: unsupported expression"


def last_number(text: str | None) -> int | None:
    found = re.findall(r"-?\d+", text or "")
    return int(found[-1]) if found else None


def tool_tasks(n: int, seed: int = 0) -> list[Task]:
    """'Compute a*b.' tasks with the calc tool; label = the right answer."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = arithmetic_problem(rng, max_operand=99, ops="+-*")
        out.append(Task([{"role": "system", "content": TOOL_SYSTEM_PROMPT},
                         {"role": "user", "content": f"Compute {p.expression}."}], tools=[CALC_TOOL], label=p.answer))
    return out
