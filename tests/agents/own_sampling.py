"""A chat agent that sets its own sampling (temperature 0.7, top_p 0.9) on every call, as many
real agents do, and talks twice per episode (so each episode has two recorded turns)."""
from workbench.agents import ChatAgent
from workbench.examples.arithmetic_env import tasks  # noqa: F401  (the toy arithmetic prompts)


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        client = ctx.openai()
        messages = list(ctx.messages)
        for _ in range(2):
            r = await client.chat.completions.create(model=ctx.model, messages=messages, max_tokens=8,
                                                     temperature=0.7, top_p=0.9)
            messages += [r.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Again?"}]
        return float((r.choices[0].message.content or "").strip() == str(ctx.label))
