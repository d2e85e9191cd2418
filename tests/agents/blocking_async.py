"""An async agent that blocks the runner's event loop (time.sleep in async code): every other
episode on the runner waits meanwhile."""
import time

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        time.sleep(1.4)
        return 1.0
