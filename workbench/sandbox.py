"""Run untrusted Python (code written by the policy under training) in a bubblewrap sandbox.

Isolation (bubblewrap, Debian package `bubblewrap` >= 0.8, installed by scripts/setup.sh):
- new PID, mount, network, IPC, UTS (and cgroup) namespaces: no host process, socket (unix,
  abstract or TCP, 127.0.0.1 included) or hostname is reachable; `--die-with-parent`;
- the code runs as an unprivileged uid without capabilities and with no_new_privs. Started by a
  normal user, bwrap also gives it a user namespace (uid 65534 inside, the caller's uid outside).
  Started by root, bwrap runs in its privileged mode instead and the launcher below drops to a
  host uid of the sandbox's own (random, in SANDBOX_UIDS): a user namespace would map the sandbox
  to host uid 0, and the kernel exempts host root from RLIMIT_NPROC and lets it write global
  sysctls under /proc/sys (both seen here); a uid shared by every sandbox (65534) shared its task
  limit too, so one sandbox's threads starved its siblings (a way to lower their rewards);
- the filesystem is an empty read-only root with, read-only, only the interpreter, its stdlib
  (its site-packages hidden) and the system library directory; no /proc (through /proc/1/mem
  the code took over bwrap's PID 1 in its user-namespace mode, see _sandbox_pid1), a minimal
  /dev without ptys (each counts against the host's kernel.pty.max), and a private size-limited
  tmpfs /tmp as the work directory; task
  `files` are read-only inside it and copied afresh for every call; no inherited descriptors;
- a seccomp filter (libseccomp, via bwrap --seccomp) forbids new processes (fork, vfork, clone
  without CLONE_THREAD; threads are fine), new namespaces, memfds, kernel keyrings, SysV and
  POSIX IPC (a shared-memory segment outlives its detach, outside RLIMIT_AS: 1.5 GiB held under
  a 64 MiB limit), extended attributes (kernel memory too), and sockets other than unix and
  netlink (AF_VSOCK reaches the hypervisor's port space, which no network namespace covers; TCP
  and UDP buffers on cgroup v1 are charged to no memory cgroup). One
  process makes the rlimits whole-sandbox limits: address space, CPU seconds, file size, open
  files, tasks (MAX_TASKS), set by the launcher with hard == soft (CPU: hard = soft + 1 s, so the
  soft limit's SIGXCPU is seen), which the unprivileged code cannot raise; the filter also
  refuses io_uring, bpf, userfaultfd, perf_event_open, ptrace, process_vm_*, personality, kexec,
  file watches (inotify, fanotify, F_NOTIFY: they saw the host's file activity), kernel AIO (the
  host-wide fs.aio-max-nr) and byte-range locks (kernel memory no cgroup counts);
- where the caller can make a memory cgroup (root here; cgroup v1 or v2), each call runs in one of
  its own, limited to memory_mb + disk_mb + CGROUP_HEADROOM_MB, kernel memory included: a tmpfs's
  inodes and dentries, pipe and socket buffers, which no rlimit counts (~1 GiB in 4 s of empty
  directories under memory_mb=64). PID 1 joins it before it starts anything (--block-fd);
  joining costs ~10 ms a call on cgroup v1. Elsewhere (an unprivileged caller without a
  delegated cgroup) only the rlimits bound memory, and that kernel memory is not bounded;
- a wall-clock timeout kills bwrap's process group and the sandbox's PID 1 (by a pidfd from
  bwrap's --info-fd, also at every normal end), and the kernel then kills everything in the
  namespace; that PID 1 outlives bwrap by a moment and goes to the host's PID 1; where that is
  seen not to reap (_watch_host_reaper), the caller adopts orphans (PR_SET_CHILD_SUBREAPER) and
  reaps each sandbox's PID 1 itself; output is read incrementally and at most
  `max_output` characters per stream are kept; past OUTPUT_FLOOD_BYTES dropped the program is
  killed (its stderr ends saying so);
- the code is a read-only file (/run/main.py), not an argument: a single argument over 128 KiB
  (or one holding a NUL) failed the call itself (E2BIG, ValueError), and a failed call fails the
  episode, which the loop drops instead of scoring 0. Such code now fails in the interpreter.

Where the sandbox cannot be had (no bwrap, no libseccomp, namespaces refused), run_python raises
SandboxUnavailable. WORKBENCH_UNSAFE_NO_SANDBOX=1 (or unsafe_no_sandbox=True) runs the code
anyway, UNSANDBOXED: only `python -I -S`, the rlimits and the timeout, as the caller's uid (root
too, whom RLIMIT_NPROC does not bind); host files, network, processes and the caller's own
environment (/proc/<ppid>/environ) are then reachable, and the timeout kills the process group,
not a process the code moved to a session of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import functools
import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Mapping

UNSAFE_ENV = "WORKBENCH_UNSAFE_NO_SANDBOX"
NOBODY = 65534
WORKDIR = "/tmp"


class SandboxUnavailable(RuntimeError):
    pass


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # negative: killed by that signal
    timed_out: bool  # wall-clock timeout or CPU limit
    truncated: bool  # either stream cut at max_output
    # stdout alone cut (a grader reading stdout checks this one: a right program logging to stderr
    # past max_output was read as cut, its intact results line scored 0)
    stdout_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


# Runs first inside the sandbox (trusted): drop root if bwrap ran privileged, set the limits,
# then replace itself with a fresh interpreter for the untrusted code.
_LAUNCHER = """
import os, resource as r, sys
mem, cpu, fsize, uid, tasks = map(int, sys.argv[1:6])
if uid and os.getuid() == 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
for k, v in ((r.RLIMIT_AS, (mem, mem)), (r.RLIMIT_CPU, (cpu, cpu + 1)), (r.RLIMIT_FSIZE, (fsize, fsize)),
             (r.RLIMIT_NOFILE, (256, 256)), (r.RLIMIT_CORE, (0, 0)), (r.RLIMIT_NPROC, (tasks, tasks))):
    r.setrlimit(k, v)
