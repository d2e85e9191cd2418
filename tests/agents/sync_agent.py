"""A synchronous agent on the stock sync OpenAI client (runs in a worker thread)."""
import openai

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    def run(self, ctx):
        client = openai.OpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0)
        r = client.chat.completions.create(model=ctx.model, messages=ctx.messages, max_tokens=8)
        return 1.0 if r.choices[0].message.content is not None else 0.0
