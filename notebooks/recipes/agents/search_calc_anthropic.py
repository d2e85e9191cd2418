"""The calc + search agent (search_calc_openai.py) on the stock Anthropic SDK: tool_use blocks
in, tool_result blocks out. Used by notebooks/recipes/tool_agent_anthropic.ipynb. A document task
opens with the agent's own search call (SEARCH_FIRST; see search_calc_openai.py for why)."""

from __future__ import annotations

from workbench.agents import ChatAgent
from workbench.examples.tools import calc, document_tasks, is_answer, search

MAX_TURNS = 4
SEARCH_FIRST = True
SEARCH_CALL_ID = "search000"  # 9 letters and digits: every template takes it (search_calc_openai.py)
TOOLS = {"calc": lambda args: calc(args.get("expression", "")), "search": lambda args: search(args.get("query", ""))}


def tasks(n: int, seed: int = 0):
    return document_tasks(n, seed)


def anthropic_tools(openai_tools):
    return [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
             "input_schema": t["function"]["parameters"]} for t in openai_tools or []]


class SearchCalcAgent(ChatAgent):
    async def run(self, ctx):
        client = ctx.anthropic()  # a stock AsyncAnthropic at this episode's base_url
        system = " ".join(m["content"] for m in ctx.messages if m["role"] == "system")
        messages = [m for m in ctx.messages if m["role"] != "system"]
        answer, calls = None, {"calc": 0, "search": 0, "agent_search": 0}
        if SEARCH_FIRST and "query" in ctx.task.info:
            query = ctx.task.info["query"]
            messages.append({"role": "assistant", "content": [
                {"type": "tool_use", "id": SEARCH_CALL_ID, "name": "search", "input": {"query": query}}]})
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": SEARCH_CALL_ID, "content": search(query)}]})
            calls["agent_search"] += 1
        for _ in range(MAX_TURNS):
            r = await client.messages.create(model=ctx.model, system=system, messages=messages,
                                             tools=anthropic_tools(ctx.tools), max_tokens=ctx.max_tokens)  # the policy's
            messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
            uses = [b for b in r.content if b.type == "tool_use"]
            if not uses:
                answer = "".join(b.text for b in r.content if b.type == "text")
                break
            for u in uses:
                calls[u.name] = calls.get(u.name, 0) + 1
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": u.id,
                 "content": TOOLS[u.name](u.input if isinstance(u.input, dict) else {}) if u.name in TOOLS
                 else "error: unknown tool"} for u in uses]})
        return float(is_answer(answer, ctx.label)), {  # (a text label: '19' == 19 was False)
            "tool_calls": calls["calc"] + calls["search"], "calc_calls": calls["calc"], "search_calls": calls["search"],
            "agent_search_calls": calls["agent_search"], "answer": answer,
            "document_task": "query" in ctx.task.info}  # (what the notebook tells the two kinds of task by)


AgentRunner = SearchCalcAgent