os.write(2, b"\\0workbench: code starts\\0")  # (STARTED: what the caller tells a set-up failure by)
# -u: unbuffered, so what the code printed before a timeout kill or os._exit is not lost
os.execv(sys.executable, [sys.executable, "-I", "-S", "-u", sys.argv[6]])
"""
CODE_PATH = "/run/main.py"  # where the code is, read-only, inside the sandbox
# The launcher's last word on stderr before the code's interpreter replaces it. Missing, the code
# never ran (bwrap or the launcher failed, or the start outlasted the timeout under load): that is
# the host's failure, raised as SandboxUnavailable, not an exit 1 the grader scored 0 as the
# policy's (a broken host then never showed as failed episodes). The code can write it too, but
# only once it runs, which is what it says.
STARTED = b"\0workbench: code starts\0"
START_S = 10.0  # what the sandbox's set-up may take before its code starts (its own timeout runs from there)
# Threads (tasks) of the sandbox's uid: RLIMIT_NPROC. Threads are allowed and a raw clone() thread
# needs no stack, so the memory limit does not bound them: one sandbox made 8,000 host tasks in
# 0.1 s (pid_max was 32,768). As root, the count is that of the host uid the sandbox runs as, drawn
# for it from SANDBOX_UIDS (no account has them). Rootless, the sandbox's own user namespace's, and
# (Linux 5.14+ charges every level) the caller's uid's too: concurrent sandboxes share the runner
# user's `ulimit -u` with its own processes (checked once: _warn_low_nproc).
MAX_TASKS = 64
SANDBOX_UIDS = range(1_000_000, 2_000_000)


# calls newer than some libseccomp releases (2.5.4 cannot name setxattrat, which kernel 6.13+ has:
# skipped by name, the filter let it through), filtered by number where the name is unknown; since
# Linux 5.1 (number 424) a new call has one number on every architecture
NEWER_SYSCALLS = {"setxattrat": 463, "memfd_secret": 447, "process_madvise": 440, "pidfd_getfd": 438,
                  "pidfd_open": 434, "pidfd_send_signal": 424}


@functools.lru_cache(maxsize=1)
def _seccomp_program() -> bytes:
    """The compiled BPF filter (libseccomp: native arch only, other arches' syscalls are killed)."""
    path = ctypes.util.find_library("seccomp")
    if path is None:
        raise SandboxUnavailable("libseccomp is missing (Debian package libseccomp2)")
    lib = ctypes.CDLL(path)

    class Cmp(ctypes.Structure):  # struct scmp_arg_cmp
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp)]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    allow, deny = 0x7FFF0000, lambda e: 0x00050000 | e  # SCMP_ACT_ALLOW, SCMP_ACT_ERRNO(e)
    # besides new processes, namespaces, memfds and keyrings: kernel interfaces the code has no use
    # for and that widen what a kernel bug exposes (io_uring, bpf, userfaultfd, perf, ptrace, ...)
    rules = [(n, deny(errno.EPERM), None) for n in
             ("fork", "vfork", "unshare", "setns", "memfd_create", "add_key", "keyctl", "request_key",
              "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "userfaultfd", "perf_event_open",
              "ptrace", "process_vm_readv", "process_vm_writev", "personality", "kexec_load", "kexec_file_load",
              "shmget", "shmat", "msgget", "msgsnd", "semget", "mq_open",
              # extended attributes live in kernel memory, outside RLIMIT_AS and the tmpfs size: 2 GiB of
              # user.* attributes on /tmp in 0.8 s under a 64 MiB limit (host slab +4 GiB)
              "setxattr", "lsetxattr", "fsetxattr", "setxattrat",
              # memfd_secret's pages stay with its file after munmap, outside RLIMIT_AS (1 GiB held under a
              # 64 MiB limit where no memory cgroup bounds it), as memfd_create's would
              "memfd_secret",
              # another process's descriptors and memory: rootless, the sandbox's pid 1 (bwrap) runs as the
              # code's own uid, and pidfd_getfd took its descriptors (its exit-status eventfd among them)
              "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "kcmp", "process_madvise",
              # inotify instances count against the caller's uid (rootless: the runner's own, 128 of them:
              # its next inotify_init failed while the sandbox lived), and a watch on the read-only binds
              # saw the host's file activity; fanotify (FAN_REPORT_FID works unprivileged) as well
              "inotify_init", "inotify_init1", "fanotify_init", "fanotify_mark",
              # kernel AIO: its events come out of the host-wide fs.aio-max-nr, which one sandbox took
              # whole (65,536: every libaio user on the host got EAGAIN while it lived)
              "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_cancel", "io_destroy")]
    # fcntl: F_NOTIFY (dnotify saw the host's file activity, as inotify did) and byte-range locks
    # (F_SETLK, F_SETLKW, F_OFD_SETLK, F_OFD_SETLKW: their kernel structs are charged to no memory
    # cgroup, 375,000 locks, 72 MB, in 3 s under a 97 MB limit). EPERM, not ENOLCK: sqlite on a file
    # retried ENOLCK until the timeout; with EPERM it fails at once (flock and in-memory sqlite work)
    # and F_SETLEASE (a lease is told when the host opens a bound file to write it). The kernel reads
    # cmd as 32 bits: compared on its low 32 (an equality on all 64 let cmd | 1 << 32 through)
    rules += [("fcntl", deny(errno.EPERM), Cmp(1, 7, 0xFFFFFFFF, cmd)) for cmd in (0x402, 6, 7, 37, 38, 1024)]
    rules.append(("clone", deny(errno.EPERM), Cmp(0, 7, 0x10000, 0)))  # (flags & CLONE_THREAD) == 0
    # socket(family, ...): AF_UNIX 1 and AF_NETLINK 16 (glibc's getaddrinfo reads interfaces through
    # it; it sees only the sandbox's network namespace); others refused. AF_INET 2 and AF_INET6 10
    # too: the namespace has only its own loopback, and on cgroup v1 TCP and UDP buffers are charged
    # to no memory cgroup (one sandbox queued 629 MB of TCP and 396 MB of UDP to itself under a
    # 104 MB limit, in the host's tcp_mem/udp_mem that every other socket shares)
    eq, ge = 4, 5  # SCMP_CMP_EQ, SCMP_CMP_GE
    rules += [("socket", deny(errno.EAFNOSUPPORT), Cmp(0, eq, f, 0)) for f in (0, *range(2, 16))]
    rules.append(("socket", deny(errno.EAFNOSUPPORT), Cmp(0, ge, 17, 0)))
    # of netlink, NETLINK_ROUTE (protocol 0) only: as root the sandbox's network namespace belongs to
    # the initial user namespace, and NETLINK_KOBJECT_UEVENT (15) then delivered the host's device events
    ne = 1  # SCMP_CMP_NE
    rules.append(("socket", deny(errno.EPROTONOSUPPORT), (Cmp(0, eq, 16, 0), Cmp(2, ne, 0, 0))))
    # socketpair: AF_UNIX only (another family made the kernel load its module where it can: AF_TIPC
    # gave a working pair)
    rules.append(("socketpair", deny(errno.EAFNOSUPPORT), Cmp(0, ne, 1, 0)))
    rules.append(("clone3", deny(errno.ENOSYS), None))  # its flags are behind a pointer; glibc falls back to clone
    ctx = lib.seccomp_init(allow)
    fd = os.memfd_create("seccomp")
    try:
        for name, action, cmp in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0 and name in NEWER_SYSCALLS:  # a libseccomp older than the call
                nr = NEWER_SYSCALLS[name]
            cmps = () if cmp is None else cmp if isinstance(cmp, tuple) else (cmp,)  # (several: all must hold)
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), (Cmp * len(cmps))(*cmps) if cmps else None)
            if rc < 0:
                raise SandboxUnavailable(f"libseccomp: cannot add a rule for {name} ({os.strerror(-rc)})")
        if lib.seccomp_export_bpf(ctx, fd) < 0:
            raise SandboxUnavailable("libseccomp: cannot export the filter")
        os.lseek(fd, 0, os.SEEK_SET)
        return _read_all(fd)
    finally:
        lib.seccomp_release(ctx)
        os.close(fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _data_fd(data: bytes) -> int:
    fd = os.memfd_create("sandbox-data")
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.lru_cache(maxsize=1)
def _interpreter() -> tuple[str, tuple[str, ...]]:
    """The base interpreter (a venv's python is a symlink into it) and the bwrap options that show
    it, read-only: the binary, its stdlib with lib-dynload, libpython, the system libraries."""
    exe = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    stdlib = os.path.realpath(os.path.dirname(os.__file__))
    binds = [exe, stdlib]
    dynload = sysconfig.get_config_var("DESTSHARED")
    if dynload and os.path.isdir(dynload) and not os.path.realpath(dynload).startswith(stdlib + "/"):
        binds.append(os.path.realpath(dynload))
    libdir, soname = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libdir and soname and os.path.exists(os.path.join(libdir, soname)):
        binds.append(os.path.join(libdir, soname))  # where the interpreter's RUNPATH looks for it
    arch = sysconfig.get_config_var("MULTIARCH") or ""
    opts: list[str] = []
    for d in ("/lib", "/lib64", "/usr/lib", "/usr/lib64"):
        if os.path.islink(d):  # merged /usr
            opts += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            binds.append(os.path.join(d, arch) if arch and os.path.isdir(os.path.join(d, arch)) else d)
    # bwrap would create the mount points' parents 0700 (root's, in its privileged mode)
    parents = sorted({p for b in binds for p in _parents(b)} - set(binds))
    opts = [a for p in parents for a in ("--perms", "0755", "--dir", p)] + opts
    for b in sorted(set(binds)):  # a directory before what lies inside it
        opts += ["--ro-bind", os.path.realpath(b), b]
    if os.path.isdir(os.path.join(stdlib, "site-packages")):  # the base install's packages stay out
        opts += ["--perms", "0555", "--size", "4096", "--tmpfs", os.path.join(stdlib, "site-packages")]
    return exe, tuple(opts)


def _parents(path: str) -> list[str]:
    out, p = [], os.path.dirname(path)
    while p not in ("/", ""):
        out.append(p)
        p = os.path.dirname(p)
    return out


def _bwrap_args(bwrap: str, disk_mb: int, seccomp_fd: int, file_fds: dict[str, int], code_fd: int,
                info_fd: int, block_fd: int | None) -> list[str]:
    exe, view = _interpreter()
    if os.geteuid() == 0:  # privileged mode; the launcher drops to the sandbox's own uid (see the module doc)
        ns = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
              "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        ns = ["--unshare-all", "--unshare-user", "--disable-userns", "--uid", str(NOBODY), "--gid", str(NOBODY)]
    # (/dev/pts empty and read-only: bwrap's devpts gave /dev/ptmx, and each pty opened counts against
    # the host-wide kernel.pty.max, 253 a sandbox)
    args = [bwrap, *ns, "--hostname", "sandbox", *view, "--dev", "/dev", "--tmpfs", "/dev/pts", "--remount-ro", "/dev/pts",
            "--perms", "1777", "--size", str(disk_mb << 20), "--tmpfs", WORKDIR,
            "--perms", "0755", "--dir", os.path.dirname(CODE_PATH), "--perms", "0444", "--ro-bind-data", str(code_fd), CODE_PATH]
    for name, fd in file_fds.items():
        dest = os.path.join(WORKDIR, name)
        for p in reversed(_parents(dest)):
            if p != WORKDIR:
                args += ["--perms", "0755", "--dir", p]
        args += ["--perms", "0444", "--ro-bind-data", str(fd), dest]
    # bwrap's own root and /dev are unlimited tmpfs: read-only, or they are a way round disk_mb
    # --block-fd: PID 1 waits (before it starts the launcher) until it is in the sandbox's cgroup
    block = [] if block_fd is None else ["--block-fd", str(block_fd)]
    return args + ["--remount-ro", "/", "--remount-ro", "/dev", "--chdir", WORKDIR, "--new-session",
                   "--die-with-parent", "--info-fd", str(info_fd), *block, "--seccomp", str(seccomp_fd), exe]


_SANDBOX_OK: list[bool] = []  # set once the sandbox has run here


def _sandbox_problem() -> str | None:
    """Why the sandbox cannot run here (checked by running it), or None. Only success is
    remembered: a check that failed once under load (its 10 s limit) is tried again next call,
    where caching it sent every later call to the unsandboxed fallback, if one was allowed."""
    if _SANDBOX_OK:
        return None
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (Debian package `bubblewrap`: apt-get install -y bubblewrap)"
    try:
        r = _run(bwrap, "print('ok')", 10.0, 128, 200, b"", {}, 16)
    except (SandboxUnavailable, OSError) as e:
        return str(e)
    if r.stdout.strip() != "ok":
        return f"bwrap failed here (exit {r.exit_code}): {r.stderr.strip()[:500]}"
    _SANDBOX_OK.append(True)
    return None


def check_sandbox() -> None:
    """Raise SandboxUnavailable (saying why) unless run_python can sandbox code here."""
    problem = _sandbox_problem()
    if problem:
        raise SandboxUnavailable(problem)


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 256, max_output: int = 4096,
               stdin: str = "", *, files: Mapping[str, str | bytes] | None = None, disk_mb: int = 64,
               unsafe_no_sandbox: bool | None = None) -> SandboxResult:
    """Run `code` (a file, /run/main.py, run by `python -I -S`) in the sandbox (see the module doc) and return its output,
    each stream cut to `max_output` characters. `files` ({relative path: content}) are put
    read-only in the work directory (the code's cwd, /tmp: a tmpfs of `disk_mb` MiB, in memory); nothing the
    code writes survives the call. No subprocesses; threads share the `memory_mb` address space.

    Raises SandboxUnavailable where the sandbox cannot run, unless `unsafe_no_sandbox` (default:
    the environment variable WORKBENCH_UNSAFE_NO_SANDBOX=1) allows running the code UNSANDBOXED.
    """
    payload = {}
    for name, data in (files or {}).items():
        norm = os.path.normpath(name)
        if os.path.isabs(norm) or norm.split(os.sep)[0] in ("..", "."):
            raise ValueError(f"files: {name!r} is not a path inside the work directory")
        payload[norm] = data.encode() if isinstance(data, str) else bytes(data)
    problem = _sandbox_problem()
    if problem is None:
        return _run(shutil.which("bwrap"), code, timeout_s, memory_mb, max_output, stdin.encode(), payload, disk_mb)
    if unsafe_no_sandbox is None:
        unsafe_no_sandbox = os.environ.get(UNSAFE_ENV) == "1"
    if not unsafe_no_sandbox:
        raise SandboxUnavailable(f"refusing to run untrusted code without the sandbox: {problem}. "
                                 f"Set {UNSAFE_ENV}=1 to run it UNSANDBOXED.")
    warnings.warn(f"running untrusted code UNSANDBOXED ({UNSAFE_ENV}): {problem}", RuntimeWarning, stacklevel=2)
    return _run(None, code, timeout_s, memory_mb, max_output, stdin.encode(), payload, disk_mb)


