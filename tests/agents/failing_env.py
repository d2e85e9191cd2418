"""An Env whose first step earns 0.25 and sets info, and whose second step raises (an Env bug
part-way): the failed episode keeps the 0.25 and the info it earned (on_failed="keep")."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 3

    async def reset(self, task):
        self.turns = 0
        return [dict(m) for m in task.messages], {}

    async def step(self, message):
        self.turns += 1
        if self.turns == 1:
            return [{"role": "user", "content": "Go on."}], 0.25, False, False, {"first": "done"}
        raise RuntimeError("env broke on purpose")
