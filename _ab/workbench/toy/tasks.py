"""Toy tasks: the text the tiny tokenizer is trained on, the warm-start conversations, and the
prompts of the embedded default's demo and quickstart.

Everything is generated from a seeded RNG, so the tokenizer and checkpoints built from it are
the same on every machine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

SYSTEM_PROMPT = "You are a careful assistant. Answer with the number only."
TOOL_SYSTEM_PROMPT = "You are a careful assistant. Use the calc tool for arithmetic."

CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@dataclass
class ArithmeticProblem:
    """'What is a+b?' with a known integer answer: the embedded default's task."""

    a: int
    b: int
    op: str = "+"
    messages: list[dict] = field(default_factory=list)

    @property
    def expression(self) -> str:
        return f"{self.a}{self.op}{self.b}"

    @property
    def answer(self) -> int:
        return {"+": self.a + self.b, "-": self.a - self.b, "*": self.a * self.b}[self.op]


def arithmetic_problem(rng: random.Random, max_operand: int = 9, ops: str = "+") -> ArithmeticProblem:
    a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
    p = ArithmeticProblem(a, b, op)
    p.messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"What is {p.expression}?"},
    ]
    return p


def plain_conversation(rng: random.Random) -> list[dict]:
    """A single-turn arithmetic exchange with the right answer."""
    p = arithmetic_problem(rng, max_operand=rng.choice([9, 20]), ops="+-*")
    return p.messages + [{"role": "assistant", "content": str(p.answer)}]


def tool_conversation(rng: random.Random) -> list[dict]:
    """An exchange where the assistant calls the calc tool, reads the result and answers."""
    p = arithmetic_problem(rng, max_operand=99, ops="+-*")
    call = {"name": "calc", "arguments": {"expression": p.expression}}
    return [
        {"role": "system", "content": TOOL_SYSTEM_PROMPT},
        {"role": "user", "content": f"Compute {p.expression}."},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]},
        {"role": "tool", "content": str(p.answer)},
        {"role": "assistant", "content": f"The answer is {p.answer}."},
    ]


def chit_chat(rng: random.Random) -> list[dict]:
    """Short free-text turns so the tokenizer and model also see ordinary words."""
    subjects = ["the cat", "a robot", "my friend", "the model", "our team", "the river"]
    verbs = ["likes", "reads", "builds", "sees", "counts", "writes"]
    objects = ["numbers", "books", "tools", "code", "the answer", "small steps"]
    s = f"{rng.choice(subjects).capitalize()} {rng.choice(verbs)} {rng.choice(objects)}."
    return [
        {"role": "user", "content": f"Say something about {rng.choice(objects)}."},
        {"role": "assistant", "content": s},
    ]


def warm_start_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """The supervised warm-start mix: plain answers, tool calls, and chit-chat."""
    rng = random.Random(seed)
    makers = [plain_conversation, plain_conversation, tool_conversation, chit_chat]
    return [rng.choice(makers)(rng) for _ in range(n)]


def tokenizer_corpus(seed: int = 0) -> list[str]:
    """Raw text for training the byte-level BPE (template markers excluded: they are special)."""
    rng = random.Random(seed)
    texts = []
    for conv in warm_start_conversations(3000, seed=seed):
        for m in conv:
            texts.append(m["role"])
            if m.get("content"):
                texts.append(m["content"])
            for tc in m.get("tool_calls", []):
                texts.append(json.dumps(tc["function"]))
    texts.append(json.dumps(CALC_TOOL))
    texts += [str(rng.randint(0, 10000)) for _ in range(500)]
    return texts