def _run(bwrap: str | None, code: str, timeout_s: float, memory_mb: int, max_output: int,
         stdin: bytes, files: dict[str, bytes], disk_mb: int) -> SandboxResult:
    global _reaper_watched
    exe = _interpreter()[0]
    limits = [str(memory_mb << 20), str(int(timeout_s) + 1), str(disk_mb << 20)]
    # one malloc arena: glibc reserves 64 MB of address space an arena, a thread each, all under
    # RLIMIT_AS: 6 threads were all a 256 MB program could start (a ThreadPoolExecutor of 8 failed)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORKDIR, "MALLOC_ARENA_MAX": "1"}
    # a lone surrogate goes in as written: the interpreter refuses it (a failed run, not a failed call)
    source = code.encode("utf-8", "surrogatepass")
    # (0: the launcher keeps its uid. Unsandboxed it must: an interpreter under /root is not
    # executable by another uid, and without the sandbox nothing shows it elsewhere)
    uid = _take_uid() if os.geteuid() == 0 and bwrap is not None else 0
    fds: list[int] = []
    tmp = info_read = block_write = cgroup = None
    try:
        if bwrap is not None:
            if os.geteuid() != 0:
                _warn_low_nproc()
            fds.append(_data_fd(_seccomp_program()))
            fds.append(_data_fd(source))
            file_fds = {name: _data_fd(data) for name, data in files.items()}
            fds += file_fds.values()
            info_read, info_write = os.pipe()  # bwrap writes the sandbox's PID 1 there (its host pid)
            fds.append(info_write)
            # the whole sandbox's memory, the kernel's for it included (inodes, pipes, sockets), where
            # the caller can make a memory cgroup: RLIMIT_AS bounds only each process's own mappings
            cgroup = _new_memory_cgroup((memory_mb + disk_mb + CGROUP_HEADROOM_MB) << 20)
            if cgroup is None and uid:
                _warn_no_cgroup()
            if cgroup is not None:
                block_read, block_write = os.pipe()
                fds.append(block_read)
            cmd, cwd, path = (_bwrap_args(bwrap, disk_mb, fds[0], file_fds, fds[1], info_write,
                                          None if cgroup is None else block_read), None, CODE_PATH)
        else:
            tmp = tempfile.TemporaryDirectory(prefix="workbench-unsafe-")
            cwd, env["HOME"] = os.path.join(tmp.name, "work"), os.path.join(tmp.name, "work")
            os.mkdir(cwd)
            path = os.path.join(tmp.name, "main.py")
            with open(path, "wb") as f:
                f.write(source)
            os.chmod(path, 0o444)
            for name, data in files.items():
                os.makedirs(os.path.dirname(os.path.join(cwd, name)), exist_ok=True)
                with open(os.path.join(cwd, name), "wb") as f:
                    f.write(data)
                os.chmod(os.path.join(cwd, name), 0o444)
            cmd = [exe]
        cmd += ["-I", "-S", "-c", _LAUNCHER, *limits, str(uid), str(MAX_TASKS), path]
        adopted = bwrap is not None and _adopting_orphans()  # this call's init comes here (_watch_host_reaper)
        adopted_since = _adoptions
        # a session of its own: the timeout kills the group (bwrap, and with it the sandbox)
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, pass_fds=fds, start_new_session=True)
        for fd in fds:
            os.close(fd)
        fds = []
        # the set-up (bwrap's namespaces, the launcher's Python) has START_S; the code's timeout_s runs
        # from its start (STARTED): from Popen, a short timeout (a code agent's last 10 ms of budget, a
        # busy runner) ran out before the code began, read as a broken sandbox (SandboxUnavailable, the
        # episode failed and dropped, not scored 0), and a program that exited 0 as timed out
        deadline = time.monotonic() + START_S
        pid1 = _sandbox_pid1(info_read, deadline) if info_read is not None else None
        first_pid1 = pid1 is not None and _host_reaps is None and not adopted and not _reaper_watched
        _reaper_watched = _reaper_watched or first_pid1
        try:
            if block_write is not None and pid1 is not None:  # (None: bwrap failed first; _communicate reads why)
                try:  # PID 1 (and so all it starts) into the cgroup, then let it go on
                    _join_cgroup(cgroup, pid1[0])
                except OSError as e:
                    raise SandboxUnavailable(f"cannot put the sandbox into its memory cgroup {cgroup}: {e}") from e
                with contextlib.suppress(BrokenPipeError):  # bwrap died meanwhile: _communicate reads why
                    os.write(block_write, b"1")
            out, err, dropped, timed_out, flooded = _communicate(proc, stdin, deadline, 4 * max_output + 4 + len(STARTED),
                                                                 OUTPUT_FLOOD_BYTES, started=(STARTED, timeout_s))
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        finally:
            # adopted: bwrap has exited and its init may be this process's child (then its pid is not reused
            # before it is reaped here; a waitpid on another's fails). The flag read again: a watch that
            # started during the call set it, one that ended may have cleared it since
            adopted = proc.returncode is not None and (adopted or _adopting or _adoptions != adopted_since)
            if pid1 is None and adopted and info_read is not None:
                # bwrap said nothing in time (a loaded host) and has exited: what it wrote is there now, and
                # its init, adopted, is this process's child (its pid is not reused before it is reaped here)
                pid1 = _sandbox_pid1(info_read, time.monotonic())
            if pid1 is not None:  # whatever happened: the namespace's PID 1 goes, and the namespace with it
                _kill_pid1(*pid1, reap=adopted)
                if first_pid1:  # does the host reap what bwrap leaves? (an init bwrap reaped itself says nothing)
                    _start_watch(pid1[0] if proc.returncode is not None and _proc_state(pid1[0]) is not None else None)
    finally:
        for fd in fds + [f for f in (info_read, block_write) if f is not None]:
            os.close(fd)
        if cgroup is not None:
            _remove_cgroup(cgroup)
        if tmp is not None:
            tmp.cleanup()
        with _uids_freed:
            _uids_in_use.discard(uid)
            _uids_freed.notify()
    rc = proc.returncode
    started = err.find(STARTED)
    if started < 0:
        said = err.decode(errors="replace").strip()[-500:]
        raise SandboxUnavailable(f"the sandbox did not start the code (exit {rc}"
                                 f"{f', not started within {START_S:g} s' if timed_out else ''}): {said or 'nothing said'}")
    err = err[:started] + err[started + len(STARTED):]  # (bwrap's own words before it, none when it worked)
    if bwrap is not None and rc is not None and 128 < rc < 128 + signal.NSIG:
        rc = 128 - rc  # bwrap reports a signal death as 128 + signal
    timed_out = timed_out or rc == -signal.SIGXCPU
    stdout, stderr = out.decode(errors="replace"), err.decode(errors="replace")
    truncated = dropped or len(stdout) > max_output or len(stderr) > max_output
    stderr = stderr[:max_output]
    if flooded:  # said where the agent reads (a code agent hands stderr to the model)
        note = f"\n[sandbox: killed after more than {OUTPUT_FLOOD_BYTES >> 20} MiB of output past what is kept]"
        stderr = stderr[:max(0, max_output - len(note))] + note
    # (a stream dropped past its 4 * max_output + 4 kept bytes decodes to more than max_output characters)
    return SandboxResult(stdout[:max_output], stderr, rc, timed_out, truncated, len(stdout) > max_output)


