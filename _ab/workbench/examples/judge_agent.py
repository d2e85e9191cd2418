"""LLM-as-judge reward: the policy answers in its recorded session; a judge grades the answer
against a rubric through the NON-recording side route (ctx.openai(side=True)), and the parsed
score is the reward. The judge's prompt and tokens never enter the trajectory.

Which model judges is the session's choice: `connect(judge="dense")` (or a checkpoint
directory, e.g. the policy frozen at a version by wb.export()) serves side calls from its own
frozen engine; without `judge=` they go to the policy's engines. Edit RUBRIC and parse_score
for your task."""

from __future__ import annotations

import re

from workbench.agents import ChatAgent
from workbench.examples.arithmetic_env import tasks  # noqa: F401  (same prompts as the toy Env)

SCALE = 10
RUBRIC = ("You grade answers to arithmetic questions.\n"
          "Question: {question}\nAnswer: {answer}\n"
          "Rubric: 10 if the answer's number is the right result, 5 if it is off by at most 2, "
          "0 otherwise or if there is no number. Reply with the score only.")


def parse_score(text: str, scale: int = SCALE) -> float | None:
    """The judge's first number, clipped to [0, scale] and divided by it; None when it gave none."""
    m = re.search(r"-?\d+(?:\.\d+)?", text)
    return None if m is None else min(max(float(m.group()), 0.0), scale) / scale


class JudgedAgent(ChatAgent):
    judge_max_tokens = 4

    async def run(self, ctx):
        policy, judge = ctx.openai(), ctx.openai(side=True)  # recorded session; non-recording route
        r = await policy.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=16)
        answer = r.choices[0].message.content or ""
        question = ctx.messages[-1]["content"]
        verdict = await judge.chat.completions.create(
            model="judge", max_tokens=self.judge_max_tokens, temperature=0,  # greedy: the same answer, the same score
            messages=[{"role": "user", "content": RUBRIC.format(question=question, answer=answer)}])
        said = verdict.choices[0].message.content or ""
        score = parse_score(said)
        # an unparsable verdict scores 0 and is counted (info), so a judge that stops answering shows
        return (score or 0.0), {"answer": answer, "verdict": said, "judge_parsed": score is not None,
                                "judge_tokens": verdict.usage.completion_tokens}


AgentRunner = JudgedAgent
