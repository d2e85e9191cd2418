"""A Gymnasium-style Env with plain (synchronous) reset and step: every episode failed with
"object tuple can't be used in 'await' expression"."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 1

    def reset(self, task):
        return [dict(m) for m in task.messages], {"sync": True}

    def step(self, message):
        return [], 0.5, True, False, {}