# output dropped past what is kept (max_output per stream) after which the program is killed: a
# policy printing in a loop cost the runner's thread reading it, up to the timeout, every episode
OUTPUT_FLOOD_BYTES = 8 << 20

_uids_in_use: set[int] = set()
_uids_freed = threading.Condition()  # guards _uids_in_use; told when a sandbox gives its uid back


@functools.lru_cache(maxsize=1)
def _namespace_uids() -> range | None:
    """The uids a sandbox may run as, for a root caller: None as the host's root (SANDBOX_UIDS). Root of
    a user namespace (rootless Docker/Podman, Kubernetes user namespaces, enroot) has only the ids
    its maps name: the launcher's setuid to 1,000,000+ failed there (EINVAL) and the sandbox never
    ran. There, the top of the largest range both maps name (below nobody, 65534)."""
    def spans(path: str) -> list[tuple[int, int]]:
        with open(path) as f:
            return [(int(a), int(a) + int(n)) for a, _, n in (line.split() for line in f if line.strip())]

    try:
        uids, gids = spans("/proc/self/uid_map"), spans("/proc/self/gid_map")
    except OSError:  # (no /proc: nothing says otherwise)
        return None
    if (0, 4294967295) in uids:  # ("0 0 4294967295": the host's own ids)
        return None
    both = [(max(a, c, 1), min(b, d, 65534)) for a, b in uids for c, d in gids]
    lo, hi = max(both, key=lambda s: s[1] - s[0], default=(0, 0))
    if hi - lo < 16:
        raise SandboxUnavailable(f"running as root of a user namespace that maps no other uids (uid_map {uids}, "
                                 f"gid_map {gids}): the sandbox's code cannot run as a uid of its own. Run as a "
                                 f"non-root user, or map a range of ids into the namespace")
    return range(max(lo, hi - 20_000), hi)


