import asyncio

import openai

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        try:  # gives up on a slow reply and ends its episode with a reward of its own
            await asyncio.wait_for(client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=4), 0.5)
        except asyncio.TimeoutError:
            return 1.0, {"gave_up": True}
        finally:
            await client.close()
        return 0.0
