"""An Env whose steps earn 9e5 each: the second step's total (1.8e6) is past agents.MAX_ABS_REWARD,
so the episode fails; what it keeps (on_failed="keep") is the last total that passed the check."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 3

    async def reset(self, task):
        return [dict(m) for m in task.messages], {}

    async def step(self, message):
        return [{"role": "user", "content": "Go on."}], 9e5, False, False, {}
