"""An Env whose episodes last several long turns (for partial-rollout tests)."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 4

    async def step(self, message):
        return [{"role": "user", "content": "Go on."}], 0.25, False, False, {}
