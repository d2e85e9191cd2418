"""workbench: agentic RL for LLMs, driven from JupyterLab. `wb = workbench.connect()`."""

__all__ = ["connect", "shutdown_live", "Workbench", "WorkbenchConfig", "ConfigError", "TrainerConfig", "LoopConfig",
           "CorrectionConfig"]


def __getattr__(name: str):
    # The session (and torch and transformers under it) is imported on first use rather than by
    # every process that imports a workbench module: a rollout runner actor needs neither (about
    # 6 s of CPU at each runner's start). Submodules stay reachable as attributes
    # (`workbench.correction.CorrectionConfig` after a bare `import workbench`), as when this
    # file imported the session eagerly.
    import importlib

    if name in __all__:
        return getattr(importlib.import_module(".session", __name__), name)
    try:
        return importlib.import_module(f".{name}", __name__)
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'workbench' has no attribute {name!r}") from None