UID_SLICES = 64  # a process's uids: one slice of the pool, none of another process's (UID_SLICES of them)
MIN_SLICE = 64  # ... where each slice would hold this many; a smaller pool is shared whole (a slice past
# a 32-id map's end was empty: every sandbox of that process failed)


@functools.lru_cache(maxsize=1)
def _own_uids() -> range:
    """This process's slice of the uid pool, held by an flock on the slice's file for the process's
    life: a runner's uids were unique among its own sandboxes only, and 8 runners of 64 sandboxes
    drew the same one now and then (~6 pairs at any moment from a user namespace's 20,000), two
    sandboxes then sharing one RLIMIT_NPROC. The whole pool where every slice is held."""
    import fcntl
    import tempfile

    pool = _namespace_uids() or SANDBOX_UIDS
    if len(pool) < UID_SLICES * MIN_SLICE:
        return pool
    where = os.path.join(tempfile.gettempdir(), "workbench-sandbox-uids")
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        for k in range(UID_SLICES):
            fd = os.open(os.path.join(where, f"slice-{k}"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (released by the kernel when the process ends)
                return pool[k::UID_SLICES]  # (the fd stays open: the slice stays this process's)
            except BlockingIOError:
                os.close(fd)
    except OSError:
        pass
    return pool


def _take_uid() -> int:
    """A host uid for one sandbox, none of this process's running ones (nor another process's: its
    slice of the pool, _own_uids): two that drew the same shared one RLIMIT_NPROC (MAX_TASKS), and
    one could starve the other of threads."""
    pool = _own_uids()
    with _uids_freed:
        # every uid of the pool running (a small namespace map): wait for one back, not spin holding the lock
        _uids_freed.wait_for(lambda: sum(u in pool for u in _uids_in_use) < len(pool))
        while True:
            uid = secrets.choice(pool)
            if uid not in _uids_in_use:
                _uids_in_use.add(uid)
                return uid


@functools.lru_cache(maxsize=1)
def _warn_low_nproc(concurrent: int = 64) -> None:
    """Once a process, rootless: the sandboxes' tasks count against the caller's RLIMIT_NPROC (the
    kernel charges a user namespace's tasks to its owner too), so a low limit (4096 is common) lets
    concurrent sandboxes starve each other of threads and the runner's user of processes (EAGAIN)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    need = concurrent * (MAX_TASKS + 2)
    if soft != resource.RLIM_INFINITY and soft < 4 * need:
        warnings.warn(f"workbench.sandbox: this user's process limit (ulimit -u: {soft}) is shared by every rootless "
                      f"sandbox's tasks (up to {MAX_TASKS} each) and the user's own processes: {concurrent} sandboxes "
                      f"at once may take {need}. Raise it (limits.conf nproc) where code agents run many episodes at "
                      f"once", RuntimeWarning, stacklevel=3)


@functools.lru_cache(maxsize=1)
def _warn_no_cgroup() -> None:
    """Once a process: as root without a memory cgroup (no controller, or cgroup v2 refusing to
    enable it under a cgroup that holds processes) the kernel's memory for the sandbox (inodes,
    pipes, sockets, memfd-like holds) is bounded by nothing but the syscall filter."""
    warnings.warn("workbench.sandbox: no memory cgroup could be made here, so the kernel memory a sandbox takes is "
                  "unbounded (only RLIMIT_AS bounds its own mappings); give this process a cgroup it can make "
                  "children in (cgroup v2: a leaf cgroup with the memory controller enabled)", RuntimeWarning, stacklevel=3)


def _sandbox_pid1(info_fd: int, deadline: float) -> tuple[int, int | None] | None:
    """The host pid of the sandbox's PID 1 and a pidfd of it (None where one cannot be had), from
    bwrap's --info-fd ({"child-pid": N}), or None (bwrap failed first). Killing the process group reaches bwrap, and PID 1 dies with it by its
    parent-death signal, which PID 1 itself could undo: where the code could write PID 1's memory
    (bwrap's user-namespace mode runs PID 1 as the code's uid; /proc is no longer mounted), it
    cleared that signal, left the group, and ran on, unlimited, after the call returned."""
    data = b""
    with selectors.DefaultSelector() as sel:
        sel.register(info_fd, selectors.EVENT_READ)
        while b"}" not in data and sel.select(max(0.0, deadline - time.monotonic())):
            chunk = os.read(info_fd, 4096)
            if not chunk:
                break
            data += chunk
    try:
        pid = int(json.loads(data)["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None
    try:
        return pid, os.pidfd_open(pid)
    except OSError:  # no pidfds (EMFILE, an old kernel): by pid (once bwrap has exited, pid 1 is init's
        # child, not ours: a pid reused in that moment is the one risk, which a pidfd has not)
        return pid, None


# A sandbox's memory cgroup holds memory_mb + disk_mb (its tmpfs pages are charged to it) + this
# for bwrap's two processes and the kernel's structures
CGROUP_HEADROOM_MB = 32


@functools.lru_cache(maxsize=1)
def _memory_cgroup_parent() -> str | None:
    """The caller's own memory cgroup directory (cgroup v1's memory hierarchy, or v2's unified one),
    under which each sandbox gets a child, or None where there is none to write (not root, no
    delegation): then only the rlimits bound memory, and kernel memory is not bounded (see
    _new_memory_cgroup)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = "/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory") else "/sys/fs/cgroup"
        elif controllers == "" and os.path.isfile("/sys/fs/cgroup/cgroup.controllers"):
            base = "/sys/fs/cgroup"
        else:
            continue
        parent = base + path.rstrip("/")
        if os.access(parent, os.W_OK):
            _remove_stale_cgroups(parent)
            return parent
    return None


