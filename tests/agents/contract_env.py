"""An Env that breaks Gymnasium's contract as its task's info["how"] says; each was taken silently
(an observation in a role the template drops, tools in a shape no server renders, an old Gym
4-tuple failing unnamed, a text flag ending the episode). Each must fail its episode, naming why."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 2

    async def reset(self, task):
        self.how = task.info["how"]
        if self.how == "no_turns":  # a per-task turn budget set in reset (checked before it: 0 ran no turn, silently)
            self.max_turns = 0
        return [dict(m) for m in task.messages], {}

    async def step(self, message):
        if self.how == "role":
            return [{"role": "function", "name": "calc", "content": "5"}], 0.0, False, False, {}
        if self.how == "four_tuple":
            return [], 1.0, True, {}
        if self.how == "turns":  # (the framework's count replaced it, silently)
            return [], 1.0, True, False, {"turns": 99}
        if self.how == "text_flag":
            return [{"role": "user", "content": "go on"}], 0.5, "False", False, {}
        return [], 1.0, True, False, {}
