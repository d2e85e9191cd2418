"""A synchronous agent stuck well past its episode's timeout (a blocking call that never
returns in time): its thread stays held after its episode timed out."""
import time

from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    def run(self, ctx):
        time.sleep(3)
        return 1.0
