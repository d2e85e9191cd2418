"""Code with unit tests: the policy writes a small Python function, which runs in the sandbox
(workbench.sandbox: isolated interpreter, no network, time and memory limits) against the
task's unit tests; reward = the share of tests passed. Used by notebooks/recipes/code_agent.ipynb.
For your own task: tasks() (the prompt, the function's name, the tests) and nothing else."""

from __future__ import annotations

import asyncio
import json
import random
import re

from workbench.agents import ChatAgent, Task
from workbench.sandbox import run_python

# the function each task asks for: (name, operator); its reference solution returns `x <op> k`
KINDS = [("add_k", "+"), ("times_k", "*"), ("minus_k", "-")]


def tasks(n: int, seed: int = 0) -> list[Task]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, op = rng.choice(KINDS)
        k = rng.randint(1, 9)
        solution = f"def {name}(x):\n    return x {op} {k}"
        scope: dict = {}
        exec(solution, scope)  # the reference solution makes the tests' expected values
        tests = [[x, scope[name](x)] for x in rng.sample(range(-5, 20), 4)]
        prompt = f"Write a Python function {name}(x) that returns x {op} {k}. Reply with the code only."
        out.append(Task([{"role": "user", "content": prompt}], label={"name": name, "tests": tests, "solution": solution}))
    return out


HARNESS = """
import json
passed = 0
for x, want in json.loads({tests!r}):
    try:
        passed += {name}(x) == want
    except Exception:
        pass
print("PASSED", passed)
"""


def score(code: str, label: dict, timeout_s: float = 5.0) -> tuple[float, dict]:
    """Run `code` and the label's tests in the sandbox: (share passed, details)."""
    code = re.sub(r"^```(?:python)?\s*|```\s*$", "", code.strip(), flags=re.M)  # a fenced reply
    program = code + "\n" + HARNESS.format(tests=json.dumps(label["tests"]), name=label["name"])
    res = run_python(program, timeout_s, 256, 2000)
    m = re.search(r"PASSED (\d+)", res.stdout or "")
    passed = int(m.group(1)) if m else 0  # code that does not even define the function passes nothing
    total = len(label["tests"])
    return passed / total, {"passed": passed, "tests": total, "exit_code": res.exit_code, "ran": m is not None}


class CodeWithTests(ChatAgent):
    async def run(self, ctx):
        r = await ctx.openai().chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=64)
        code = r.choices[0].message.content or ""
        share, info = await asyncio.to_thread(score, code, ctx.label)
        return share, {**info, "code": code}


AgentRunner = CodeWithTests
