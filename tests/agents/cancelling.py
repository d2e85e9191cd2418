"""An async agent that cancels a sub-task of its own and awaits it (a "first of N sub-agents
wins" pattern gone wrong): the CancelledError is its episode's failure, not its group's."""
import asyncio

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        sub = asyncio.ensure_future(asyncio.sleep(30))
        await asyncio.sleep(0)
        sub.cancel()
        await sub  # raises CancelledError in the agent
        return 1.0
