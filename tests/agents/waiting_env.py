"""An Env of two turns whose first step waits until the file named by the task's
info["wait_for"] exists (tasks without it go on at once): a test holds an episode between its
turns while the loop trains and syncs (its turns are then sampled by two versions), or while
other groups overtake it (the continuous async loop's staleness bound). With info["done_dir"],
each episode leaves a file there as it ends. Its reward is drawn at random per turn (never equal
in a group), so that every group carries a gradient and the loop's steps update and sync (a step
whose every update is skipped keeps its version: the tests' versions would not move)."""
import asyncio
import os
import random

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
            return [{"role": "user", "content": "Go on."}], _reward(message), False, False, {}
        if self.done_dir:  # the test sees which episodes have ended
            open(os.path.join(self.done_dir, f"{id(self)}"), "w").close()
        return [], _reward(message), True, False, {}


def _reward(message) -> float:
    return random.random()
