"""Benchmark agent: a fixed number of turns through the stock OpenAI SDK; each reply is exactly
task.info["reply_tokens"] tokens long (ignore_eos), so both benchmark paths generate the same."""

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        client = ctx.openai()  # a stock AsyncOpenAI at this episode's base_url
        messages = ctx.messages
        for t in range(ctx.task.info["turns"]):
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=ctx.task.info["reply_tokens"],
                                                     extra_body={"ignore_eos": True})
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]
        return 0.0
