"""Toy Env: single-digit addition, answered with the number only. The tiny warm-started model
gets it right now and then (~15-20%), so RL has a visible reward to raise.

    AgentRunner = ArithmeticEnv; tasks(n, seed) gives the prompts (label = the answer).
"""

from __future__ import annotations

import random
import re

from workbench.agents import Env, Task
from workbench.toy.tasks import arithmetic_problem


def tasks(n: int, seed: int = 0) -> list[Task]:
    rng = random.Random(seed)
    return [Task(p.messages, label=p.answer) for p in (arithmetic_problem(rng) for _ in range(n))]


class ArithmeticEnv(Env):
    max_turns = 1

    async def reset(self, task: Task):
        self.answer = task.label
        return [dict(m) for m in task.messages], {}

    async def step(self, message: dict):
        m = re.fullmatch(r"\s*(-?\d+)\s*", message.get("content") or "")
        correct = m is not None and int(m.group(1)) == self.answer
        return [], float(correct), True, False, {"correct": correct}


AgentRunner = ArithmeticEnv
