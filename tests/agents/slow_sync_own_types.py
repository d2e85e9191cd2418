"""A synchronous agent that takes 1.5 s and reports a value of a class defined in this file.
Many at once: each needs a thread for its whole episode (the loop's default executor has
cpu + 4). The Enum crosses from the runner's process to the driver's by the module's name."""
import enum
import time

from workbench.agents import ChatAgent


class Verdict(enum.Enum):
    PASS = "pass"


class AgentRunner(ChatAgent):
    def run(self, ctx):
        time.sleep(1.5)
        return 1.0, {"verdict": Verdict.PASS}
