"""An Env whose step answers with a tool result as a dict (not text): the template would have
rendered it as "" and the policy trained on an empty result; the episode fails naming it."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 3

    async def reset(self, task):
        return [dict(m) for m in task.messages], {}

    async def step(self, message):
        return [{"role": "user", "content": {"temp": 21, "sky": "sunny"}}], 0.5, False, False, {}
