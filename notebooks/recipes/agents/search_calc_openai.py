"""Multi-turn tool use through the stock OpenAI SDK with two tools: `calc` and `search` (a small
local document collection, workbench.examples.tools.DOCUMENTS; the best passage by word
overlap). Tasks alternate between 'Compute a*b.' and 'Look up the number of pear trees in the
orchard and add 7.'. The agent runs every tool call the model makes and sends the result back
until the model answers; reward 1 when the final answer's number (its marked answer, else its last number) is the right result.
Used by notebooks/recipes/tool_agent_openai.ipynb.

A document task opens with the agent's own search call (SEARCH_FIRST): the tiny toy model was
warm-started on calc calls only and does not call a tool it has never seen, so the agent
retrieves first, as a tool turn in the conversation (the call and its result are context the
model reads, not sampled, so not trained on), and the model goes on from there with both tools.
A model that calls `search` itself (SEARCH_FIRST = False) is served the same way."""

from __future__ import annotations

import json

from workbench.agents import ChatAgent
from workbench.examples.tools import calc, document_tasks, is_answer, search

MAX_TURNS = 4
SEARCH_FIRST = True
# the agent's own call's id: 9 letters and digits, the one form every template takes (Mistral's
# refuses any other: "search0" failed every document task on a Mistral model, a 400 each)
SEARCH_CALL_ID = "search000"
TOOLS = {"calc": lambda args: calc(args.get("expression", "")), "search": lambda args: search(args.get("query", ""))}


def tasks(n: int, seed: int = 0):
    return document_tasks(n, seed)


def run_tool(name: str, arguments: str | None) -> str:
    try:
        args = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return "error: arguments are not JSON"
    return TOOLS[name](args if isinstance(args, dict) else {}) if name in TOOLS else "error: unknown tool"


class SearchCalcAgent(ChatAgent):
    async def run(self, ctx):
        client = ctx.openai()  # a stock AsyncOpenAI at this episode's base_url
        messages, answer, calls = ctx.messages, None, {"calc": 0, "search": 0, "agent_search": 0}
        if SEARCH_FIRST and "query" in ctx.task.info:
            query = ctx.task.info["query"]
            messages.append({"role": "assistant", "content": "", "tool_calls": [{
                "id": SEARCH_CALL_ID, "type": "function",
                "function": {"name": "search", "arguments": json.dumps({"query": query})}}]})
            messages.append({"role": "tool", "tool_call_id": SEARCH_CALL_ID, "content": search(query)})
            calls["agent_search"] += 1
        for _ in range(MAX_TURNS):
            # no max_tokens: the policy's (the recipe's max_tokens parameter) applies
            r = await client.chat.completions.create(model=ctx.model, messages=messages, tools=ctx.tools)
            msg = r.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            if not msg.tool_calls:
                answer = msg.content
                break
            for call in msg.tool_calls:
                calls[call.function.name] = calls.get(call.function.name, 0) + 1
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": run_tool(call.function.name, call.function.arguments)})
        return float(is_answer(answer, ctx.label)), {  # (a text label: '19' == 19 was False)
            "tool_calls": calls["calc"] + calls["search"], "calc_calls": calls["calc"], "search_calls": calls["search"],
            "agent_search_calls": calls["agent_search"], "answer": answer,
            "document_task": "query" in ctx.task.info}  # (what the notebook tells the two kinds of task by)


AgentRunner = SearchCalcAgent
