"""Notices agent code that blocks a runner's event loop, and says where.

Every async agent and Env of a runner shares one event loop. An agent that blocks it (a
`time.sleep`, the `requests` library, a synchronous SDK client, a plain Env's step running
code or a grader) stops every other episode on the runner for as long: nothing fails, the
rollout is just slow, and episode timeouts cannot fire meanwhile. A watcher thread posts a
heartbeat to the loop; when one is late by more than `STALL_WARN_S` it reads the loop
thread's stack, and the stall is reported once per code location on stderr (Ray forwards it
to the driver, a notebook shows it) and counted in the runner's stats (`loop_stalls`).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback

STALL_WARN_S = 1.0  # a heartbeat this late is a stall (a quick sync Env step is far below it)
BEAT_S = 0.25  # how often the watcher posts a heartbeat (4 wake-ups a second on the loop)
# a stall still going this long is said from the watcher's thread, while it lasts: said only once it
# ended, a loop blocked for good (a hung synchronous call, a deadlock) hung the run without a word
STILL_BLOCKED_S = 10.0


class LoopWatch:
    """Made on the loop's own thread (its stack is the one read). A stall's length is measured
    from its heartbeat's posting, so it reads up to `beat_s` short."""

    def __init__(self, loop: asyncio.AbstractEventLoop, agent_path: str | None = None,
                 warn_s: float = STALL_WARN_S, beat_s: float = BEAT_S, still_s: float = STILL_BLOCKED_S):
        self.loop, self.agent_path, self.warn_s, self.beat_s, self.still_s = loop, agent_path, warn_s, beat_s, still_s
        self._still_said = None  # the heartbeat whose stall was said while it lasted
        self.loop_thread = threading.get_ident()
        self.stalls, self.longest_s, self.where = 0, 0.0, {}  # where: location -> stalls there
        self._sent = None  # (number, when posted) of the heartbeat now pending
        self._beats = 0
        self._seen_at = None  # (location, in the agent's file) read while the pending heartbeat is late
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="loop-watch", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        with self._lock:
            return {"count": self.stalls, "longest_s": round(self.longest_s, 3), "where": dict(self.where)}

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        while not self._stop.wait(self.beat_s):
            if self.loop.is_closed():
                return
            with self._lock:
                if not self.loop.is_running():  # idle between runs (in-process use): nothing is blocked;
                    self._sent = self._seen_at = None  # a heartbeat left queued is ignored when it runs
                    continue
                sent, seen = self._sent, self._seen_at
                if sent is None:
                    self._beats += 1
                    self._sent = (self._beats, time.monotonic())
            if sent is None:
                try:
                    self.loop.call_soon_threadsafe(self._beat, self._beats)
                except RuntimeError:  # the loop closed
                    return
            elif seen is None and time.monotonic() - sent[1] > self.warn_s / 2:
                # read before it counts as a stall: one ending before the next wake-up is read still
                where = self._blocking_code()
                with self._lock:
                    if self._sent is sent:
                        self._seen_at = where
            elif self._still_said != sent[0] and time.monotonic() - sent[1] > self.still_s:
                self._still_said = sent[0]
                where, _ = self._blocking_code()
                print(f"workbench: the runner's event loop has been blocked for {time.monotonic() - sent[1]:.0f} s, now at "
                      f"{where}: every episode on this runner waits, and their timeouts cannot fire until it returns",
                      file=sys.stderr, flush=True)

    def _beat(self, number: int) -> None:
        """On the loop: the heartbeat arrived; a late one was a stall."""
        with self._lock:
            if self._sent is None or self._sent[0] != number:  # posted before the loop went idle
                return
            late, (where, in_agent) = time.monotonic() - self._sent[1], self._seen_at or ("?", False)
            self._sent = self._seen_at = None
            if late <= self.warn_s:
                return
            self.stalls += 1
            self.longest_s = max(self.longest_s, late)
            first = where not in self.where
            self.where[where] = self.where.get(where, 0) + 1
        if first:
            advice = ("every other episode on this runner waited meanwhile. In an async agent or Env, await instead "
                      "(asyncio.sleep, the async SDK clients, asyncio.to_thread for blocking work), or write a "
                      "synchronous agent (def run, not async def), which runs in a thread of its own"
                      if in_agent else "no frame of the agent's file was running (the runner's own work, or a loop "
                      "with more episodes than it can serve)")
            print(f"workbench: the runner's event loop was blocked {late:.1f} s or more at {where}: {advice}. Counted "
                  f"in the runner's stats (loop_stalls); said once per location.", file=sys.stderr, flush=True)

    def _blocking_code(self) -> tuple[str, bool]:
        """The loop thread's innermost frame in the agent's file (and True), else its innermost frame."""
        frame = sys._current_frames().get(self.loop_thread)
        if frame is None:
            return "?", False
        stack = traceback.extract_stack(frame)
        mine = [f for f in stack if self.agent_path and f.filename == self.agent_path]
        f = (mine or stack)[-1]
        return f"{f.filename}:{f.lineno} in {f.name}" + (f" ({f.line})" if f.line else ""), bool(mine)
