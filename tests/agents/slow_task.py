"""One recorded turn, then a wait as long as the task's info["sleep"] says (a group that finishes
late beside ones that finish at once)."""
import asyncio

import openai

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=4)
        await client.close()
        await asyncio.sleep(float(ctx.task.info.get("sleep", 0)))
        return 1.0