def _remove_stale_cgroups(parent: str) -> None:
    """The empty cgroups of callers that were killed mid-run (nothing removed theirs)."""
    for name in os.listdir(parent):
        if name.startswith("workbench-sandbox-"):
            try:
                os.kill(int(name.split("-")[2]), 0)
            except (ValueError, IndexError):
                continue
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(parent, name))
            except PermissionError:  # alive, another user's
                pass


def _new_memory_cgroup(limit: int) -> str | None:
    """A fresh memory cgroup limited to `limit` bytes (kernel memory included: a tmpfs's inodes and
    dentries, pipes, socket buffers), or None where one cannot be made here. Without it, one
    sandbox held ~1 GiB of kernel memory in 4 s under memory_mb=64, disk_mb=1 (773,000 empty
    directories), outside every rlimit and the tmpfs size; four at once could take this host's RAM,
    and the kernel's OOM killer then picks the largest process: the trainer or vLLM."""
    parent = _memory_cgroup_parent()
    if parent is None:
        return None
    path = os.path.join(parent, f"workbench-sandbox-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        os.mkdir(path)
    except OSError:
        return None
    if not os.path.exists(os.path.join(path, "memory.max")) and os.path.isfile(os.path.join(parent, "cgroup.subtree_control")):
        # v2: the children of a cgroup get the memory controller only where it enables it (refused where
        # it holds processes itself, unless it is the root of a cgroup namespace: a container's)
        with contextlib.suppress(OSError), open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write("+memory")
    # v2, v1; then swap: no more than that either, or the limit only moves pages out
    for name, swap, swap_limit in (("memory.max", "memory.swap.max", "0"),
                                   ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", str(limit))):
        try:
            with open(os.path.join(path, name), "w") as f:
                f.write(str(limit))
        except OSError:
            continue
        with contextlib.suppress(OSError), open(os.path.join(path, swap), "w") as f:
            f.write(swap_limit)
        return path
    _remove_cgroup(path)  # no memory controller there
    return None


def _join_cgroup(path: str, pid: int) -> None:
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(pid))


def _remove_cgroup(path: str) -> None:
    """rmdir, once the killed sandbox's processes are gone from it (they are being reaped)."""
    for _ in range(1000):  # usually free at once or after one wait
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.001)
    warnings.warn(f"sandbox cgroup {path} still holds processes; left in place", RuntimeWarning, stacklevel=2)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
