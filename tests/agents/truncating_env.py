"""An Env whose step truncates the episode at its first turn (terminated False, truncated True),
as an Env with a budget of its own does."""
from workbench.agents import Env


class AgentRunner(Env):
    async def step(self, message):
        return [], 0.5, False, True, {}
