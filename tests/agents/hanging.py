import asyncio

import openai

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        await client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=4)
        await client.close()
        await asyncio.sleep(3600)  # hangs after one recorded turn