# how long _kill_pid1 waits for the killed PID 1 to exit before leaving it (it exits at once: SIGKILL)
REAP_WAIT_S = 2.0
# how long the first orphaned PID 1 may stay a zombie before the host's PID 1 is taken not to reap
HOST_REAP_WAIT_S = 10.0

# bwrap exits as soon as the code's process does, before its init (the sandbox's PID 1) has: that init,
# orphaned, goes to the host's PID 1, which under `docker run` without --init (a Python or Ray PID 1)
# reaps nothing: a zombie every call, until the pids ran out. Whether the host reaps is watched once,
# on the first such init (_watch_host_reaper); where it does not, this process adopts its orphaned
# descendants (PR_SET_CHILD_SUBREAPER) and _kill_pid1 reaps each sandbox's init. Not where the host
# reaps: adopted, every other orphan of this process's descendants (a daemon an agent's shell command
# left) became a zombie here, since reaping any child but a known one takes an exit status from the
# Popen that waits for it. Where the host does not reap, those were zombies of its PID 1 anyway.
_host_reaps: bool | None = None  # None: not known yet
_adopting = False  # the flag is set (a forked child's is not: the kernel clears it)
_reaper_watched = False  # a watch was started (again once one ends without knowing)
_adoptions = 0  # times the flag was set


