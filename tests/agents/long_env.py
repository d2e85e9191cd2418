"""An Env whose episodes last several long turns (for partial-rollout tests). Its reward varies
with the replies (their length), so that a group carries a gradient and the loop's steps update
and sync (a step whose every update is skipped is not synced)."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 4

    async def step(self, message):
        return [{"role": "user", "content": "Go on."}], 0.25 * (len(message.get("content") or "") % 4), False, False, {}
