"""GSM8K-format math: the policy answers a word problem; reward 1 for the right final number
(the task's label: the text after '####' in the data file), partial credit for a close one.
Used by notebooks/recipes/math_grpo.ipynb and real_model_grpo.ipynb; for your own data, change
the reward here and the file's field mapping in the recipe (workbench.data.load_tasks)."""

from __future__ import annotations

import re

from workbench.agents import Env, Task


def reward(reply: str, label: str) -> tuple[float, bool]:
    """(reward, exact): the reply's last number against the label; 0.5 * closeness otherwise,
    so that a group of samples carries signal while exact answers are rare."""
    # (a unicode minus is a minus: "−12" read 12, and scored right against 12)
    found = re.findall(r"-?\d+(?:\.\d+)?", (reply or "").replace(",", "").replace("\u2212", "-"))
    if not found:
        return 0.0, False
    got, want = float(found[-1]), float(label)
    if got == want:
        return 1.0, True
    return 0.5 * max(0.0, 1.0 - abs(got - want) / max(10.0, abs(want))), False


class MathAnswer(Env):
    max_turns = 1

    async def reset(self, task: Task):
        self.label = task.label
        return [dict(m) for m in task.messages], {}

    async def step(self, message: dict):
        r, exact = reward(message.get("content") or "", self.label)
        return [], r, True, False, {"correct": exact}


AgentRunner = MathAnswer
