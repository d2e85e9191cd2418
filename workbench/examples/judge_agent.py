"""LLM-as-judge reward: the policy answers in its recorded session; a judge (here the same
policy engine, through the NON-recording side route) grades the answer. The judge's tokens
never enter the trajectory."""

from __future__ import annotations

from workbench.agents import ChatAgent
from workbench.examples.arithmetic_env import tasks  # noqa: F401  (same prompts as the toy Env)


class JudgedAgent(ChatAgent):
    async def run(self, ctx):
        policy, judge = ctx.openai(), ctx.openai(side=True)  # recorded session; non-recording route
        r = await policy.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=16)
        answer = r.choices[0].message.content or ""
        question = ctx.messages[-1]["content"]
        verdict = await judge.chat.completions.create(model="judge", max_tokens=8, temperature=0, messages=[
            {"role": "user", "content": f"Question: {question}\nAnswer: {answer}\nIs the answer correct? Say yes or no."}])
        said = (verdict.choices[0].message.content or "").strip().lower()
        return float(said.startswith("yes")), {"answer": answer, "verdict": said}


AgentRunner = JudgedAgent
