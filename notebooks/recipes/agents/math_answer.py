"""GSM8K-format math: the policy answers a word problem; reward 1 for the right final number
(the task's label: the text after '####' in the data file), partial credit for a close one.
Used by notebooks/recipes/math_grpo.ipynb and real_model_grpo.ipynb; for your own data, change
the reward here and the file's field mapping in the recipe (workbench.data.load_tasks)."""

from __future__ import annotations

import re

from workbench.agents import Env, Task
from workbench.examples.tools import answer_text


def reward(reply: str, label: str) -> tuple[float, bool]:
    """(reward, exact): the reply's answer (its marked answer's number, else its last number:
    workbench.examples.tools.answer_text) against the label; 0.5 * closeness otherwise, so that a
    group of samples carries signal while exact answers are rare. The closeness is generous on
    small numbers: on the recipe's data one constant answer earns a mean reward of about 0.4
    (measured 2026-12-07: "8" 0.418 on one_step_train.jsonl, 12.5% exact), so watch correct_rate
    (exact answers) beside reward_mean, and narrow it (or drop it) once exact answers are common."""
    # (every comma was dropped: "3,4,5" read 345, paid as one number)
    found = answer_text(reply)
    # the label as a data file writes it ("1,234", "$18": float() raised, every episode of the task
    # failed and was dropped unscored), read as a reply's answer is
    want = _label_number(label)
    if want is None:
        raise ValueError(f"the task's label {label!r} is no number: this reward grades a number")
    if found is None:
        return 0.0, False
    got, want = float(found), float(want)
    if got == want:
        return 1.0, True
    return 0.5 * max(0.0, 1.0 - abs(got - want) / max(10.0, abs(want))), False


def _label_number(label):
    """A label's number: float() of its text without separators or a currency/percent sign (".5",
    "1e3" as float reads them), else as a reply's answer is read; None for none."""
    if not isinstance(label, str):
        return label
    text = label.strip().lstrip("$").rstrip("%")
    if "," in text and not re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", text):
        return None  # (a decimal comma or a list: "1,5", "12,34" read 15 and 1234; commas only as thousands)
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return answer_text(label)


class MathAnswer(Env):
    max_turns = 1

    async def reset(self, task: Task):
        self.label = task.label
        return [dict(m) for m in task.messages], {}

    async def step(self, message: dict):
        r, exact = reward(message.get("content") or "", self.label)
        return [], r, True, False, {"correct": exact}


AgentRunner = MathAnswer
