"""An agent that records a turn, then returns a NaN reward (a reward function dividing 0 by 0)."""
from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        await ctx.openai().chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=8)
        return float("nan")
