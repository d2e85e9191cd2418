"""An Env of two turns that edits the assistant message it is given (strips its content, as an Env
normalizing replies might) and hides the task's tools (tools = []): the runner's history must keep
the reply as sampled (edited, the next request differed from the recorded reply: a seal every
turn), and an empty tool list must hide the task's tools (`env.tools or task.tools` showed them)."""
from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 2
    tools = []

    async def reset(self, task):
        self.turns = 0
        return [dict(m) for m in task.messages], {}

    async def step(self, message):
        self.turns += 1
        message["content"] = ""
        return [{"role": "user", "content": "Go on."}], 0.5, self.turns == 2, False, {}
