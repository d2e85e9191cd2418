"""Toy Env: single-digit addition, answered with the number only. The tiny warm-started model
gets it right now and then (a few percent), so RL has a visible reward to raise.

    AgentRunner = ArithmeticEnv; tasks(n, seed) gives the prompts (label = the answer).
"""

from __future__ import annotations

import random
import re

from workbench.agents import Env, Task
from workbench.examples.tools import label_number
from workbench.toy.tasks import arithmetic_problem


def tasks(n: int, seed: int = 0) -> list[Task]:
    rng = random.Random(seed)
    # ids from the seed and the position: drawn again (a resumed run's chunk), the same task has the
    # same id in the records (Task's default id is a fresh random one)
    return [Task(p.messages, label=p.answer, id=f"arith-{seed}-{i}") for i, p in enumerate(arithmetic_problem(rng) for _ in range(n))]


def reward(text: str | None, answer: int) -> tuple[float, bool]:
    """(reward, correct) of a reply: 1 for the right number; partial credit for a number close to
    it, so that a group of samples almost always carries some signal even while exact answers are
    rare. (Which a constant answer near the middle of the sums also collects: notebook 00 shows
    what the toy does with it.)"""
    answer = label_number(answer)  # (a data file's label is text: "7")
    m = re.fullmatch(r"\s*(-?\d{1,30})\s*", text or "")  # (int() refuses 4300+ digits)
    correct = m is not None and int(m.group(1)) == answer
    close = 0.0 if m is None else max(0.0, 1.0 - abs(int(m.group(1)) - answer) / 10)
    return (1.0 if correct else 0.5 * close), correct


class ArithmeticEnv(Env):
    max_turns = 1

    async def reset(self, task: Task):
        self.answer = task.label
        return [dict(m) for m in task.messages], {}

    async def step(self, message: dict):
        r, correct = reward(message.get("content"), self.answer)
        return [], r, True, False, {"correct": correct}


AgentRunner = ArithmeticEnv
