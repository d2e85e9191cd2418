class AgentRunner:
    pass
