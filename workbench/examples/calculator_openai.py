"""Multi-turn tool use through the stock OpenAI SDK: the model may call `calc`; the agent runs
the tool and sends the result back, until the model answers. Reward: the final answer's number
(examples.tools.answer_number: its marked answer, else its last number) equals the right result."""

from __future__ import annotations

import json

from workbench.agents import ChatAgent
from workbench.examples.tools import calc, is_answer, tool_tasks

MAX_TURNS = 4


def tasks(n: int, seed: int = 0):
    return tool_tasks(n, seed)


class CalculatorAgent(ChatAgent):
    async def run(self, ctx):
        client = ctx.openai()  # a stock AsyncOpenAI at this episode's base_url
        messages, answer, calls = ctx.messages, None, 0
        for _ in range(MAX_TURNS):
            # no max_tokens: the policy's applies (a hard-coded 48 cut a thinking model inside <think> at every
            # turn, unreported as truncation, and the session's max_tokens did nothing)
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                answer = msg.content
                break
            for call in msg.tool_calls:
                calls += 1
                args = json.loads(call.function.arguments or "{}")
                result = calc(args.get("expression", "")) if call.function.name == "calc" else "error: unknown tool"
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return float(is_answer(answer, ctx.label)), {"tool_calls": calls, "answer": answer}


AgentRunner = CalculatorAgent
