from workbench.agents import ChatAgent


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        raise RuntimeError("agent exploded on purpose")
