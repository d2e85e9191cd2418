"""Benchmark agent: a fixed number of turns through the stock OpenAI SDK, each asking for
task.info["reply_tokens"] tokens with ignore_eos. (The loopback still stops a turn at the family's
turn-ending tokens unless the policy's own sampling ignores EOS: bench/rollout.py's does, so every
reply is that long; its direct replay generates as many tokens per call as each call did.)"""

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
