"""The calculator agent on the stock Anthropic SDK: tool_use blocks in, tool_result blocks out."""

from __future__ import annotations

from workbench.agents import ChatAgent
from workbench.examples.tools import calc, is_answer, tool_tasks

MAX_TURNS = 4


def tasks(n: int, seed: int = 0):
    return tool_tasks(n, seed)


def anthropic_tools(openai_tools):
    return [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "input_schema": t["function"]["parameters"]} for t in openai_tools or []]


class CalculatorAgent(ChatAgent):
    async def run(self, ctx):
        client = ctx.anthropic()  # a stock AsyncAnthropic at this episode's base_url
        system = " ".join(m["content"] for m in ctx.messages if m["role"] == "system")
        messages = [m for m in ctx.messages if m["role"] != "system"]
        answer, calls = None, 0
        for _ in range(MAX_TURNS):
            r = await client.messages.create(model=ctx.model, system=system, messages=messages,
                                             tools=anthropic_tools(ctx.tools), max_tokens=ctx.max_tokens)  # the policy's
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
            uses = [b for b in r.content if b.type == "tool_use"]
            if not uses:
                answer = "".join(b.text for b in r.content if b.type == "text")
                break
            calls += len(uses)
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id,
                 "content": calc(u.input.get("expression", "")) if u.name == "calc" else "error: unknown tool"}
                for u in uses]})
        return float(is_answer(answer, ctx.label)), {"tool_calls": calls, "answer": answer}


AgentRunner = CalculatorAgent