def _subreaper(on: bool) -> bool:
    """Set or clear this process's PR_SET_CHILD_SUBREAPER flag; whether it is set now."""
    global _adopting, _adoptions
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0:
            _adoptions += on and not _adopting
            _adopting = on
    except (OSError, AttributeError):
        pass
    return _adopting


def _adopting_orphans() -> bool:
    """Whether this process adopts its orphaned descendants now: while a watch runs (_start_watch) and
    where the host's PID 1 was seen not to reap (asked again in a forked child, whose flag the kernel
    cleared)."""
    if not _adopting and _host_reaps is False:
        _subreaper(True)
    return _adopting


def _forked() -> None:
    global _adopting, _reaper_watched
    _adopting = False
    if _host_reaps is None:  # (the watch thread is the parent's: this process watches its own)
        _reaper_watched = False


os.register_at_fork(after_in_child=_forked)


def _proc_state(pid: int) -> str | None:
    """A process's state letter ("Z": a zombie), None once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _start_watch(pid: int | None) -> None:
    """Watch `pid`, the first sandbox init orphaned to the host (None: there was none: bwrap had not
    exited, or had reaped its init itself; the next call's is watched), in a thread; meanwhile this
    process adopts, so that the calls made during the watch are reaped here whatever the verdict.
    A thread that cannot start (no threads left): not watched yet."""
    global _reaper_watched
    if pid is None:
        _reaper_watched = False
        return
    _subreaper(True)
    try:
        threading.Thread(target=_watch_host_reaper, args=(pid,), name="sandbox-reaper-watch", daemon=True).start()
    except RuntimeError:
        _reaper_watched = False
        _subreaper(False)


def _watch_host_reaper(pid: int, wait_s: float | None = None) -> bool:
    """Watch the first sandbox init orphaned to the host (`pid`, killed): reaped within `wait_s`
    (HOST_REAP_WAIT_S), the host reaps, and this process stops adopting (an orphan adopted during
    the watch stays here unreaped, as a sandbox's init does not: _kill_pid1 reaped those); still a
    zombie, the host does not, and this process adopts from then on. Whether it adopts now."""
    global _host_reaps, _reaper_watched
    deadline, state = time.monotonic() + (HOST_REAP_WAIT_S if wait_s is None else wait_s), None
    while time.monotonic() < deadline:
        state = _proc_state(pid)
        if state is None:  # reaped
            _host_reaps = True
            return _subreaper(False)
        time.sleep(0.05)
    if state == "Z":
        _host_reaps = False
        return _subreaper(True)
    _reaper_watched = False  # (still alive: not known yet; a later call watches its own)
    return _subreaper(False)


def _kill_pid1(pid: int, pidfd: int | None, reap: bool = False) -> bool:
    """Kill the sandbox's PID 1; `reap`: bwrap has exited and this process adopts orphans, so that
    PID 1 is this process's child now: wait for it (its pid is not reused before that wait).
    Whether it was reaped here."""
    try:
        if pidfd is None:
            os.kill(pid, signal.SIGKILL)
        else:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)  # a pidfd never names a reused pid
    except ProcessLookupError:  # gone already
        pass
    finally:
        if pidfd is not None:
            os.close(pidfd)
    deadline = time.monotonic() + REAP_WAIT_S
    while reap:
        try:
            reaped, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:  # not this process's child (reaped, or adopted elsewhere): nothing to do
            return False
        if reaped:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return False


def _communicate(proc: subprocess.Popen, stdin: bytes, deadline: float, keep: int, flood: int = 1 << 62,
                 started: tuple[bytes, float] | None = None):
    """Like Popen.communicate with a deadline, but keeping at most `keep` bytes per stream (the
    rest is read and dropped, so a flood costs time, not memory). At the deadline it kills the
    process group and drains for at most a second more; so it does once `flood` bytes were
    dropped (a program printing in a loop held the caller's thread reading until its timeout).
    `started` (marker, seconds): once stderr holds the marker, the deadline is that many seconds
    from then. (out, err, dropped, timed_out, flooded)."""
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    sel = selectors.DefaultSelector()
    for f in bufs:
        os.set_blocking(f.fileno(), False)
        sel.register(f, selectors.EVENT_READ)
    pending = memoryview(stdin)
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    dropped = timed_out = flooded = False
    dropped_bytes = 0
    try:
        while True:
            if dropped_bytes > flood and not flooded:
                flooded = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                deadline = min(deadline, time.monotonic() + 1.0)  # the drain, as after a timeout
            left = deadline - time.monotonic()
            if left > 0 and sel.get_map():
                for key, _ in sel.select(left):
                    f = key.fileobj
                    if f is proc.stdin:
                        try:
                            pending = pending[os.write(f.fileno(), pending[:1 << 16]):]
                        except BlockingIOError:
                            continue
                        except BrokenPipeError:
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(f)
                            f.close()
                        continue
                    chunk = os.read(f.fileno(), 1 << 16)
                    if not chunk:
                        sel.unregister(f)
                    buf = bufs[f]
                    room = max(0, keep - len(buf))
                    dropped = dropped or len(chunk) > room
                    dropped_bytes += max(0, len(chunk) - room)
                    buf += chunk[:room]
                    if started is not None and f is proc.stderr and started[0] in buf:
                        deadline, started = time.monotonic() + started[1], None
                continue
            if left > 0:  # both streams closed: wait for the exit
                try:
                    proc.wait(left)
                    break
                except subprocess.TimeoutExpired:
                    continue
            if timed_out or flooded:  # the drain after the kill is over too
                break
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 1.0
        proc.wait()
    finally:
        sel.close()
        for f in (proc.stdin, proc.stdout, proc.stderr):
            f.close()
    return bytes(bufs[proc.stdout]), bytes(bufs[proc.stderr]), dropped, timed_out, flooded
