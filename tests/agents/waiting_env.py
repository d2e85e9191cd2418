"""An Env of two turns whose first step waits until the file named by the task's
info["wait_for"] exists (tasks without it go on at once): a test holds an episode between its
turns while the loop trains and syncs (its turns are then sampled by two versions), or while
other groups overtake it (the continuous async loop's staleness bound). With info["done_dir"],
each episode leaves a file there as it ends."""
import asyncio
import os

from workbench.agents import Env


class AgentRunner(Env):
    max_turns = 2

    async def reset(self, task):
        self.wait_for, self.done_dir, self.turns = task.info.get("wait_for"), task.info.get("done_dir"), 0
        return [dict(m) for m in task.messages], {}

    async def step(self, message):
        self.turns += 1
        if self.turns == 1:
            while self.wait_for and not os.path.exists(self.wait_for):
                await asyncio.sleep(0.05)
            return [{"role": "user", "content": "Go on."}], 0.25, False, False, {}
        if self.done_dir:  # the test sees which episodes have ended
            open(os.path.join(self.done_dir, f"{id(self)}"), "w").close()
        return [], 0.25, True, False, {}
