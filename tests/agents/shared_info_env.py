"""An Env of two turns whose reset hands back the task's own info dict (as an Env that keeps task
metadata might) and whose steps report a key of their own episode: the runner must give each
episode its own info, or siblings of a group (one Task, run concurrently) see each other's keys."""
import uuid

from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 2

    async def reset(self, task):
        self.name, self.turns = uuid.uuid4().hex[:8], 0
        # and pops a test from the task's label (its reward rule: the tests left): one Task shared by
        # the group made each sibling's rule another
        self.left = len(task.label["tests"]) - 1 if task.label else 0
        if task.label:
            task.label["tests"].pop()
        return [dict(m) for m in task.messages], task.info

    async def step(self, message):
        self.turns += 1
        return ([{"role": "user", "content": "Go on."}], float(self.left), self.turns == 2, False,
                {f"seen_{self.name}": self.turns})
