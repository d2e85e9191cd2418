"""An agent whose episode misbehaves as its task's info["how"] says: each way failed its whole
group (its siblings' finished episodes lost), stopped the runner's event loop, or ran past its
episode's timeout. Each must fail its own episode only, within the timeout."""
import asyncio
import threading
import time

from workbench.agents import ChatAgent


class Abort(BaseException):  # as pytest.fail's exception: no Exception
    pass


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str")


class Unloadable(Exception):  # pickles, but cannot be rebuilt (openai's APIStatusError: keyword-only arguments)
    def __init__(self, message, *, response):
        super().__init__(message)


class AgentRunner(ChatAgent):
    async def run(self, ctx):
        how = ctx.task.info["how"]
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "base":
            raise Abort("custom BaseException")
        if how == "unprintable":
            raise Unprintable()
        if how == "own_timeout":  # a tool's or socket's timeout: the agent's error, not the episode's timeout
            raise TimeoutError("the tool's socket timed out")
        if how == "stubborn":  # swallows its cancellation (a catch-everything retry loop)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 4:
                try:
                    await asyncio.sleep(0.05)
                except asyncio.CancelledError:
                    pass
            return 1.0
        info = {"tuple_key": {(1, 2): 3}, "lock": {"lock": threading.Lock()}, "eval": {"eval": True},
                "task_id": {"task_id": "mine"}, "unloadable": {"judge_error": Unloadable("429", response=None)}}.get(how, {})
        return 1.0, info
