"""An async agent that calls sys.exit(3): on Python 3.11 the SystemExit left wait_for's task
and stopped the runner's event loop (every episode in flight with it); it fails its episode."""
import sys

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        sys.exit(3)
