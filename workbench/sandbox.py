"""Run untrusted Python (code-execution agents) in a sandboxed subprocess.

Isolation, each layer cheap and standard:
- an isolated interpreter (`python -I -S`: no site-packages, no user site, no PYTHON* env)
  in an empty temporary working directory with a minimal environment;
- no network: the child runs in a fresh, empty network namespace (`unshare -n`, or
  `unshare -rn` through a user namespace where plain -n is not permitted); even 127.0.0.1 is
  unreachable there;
- limits set in the child before exec: address space (memory), CPU seconds, file size,
  process count; plus a wall-clock timeout that kills the whole process group;
- output truncated to `max_output` characters per stream.

Where namespaces are unavailable it fails closed with SandboxUnavailable, unless the caller
opts out explicitly (`require_network_isolation=False`).
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass


class SandboxUnavailable(RuntimeError):
    pass


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@functools.lru_cache(maxsize=1)
def network_isolation_prefix() -> tuple[str, ...] | None:
    """The command prefix that gives a child an empty network namespace here, or None."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for flags in ("-n", "-rn"):
        try:
            if subprocess.run([unshare, flags, "true"], capture_output=True, timeout=10).returncode == 0:
                return (unshare, flags)
        except (OSError, subprocess.TimeoutExpired):
            pass
    return None


def _limits(memory_mb: int, cpu_s: int, max_file_mb: int = 16, max_procs: int = 64):
    def apply():
        os.setsid()  # own process group: the timeout kills everything the code started
        mem = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_NPROC, (max_procs, max_procs))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 4096,
               stdin: str = "", require_network_isolation: bool = True) -> SandboxResult:
    """Execute `code` in a sandboxed interpreter and return its (truncated) output."""
    prefix = network_isolation_prefix()
    if prefix is None and require_network_isolation:
        raise SandboxUnavailable(
            "cannot isolate the network here (`unshare -n` / `unshare -rn` not permitted); refusing to run "
            "untrusted code. Pass require_network_isolation=False to run it without network isolation."
        )
    with tempfile.TemporaryDirectory(prefix="workbench-sandbox-") as cwd:
        cmd = [*(prefix or ()), sys.executable, "-I", "-S", "-c", code]
        env = {"PATH": "/usr/bin:/bin", "HOME": cwd, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1"}
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, preexec_fn=_limits(memory_mb, max(1, int(timeout_s) + 1)))
        timed_out = False
        try:
            out, err = proc.communicate(stdin.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    truncated = len(stdout) > max_output or len(stderr) > max_output
    code_ = proc.returncode
    if code_ is not None and code_ < 0 and -code_ == signal.SIGXCPU:
        timed_out = True
    return SandboxResult(stdout[:max_output], stderr[:max_output], code_, timed_out, truncated)
