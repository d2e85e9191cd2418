"""An Env whose episodes last several long turns (for partial-rollout tests). Its reward is drawn
at random per turn (never equal in a group), so that every group carries a gradient and the
loop's steps update and sync (a step whose every update is skipped is not synced)."""
import random

from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 4

    async def step(self, message):
        return [{"role": "user", "content": "Go on."}], random.random(), False, False, {}
