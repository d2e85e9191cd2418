"""workbench: agentic RL for LLMs, driven from JupyterLab. `wb = workbench.connect()`."""

from .session import ConfigError, Workbench, WorkbenchConfig, connect

__all__ = ["connect", "Workbench", "WorkbenchConfig", "ConfigError"]
