"""The code-execution sandbox: output comes back; each escape the review found (run as root, and
as an unprivileged user in test_sandbox_unprivileged.py) fails and leaves the host unchanged.
Without bwrap these tests fail with SandboxUnavailable naming the package; none is skipped."""

import ast
import asyncio
import errno
import json
import os
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from textwrap import dedent

import pytest

from workbench import sandbox
from workbench.sandbox import SandboxUnavailable, check_sandbox, run_python


@pytest.fixture(autouse=True)
def _no_opt_out(monkeypatch):
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)


def run(code: str, **kw):
    return run_python(dedent(code), **kw)


def test_sandbox_is_available_here():
    check_sandbox()  # fails (not skips) with the reason, e.g. "Debian package `bubblewrap`"


def test_runs_code_and_returns_output():
    r = run_python("print(6 * 7)")
    assert r.ok and r.stdout.strip() == "42" and not r.truncated


def test_stdin_is_passed():
    r = run_python("import sys; print(sys.stdin.read().upper())", stdin="abc")
    assert r.ok and r.stdout.strip() == "ABC"


def test_concurrent_calls_from_threads_like_the_code_agent():
    async def main():  # CodeAgent calls asyncio.to_thread(run_python, code, timeout_s, memory_mb, max_output)
        return await asyncio.gather(*[asyncio.to_thread(run_python, f"print({i} * 2)", 5.0, 256, 1000) for i in range(8)])

    results = asyncio.run(main())
    assert [r.stdout.strip() for r in results] == [str(i * 2) for i in range(8)] and all(r.ok for r in results)


def _listener():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.setblocking(False)
    return srv


def _accepted(srv) -> bool:
    try:
        srv.accept()[0].close()
        return True
    except BlockingIOError:
        return False


def test_no_network_even_to_loopback():
    srv = _listener()
    try:
        r = run(f"""
            import socket
            socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=2)
            print('connected')""")
        assert "connected" not in r.stdout and r.exit_code != 0
        assert "address family not supported" in r.stderr.lower(), r.stderr  # no inet socket at all
        assert not _accepted(srv)
    finally:
        srv.close()


def test_setns_into_the_parents_network_namespace_fails():
    srv = _listener()
    try:
        r = run(f"""
            import ctypes, os, socket
            libc = ctypes.CDLL(None, use_errno=True)
            for path in ['/proc/{os.getpid()}/ns/net', '/proc/{os.getppid()}/ns/net', '/proc/1/ns/net', '/proc/self/ns/net']:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    print('open', path, e.errno); continue
                rc = libc.setns(fd, 0x40000000)  # CLONE_NEWNET
                print('setns', path, rc, ctypes.get_errno())
                if rc == 0:
                    print('SETNS_OK')
            # no /proc (no ns file to name): setns on any fd is refused by the filter (EPERM, not EINVAL)
            print('setns fd 0', libc.setns(0, 0x40000000), ctypes.get_errno())
            try:
                socket.create_connection(('127.0.0.1', {srv.getsockname()[1]}), timeout=2)
                print('CONNECTED')
            except OSError as e:
                print('connect', e)""")
        assert "SETNS_OK" not in r.stdout and "CONNECTED" not in r.stdout, r.stdout + r.stderr
        assert f"open /proc/{os.getpid()}/ns/net {errno.ENOENT}" in r.stdout  # the host's /proc is not there
        assert f"open /proc/self/ns/net {errno.ENOENT}" in r.stdout  # no /proc at all
        assert f"setns fd 0 -1 {errno.EPERM}" in r.stdout  # setns itself is refused
        assert not _accepted(srv)
    finally:
        srv.close()


def test_unix_sockets_outside_are_unreachable(tmp_path):
    path = tmp_path / "outside.sock"
    abstract = f"\0workbench-test-{uuid.uuid4().hex}"
    servers = []
    for addr in (str(path), abstract):
        s = socket.socket(socket.AF_UNIX)
        s.bind(addr)
        s.listen(8)
        s.setblocking(False)
        servers.append(s)
    try:
        r = run(f"""
            import socket
            for addr in [{str(path)!r}, {abstract!r}, '/tmp/ray/session_latest/sockets/raylet']:
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(addr); print('CONNECTED', addr)
                except OSError as e:
                    print('refused', e.errno)""")
        assert r.ok and "CONNECTED" not in r.stdout and r.stdout.count("refused") == 3, r.stdout + r.stderr
        assert not any(_accepted(s) for s in servers)
    finally:
        for s in servers:
            s.close()


def test_etc_shadow_is_not_readable():
    r = run("""
        import os
        print(os.path.exists('/etc'))
        print('READ', open('/etc/shadow').read())""")
    assert "READ" not in r.stdout and "root:" not in r.stdout
    assert r.stdout.strip() == "False" and "FileNotFoundError" in r.stderr


def test_writes_outside_the_work_dir_do_not_reach_the_host(tmp_path):
    token = uuid.uuid4().hex
    here = os.path.dirname(os.path.abspath(__file__))
    targets = [str(tmp_path / "escaped.txt"), f"/tmp/{token}", f"{here}/{token}", f"/root/{token}", f"/etc/{token}",
               f"/{token}", f"/usr/lib/{token}", f"{os.path.dirname(os.__file__)}/{token}.py", f"/dev/shm/{token}",
               f"/proc/{token}"]
    r = run(f"""
        import os
        for p in {targets!r}:
            try:
                os.makedirs(os.path.dirname(p), exist_ok=True)
                with open(p, 'w') as f:
                    f.write('x')
                print('WROTE', p)
            except OSError as e:
                print('denied', p, e.errno)""")
    assert r.ok, r.stderr
    for p in targets:
        assert not os.path.exists(p), p
    # only the sandbox's own /tmp (a tmpfs; tmp_path is under /tmp too, and so is a checkout under
    # /tmp, as in CI) took writes, gone with it
    wrote = [line.split()[1] for line in r.stdout.splitlines() if line.startswith("WROTE")]
    expected = [p for p in targets if p.startswith("/tmp/")]
    assert sorted(wrote) == sorted(expected) and set(targets[:2]) <= set(wrote), r.stdout


def test_parent_environment_is_not_readable(monkeypatch):
    secret = f"s3cr3t-{uuid.uuid4().hex}"
    monkeypatch.setenv("WB_TEST_SECRET", secret)
    r = run(f"""
        import os
        print(dict(os.environ))
        for pid in ['{os.getpid()}', '{os.getppid()}', '1', 'self']:
            try:
                print(pid, open(f'/proc/{{pid}}/environ', 'rb').read())
            except OSError as e:
                print(pid, 'denied', e.errno)""")
    assert r.ok and f"{os.getpid()} denied {errno.ENOENT}" in r.stdout, r.stdout + r.stderr
    assert secret not in r.stdout and secret not in r.stderr


def test_host_processes_are_invisible_and_cannot_be_signalled():
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        r = run(f"""
            import os, signal
            print('pid', os.getpid(), 'proc', os.path.exists('/proc'))
            for pid in ({os.getpid()}, {bystander.pid}, os.getppid(), -1):
                try:
                    os.kill(pid, signal.SIGKILL); print('sent', pid)
                except OSError as e:
                    print('kill', pid, e.errno)""")
        # the code is pid 2 of its namespace (1: bwrap's init), and no /proc lists any process
        assert r.stdout.splitlines()[0] == "pid 2 proc False", r.stdout
        assert f"kill {os.getpid()} {errno.ESRCH}" in r.stdout and f"kill {bystander.pid} {errno.ESRCH}" in r.stdout
        assert bystander.poll() is None  # kill(-1) reached nothing outside either
    finally:
        bystander.kill()
        bystander.wait()


def test_no_subprocesses():
    r = run("""
        import os, subprocess, sys
        for argv in (['/bin/sh', '-c', 'echo hi'], ['ls'], [sys.executable, '-c', 'print(1)']):
            try:
                subprocess.run(argv, timeout=5); print('SPAWNED', argv)
            except OSError as e:
                print('refused', e.errno)
        print('system', os.system('echo hi'))""")
    assert r.ok and "SPAWNED" not in r.stdout and "hi" not in r.stdout, r.stdout + r.stderr
    assert f"refused {errno.EPERM}" in r.stdout  # even the sandbox's own interpreter: no new processes


def test_fork_bomb_is_stopped_at_the_process_limit():
    t0 = time.monotonic()
    r = run("""
        import os, time
        children = 0
        for _ in range(150):
            try:
                if os.fork() == 0:
                    time.sleep(60); os._exit(0)
                children += 1
            except OSError as e:
                err = e.errno
        print('children', children, 'errno', err)
        import threading
        t = threading.Thread(target=print, args=('threads ok',)); t.start(); t.join()""", timeout_s=5)
    assert r.ok and f"children 0 errno {errno.EPERM}" in r.stdout and "threads ok" in r.stdout, r.stdout + r.stderr
    assert time.monotonic() - t0 < 3


def test_threads_are_capped_so_one_sandbox_cannot_take_the_hosts_pids():
    """Threads are allowed, and a thread's stack can be tiny: the memory limit does not bound how
    many. Uncapped, one sandbox made 8,000 host tasks in 0.1 s (pid_max 32,768); RLIMIT_NPROC
    stops it at MAX_TASKS (as root, the count of the host uid the sandbox runs as, its own)."""
    from workbench.sandbox import MAX_TASKS

    cap = MAX_TASKS
    r = run("""
        import threading, time
        threading.stack_size(64 * 1024)
        made = 0
        try:
            for _ in range(5000):
                threading.Thread(target=time.sleep, args=(3,), daemon=True).start(); made += 1
        except RuntimeError as e:
            print('refused', e)
        print('made', made)""", timeout_s=10, memory_mb=1024)
    made = int(r.stdout.split("made ")[-1])
    assert "refused can't start new thread" in r.stdout and 0 < made < cap, r.stdout + r.stderr


def test_one_sandboxs_threads_do_not_starve_another_running_at_once():
    """As root every sandbox ran as host uid 65534, whose task limit they shared: one holding
    1,023 threads left a concurrent sibling unable to start one (a way for an episode to lower
    its group's other rewards). Each now runs as a uid of its own."""
    hog = """
        import threading, time
        threading.stack_size(64 * 1024)
        try:
            while True:
                threading.Thread(target=time.sleep, args=(4,), daemon=True).start()
        except RuntimeError:
            print('full', flush=True)
        time.sleep(4)"""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(run, hog, timeout_s=10)
        time.sleep(1.5)  # the hog has filled its own limit
        r = run("""
            import os, threading
            done = []
            ts = [threading.Thread(target=done.append, args=(1,)) for _ in range(8)]
            [t.start() for t in ts]; [t.join() for t in ts]
            print('threads', len(done))
            print('uid', os.getuid())""")
    assert r.ok and "threads 8\n" in r.stdout, r.stdout + r.stderr
    assert "full" in first.result().stdout
    if os.geteuid() == 0:
        assert int(r.stdout.split("uid ")[-1]) in sandbox.SANDBOX_UIDS


@pytest.mark.skipif(os.geteuid() != 0, reason="the host uids are drawn as root only")
def test_concurrent_sandboxes_never_share_a_uid(monkeypatch):
    """Drawn at random, two concurrent sandboxes could draw one uid and share its task limit (one
    could starve the other of threads). Drawn from those not in use: with two uids to draw from,
    two at once get both, every time."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(sandbox, "_own_uids", lambda: range(1_500_000, 1_500_002))  # (this process's slice)
    for _ in range(3):
        with ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda _: run("import os, time\nprint(os.getuid())\ntime.sleep(0.5)"), range(2)))
        assert all(r.ok for r in outs) and sorted(int(r.stdout) for r in outs) == [1_500_000, 1_500_001]
    assert not sandbox._uids_in_use  # given back


@pytest.mark.skipif(os.geteuid() != 0, reason="makes a user namespace as root")
def test_root_of_a_user_namespace_runs_the_sandbox_as_a_uid_it_maps():
    """Root of a user namespace (rootless Docker/Podman, Kubernetes user namespaces) has only the
    ids its maps name: the launcher's setuid to a host uid of 1,000,000+ failed (EINVAL), and no
    code ever ran. Here a child maps 0-65535 as such a container does, and runs code."""
    child = dedent("""
        import os, sys, ctypes
        r, w = os.pipe(); r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:
            assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0  # CLONE_NEWUSER
            os.write(w, b"1"); os.read(r2, 1)
            os.setgid(0); os.setuid(0)
            code = ("from workbench.sandbox import run_python, _namespace_uids\\n"
                    "r = run_python('import os; print(os.getuid())')\\n"
                    "print('RESULT', r.exit_code, r.stdout.strip(), _namespace_uids().start, _namespace_uids().stop)")
            os.execv(sys.executable, [sys.executable, "-c", code])
        os.read(r, 1)
        for name, text in (("uid_map", "0 0 65536"), ("setgroups", "allow"), ("gid_map", "0 0 65536")):
            open(f"/proc/{pid}/{name}", "w").write(text + "\\n")
        os.write(w2, b"1")
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))""")
    r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    rc, uid, lo, hi = map(int, r.stdout.split("RESULT ")[1].split())
    assert rc == 0 and 0 < lo <= uid < hi <= 65534


def test_sysv_and_posix_ipc_and_other_socket_families_are_refused():
    """A SysV shared-memory segment outlives its detach outside RLIMIT_AS (1.5 GiB held under
    a 64 MiB limit in review); AF_VSOCK reaches the hypervisor's port space, which no network
    namespace covers. Both refused by the filter; so are inet sockets (on cgroup v1 their buffers
    are charged to no memory cgroup: 629 MB of TCP queued to the sandbox's own loopback under a
    104 MB limit, in the host's shared tcp_mem); unix sockets still open (and reach nothing outside)."""
    r = run("""
        import ctypes, socket
        libc = ctypes.CDLL(None, use_errno=True)
        print('shmget', libc.shmget(0, 1 << 20, 0o1600), ctypes.get_errno())
        print('msgget', libc.msgget(0, 0o1600), ctypes.get_errno())
        print('semget', libc.semget(0, 1, 0o1600), ctypes.get_errno())
        for fam in (socket.AF_VSOCK, socket.AF_PACKET, socket.AF_UNIX, socket.AF_INET, socket.AF_INET6, 10 ** 6):
            try:
                socket.socket(fam % 10 ** 6 or socket.AF_INET, socket.SOCK_DGRAM if fam == 10 ** 6 else
                              socket.SOCK_STREAM if fam != socket.AF_PACKET else socket.SOCK_RAW).close()
                print(fam, 'opened')
            except OSError as e:
                print(fam, e.errno)""", memory_mb=64)
    assert r.ok, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert all(lines[k] == f"-1 {errno.EPERM}" for k in ("shmget", "msgget", "semget")), r.stdout
    assert lines[str(int(socket.AF_VSOCK))] == lines[str(int(socket.AF_PACKET))] == str(errno.EAFNOSUPPORT), r.stdout
    assert all(lines[str(int(f))] == str(errno.EAFNOSUPPORT) for f in (socket.AF_INET, socket.AF_INET6, 10 ** 6)), r.stdout
    assert lines[str(int(socket.AF_UNIX))] == "opened", r.stdout


def test_netlink_is_route_only():
    """getaddrinfo reads interfaces through NETLINK_ROUTE (protocol 0): kept. Any other netlink
    protocol is refused: as root the sandbox's network namespace belongs to the initial user
    namespace, and a NETLINK_KOBJECT_UEVENT socket received the host's device events."""
    r = run("""
        import socket
        for proto in (0, 15, 4, 12):
            try:
                socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, proto).close()
                print(proto, 'opened')
            except OSError as e:
                print(proto, e.errno)""")
    assert r.ok, r.stderr
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines == {"0": "opened", "15": str(errno.EPROTONOSUPPORT), "4": str(errno.EPROTONOSUPPORT),
                     "12": str(errno.EPROTONOSUPPORT)}, r.stdout


def test_code_the_call_itself_refused_fails_in_the_interpreter():
    """Code is a file, not an argument: a NUL, a lone surrogate or code over 128 KiB made the call
    raise (ValueError, UnicodeEncodeError, E2BIG), failing the episode, which the loop drops
    instead of scoring 0. Now each is a failed run, and long code runs."""
    for code, why in (("print(1)\x00", "null bytes"), ("print('\ud800')", "Non-UTF-8")):
        r = run_python(code)
        assert r.exit_code == 1 and "SyntaxError" in r.stderr and why in r.stderr, r.stderr
    r = run_python("x = 1\n" * 40_000 + "print('long', x)")
    assert r.ok and r.stdout == "long 1\n"


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86_64 syscall numbers")
def test_kernel_interfaces_the_code_has_no_use_for_are_refused():
    # io_uring_setup, bpf, userfaultfd, perf_event_open, ptrace, process_vm_readv: EPERM from the filter;
    # memfd_secret (held 1 GiB outside RLIMIT_AS in review), the pidfd calls (rootless, pidfd_getfd took
    # bwrap's descriptors: it runs as the code's uid), kcmp, and inotify (rootless, the runner's own
    # uid's 128 instances, and a watch saw the host's file activity on the read-only binds)
    r = run("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        for name, nr in (('io_uring_setup', 425), ('bpf', 321), ('userfaultfd', 323), ('perf_event_open', 298),
                         ('ptrace', 101), ('process_vm_readv', 310), ('memfd_secret', 447), ('pidfd_open', 434),
                         ('pidfd_getfd', 438), ('pidfd_send_signal', 424), ('kcmp', 312), ('process_madvise', 440),
                         ('inotify_init', 253), ('inotify_init1', 294), ('fanotify_init', 300), ('fanotify_mark', 301),
                         ('io_setup', 206), ('io_submit', 209), ('io_getevents', 208), ('io_pgetevents', 333),
                         ('io_cancel', 210), ('io_destroy', 207)):
            rc = libc.syscall(nr, 0, 0, 0, 0, 0, 0)
            print(name, rc, ctypes.get_errno())""")
    assert r.ok, r.stderr
    assert len(r.stdout.splitlines()) == 22 and \
        all(line.split()[1:] == ["-1", str(errno.EPERM)] for line in r.stdout.splitlines()), r.stdout


def test_host_wide_kernel_resources_and_file_watches_are_refused():
    """From review, each held outside every limit or saw the host: fanotify with FAN_REPORT_FID
    (works unprivileged) and dnotify (F_NOTIFY) saw the host open and close a stdlib file; kernel
    AIO took the host's whole fs.aio-max-nr (the test above); each /dev/ptmx opened counted against
    the host-wide kernel.pty.max (253 a sandbox); byte-range locks are kernel memory no cgroup
    counts (72 MB under a 97 MB limit in 3 s); socketpair of another family than AF_UNIX loaded
    its module (AF_TIPC gave a pair). flock and in-memory sqlite keep working, and a program may
    start threads (one malloc arena: 6 threads were all 256 MB allowed)."""
    r = run("""
        import ctypes, fcntl, os, socket, sqlite3, struct, threading
        libc = ctypes.CDLL(None, use_errno=True)
        print('fanotify_init', libc.fanotify_init(0x200 | 2, os.O_RDONLY), ctypes.get_errno())
        d = os.open('/usr', os.O_RDONLY)
        for name, cmd, arg in (('F_NOTIFY', 0x402, 0x80000001), ('F_SETLK', 6, None), ('F_SETLKW', 7, None),
                               ('F_OFD_SETLK', 37, None), ('F_OFD_SETLKW', 38, None), ('F_SETLEASE', 1024, 0)):
            fd = d if arg is not None else os.open('f', os.O_RDWR | os.O_CREAT)
            lock = struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 1, 0)
            try:
                fcntl.fcntl(fd, cmd, arg if arg is not None else lock); print(name, 'ALLOWED')
            except OSError as e:
                print(name, 'refused', e.errno)
        # the same through the raw call with cmd's upper 32 bits set (the kernel drops them; a filter
        # comparing all 64 let them through)
        buf = ctypes.create_string_buffer(struct.pack('hhqqi', fcntl.F_WRLCK, 0, 0, 1, 0))
        f = os.open('h', os.O_RDWR | os.O_CREAT)
        for name, cmd in (('F_SETLK', 6), ('F_OFD_SETLK', 37)):
            rc = libc.syscall(ctypes.c_long(72 if os.uname().machine == 'x86_64' else 25), ctypes.c_long(f),
                              ctypes.c_long((1 << 32) | cmd), buf)
            print(name, 'high bits', rc, ctypes.get_errno())
        rc = libc.syscall(ctypes.c_long(72 if os.uname().machine == 'x86_64' else 25), ctypes.c_long(d),
                          ctypes.c_long((1 << 32) | 0x402), ctypes.c_ulong(0x80000001))
        print('F_NOTIFY high bits', rc, ctypes.get_errno())
        try:
            os.open('/dev/ptmx', os.O_RDWR | os.O_NOCTTY); print('ptmx OPENED')
        except OSError as e:
            print('ptmx refused', e.errno)
        for fam in (socket.AF_INET, socket.AF_INET6, 30):  # 30: AF_TIPC
            try:
                socket.socketpair(fam); print('socketpair', fam, 'MADE')
            except OSError as e:
                print('socketpair', fam, 'refused', e.errno)
        a, b = socket.socketpair(); a.send(b'x'); print('unix pair', b.recv(1))
        fcntl.flock(os.open('g', os.O_RDWR | os.O_CREAT), fcntl.LOCK_EX); print('flock ok')
        print('sqlite', sqlite3.connect(':memory:').execute('select 1').fetchone()[0])
        ts = [threading.Thread(target=lambda: None) for _ in range(24)]
        for t in ts: t.start()
        for t in ts: t.join()
        print('threads', len(ts))""", memory_mb=256)
    assert r.ok, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == f"fanotify_init -1 {errno.EPERM}", r.stdout
    assert lines[1:7] == [f"{n} refused {errno.EPERM}" for n in ("F_NOTIFY", "F_SETLK", "F_SETLKW", "F_OFD_SETLK",
                                                                 "F_OFD_SETLKW", "F_SETLEASE")], r.stdout
    assert lines[7:10] == [f"{n} high bits -1 {errno.EPERM}" for n in ("F_SETLK", "F_OFD_SETLK", "F_NOTIFY")], r.stdout
    assert lines[10].startswith("ptmx refused") and all(x.endswith(f"refused {errno.EAFNOSUPPORT}") for x in lines[11:14]), r.stdout
    assert lines[14:] == ["unix pair b'x'", "flock ok", "sqlite 1", "threads 24"], r.stdout


def test_extended_attributes_are_refused():
    """user.* attributes on the /tmp tmpfs are kernel memory counted by neither the memory limit nor
    the tmpfs size: a reviewer held 2 GiB of them in 0.8 s under memory_mb=64, disk_mb=1."""
    r = run("""
        import os
        open('f', 'w').close()
        for call in (lambda: os.setxattr('f', 'user.a', b'x' * 65536),
                     lambda: os.setxattr('f', 'user.a', b'x', follow_symlinks=False),
                     lambda: os.setxattr(os.open('f', os.O_RDONLY), 'user.a', b'x')):
            try:
                call(); print('SET')
            except OSError as e:
                print('refused', e.errno)""", memory_mb=64, disk_mb=1)
    assert r.stdout.split() == ["refused", str(errno.EPERM)] * 3, r.stdout + r.stderr
    if os.uname().machine in ("x86_64", "aarch64"):  # setxattrat (Linux 6.13), by number: libseccomp 2.5 cannot name it
        r = run("""
            import ctypes, os
            open('f', 'w').close()
            libc = ctypes.CDLL(None, use_errno=True)
            value = ctypes.create_string_buffer(b'x' * 65536)
            args = (ctypes.c_void_p * 2)(ctypes.cast(value, ctypes.c_void_p), 65536)  # struct xattr_args {value, size, flags}
            rc = libc.syscall(463, -100, b'f', 0, b'user.a', args, 16)  # AT_FDCWD
            print(rc, ctypes.get_errno())""")
        assert r.stdout.split() in (["-1", str(errno.EPERM)],), r.stdout + r.stderr


def test_a_bwrap_that_fails_early_is_the_hosts_failure_not_the_codes(monkeypatch):
    """bwrap exiting before it makes PID 1 (here: a bad option; under load: no namespace) closes the
    pipes of the cgroup handshake: the call raised BrokenPipeError instead of bwrap's error. Then it
    came back as the code's exit 1, which graders scored 0 as the policy's: it is SandboxUnavailable
    now (the episode fails, counted), and so is a launcher that never reached the code."""
    real = sandbox._bwrap_args
    with monkeypatch.context() as m:
        m.setattr(sandbox, "_bwrap_args", lambda bwrap, *a: real(bwrap, *a)[:1] + ["--uid", "x"] + real(bwrap, *a)[1:])
        with pytest.raises(SandboxUnavailable, match=r"did not start the code \(exit 1\): .*Invalid uid"):
            sandbox._run(shutil.which("bwrap"), "print(1)", 5.0, 64, 1000, b"", {}, 16)
    with monkeypatch.context() as m:  # the launcher failing before the code (its limits refused)
        m.setattr(sandbox, "MAX_TASKS", -5)
        with pytest.raises(SandboxUnavailable, match="did not start the code"):
            sandbox._run(shutil.which("bwrap"), "print(1)", 5.0, 64, 1000, b"", {}, 16)
    # the code's own failures stay results, its stderr without the launcher's mark
    r = sandbox._run(shutil.which("bwrap"), "import sys\nsys.stderr.write('mine')\nraise SystemExit(3)", 5.0, 64, 1000, b"", {}, 16)
    assert r.exit_code == 3 and r.stderr == "mine"


def test_the_sandboxs_pid_1_is_killed_whatever_bwrap_does(monkeypatch):
    """The namespace's PID 1 dies by its parent-death signal when bwrap dies, a signal PID 1 itself
    can clear (in rootless mode the code could write PID 1's memory through /proc, now unmounted).
    Every call also kills it by a pidfd: here bwrap's output is never waited for (a fake
    _communicate returns at once) and no process group is killed, yet the sleeping code is gone."""
    token = _token()
    started = []

    def communicate(proc, *a, **k):  # returns once the code runs, without waiting for bwrap
        deadline = time.monotonic() + 10
        while not started and time.monotonic() < deadline:
            started.append(_survivors(token)) if _survivors(token) else time.sleep(0.02)
        return b"", sandbox.STARTED, False, False, False  # (the launcher's mark: the code ran)

    monkeypatch.setattr(sandbox, "_communicate", communicate)
    sandbox._run(shutil.which("bwrap"), _named(token) + "\nimport time; time.sleep(30)", 30.0, 64, 100, b"", {}, 16)
    assert started, "the code never ran"
    deadline = time.monotonic() + 3
    while _survivors(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _survivors(token) == ""


_REAP_CHECK = r"""
import json, os, sys, time, ctypes
from workbench import sandbox
sandbox._host_reaps = False  # the watch's verdict where the host's PID 1 reaps nothing
pids, reaped = [], []
real_pid1, real_kill = sandbox._sandbox_pid1, sandbox._kill_pid1
def pid1(*a):
    got = real_pid1(*a); pids.append(got[0]); return got
def kill(*a, **k):
    out = real_kill(*a, **k); reaped.append(out); return out
sandbox._sandbox_pid1, sandbox._kill_pid1 = pid1, kill
assert sandbox.run_python("print(1)").stdout == "1\n"
assert sandbox.run_python("while True: pass", timeout_s=0.5).timed_out
child = os.fork()
if child == 0:  # a forked child: the kernel cleared the flag, and it asks again
    os._exit(0 if sandbox.run_python("print(2)").stdout == "2\n" and reaped[-1] is True else 1)
_, status = os.waitpid(child, 0)
def zombie(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return False
print(json.dumps({"reaped": reaped, "zombies": [p for p in pids if zombie(p)], "child_ok": status == 0,
                  "subreaper": (lambda v: (ctypes.CDLL(None).prctl(37, ctypes.byref(v), 0, 0, 0), v.value)[1])(ctypes.c_int())}))
"""

def test_where_the_hosts_pid_1_reaps_nothing_the_caller_adopts_and_reaps_each_sandbox_init():
    """bwrap exits before its init (the sandbox's PID 1) has: orphaned, that init goes to the host's
    PID 1, and where that reaps nothing (a Python or Ray PID 1 under `docker run`) every call left a
    zombie until the pids ran out. Once that is seen, the caller adopts orphans and reaps each
    sandbox's init: after a normal end, after a timeout, and in a forked child (whose subreaper flag
    the kernel cleared). In a process of its own: adopting, the test process would keep every orphan
    of the suite's processes."""
    out = subprocess.run([sys.executable, "-c", _REAP_CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["reaped"] and all(got["reaped"]), got  # (the first call's check of the sandbox included)
    assert got["zombies"] == [] and got["child_ok"] and got["subreaper"] == 1, got


def test_the_caller_adopts_orphans_only_where_the_hosts_pid_1_does_not_reap():
    """Adopted where the host reaps, every other orphan of the caller's descendants (a daemon an
    agent's shell command left) became a zombie of the caller. The first sandbox init orphaned to
    the host is watched: reaped, nothing changes; still a zombie, the caller adopts from then on.
    A zombie whose parent reaps nothing stands in for the host's PID 1."""
    script = r"""
import json, subprocess, sys, ctypes
from workbench import sandbox
flag = lambda: (lambda v: (ctypes.CDLL(None).prctl(37, ctypes.byref(v), 0, 0, 0), v.value)[1])(ctypes.c_int())
gone = subprocess.Popen(["true"]); gone.wait()  # reaped: its pid names nothing now
first = (sandbox._watch_host_reaper(gone.pid, wait_s=0.5), sandbox._host_reaps, flag())
sandbox._host_reaps = None
parent = subprocess.Popen([sys.executable, "-c", "import os, time\nif os.fork() == 0: os._exit(0)\ntime.sleep(60)"])
import time
deadline, kids = time.monotonic() + 30, []
while not kids and time.monotonic() < deadline:  # (its child forked and exited: a zombie it never reaps)
    kids = [int(p) for p in open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split()]
    time.sleep(0.05)
second = (sandbox._watch_host_reaper(kids[0], wait_s=0.5), sandbox._host_reaps, flag())
parent.kill(); parent.wait()
print(json.dumps({"first": first, "second": second}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["first"] == [False, True, 0], got  # the host reaped: nothing adopted
    assert got["second"] == [True, False, 1], got  # a zombie stayed: adopted


# A host PID 1 that reaps nothing: orphans below it come to it (PR_SET_CHILD_SUBREAPER) and stay
# zombies until the caller has ended, then counted (and reaped: the test leaves nothing)
_NON_REAPING_INIT = r"""
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
out, err = child.communicate(timeout=300)
def state(k):
    try:
        return open(f"/proc/{k}/stat").read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return None
kids = open(f"/proc/self/task/{os.getpid()}/children").read().split()
zombies = [k for k in kids if state(k) == "Z"]
for k in zombies:
    os.waitpid(int(k), 0)
print(json.dumps({"caller": out.strip().splitlines()[-1] if out.strip() else err[-1500:], "host_zombies": len(zombies)}))
"""

_CALLER = r"""
import ctypes, json, os, threading, time
from concurrent.futures import ThreadPoolExecutor
from workbench import sandbox
sandbox.HOST_REAP_WAIT_S = 1.0
flag = lambda: (lambda v: (ctypes.CDLL(None).prctl(37, ctypes.byref(v), 0, 0, 0), v.value)[1])(ctypes.c_int())
def zombies():
    kids = open(f"/proc/self/task/{os.getpid()}/children").read().split()
    out = []
    for k in kids:
        try:
            out += [k] if open(f"/proc/{k}/stat").read().rpartition(")")[2].split()[0] == "Z" else []
        except FileNotFoundError:
            pass
    return out
def calls(seconds):
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        assert sandbox.run_python("print(7)").stdout == "7\n"
        n += 1
    return n
with ThreadPoolExecutor(4) as pool:  # concurrent calls across the watch and its verdict
    n = sum(pool.map(calls, [2.5] * 4))
child = os.fork()
if child == 0:  # a forked child: its flag cleared by the kernel, it asks again
    calls(0.5)
    os._exit(0 if flag() == 1 and not zombies() else 1)
_, status = os.waitpid(child, 0)
print(json.dumps({"calls": n, "verdict": sandbox._host_reaps, "flag": flag(), "own_zombies": zombies(), "child_ok": status == 0}))
"""


def test_under_a_pid_1_that_reaps_nothing_calls_leave_no_zombies_past_the_first_few():
    """End to end, as a runner under `docker run` without --init: concurrent calls from 4 threads
    across the first init's watch and its verdict, then a fork. The host's PID 1 keeps the first
    init (the one watched) and at most the few whose bwrap exited before the watch began; every
    later init is reaped by the caller (hundreds were left before), none stays a zombie of the
    caller, and the forked child adopts too."""
    out = subprocess.run([sys.executable, "-c", _NON_REAPING_INIT, _CALLER], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    caller = json.loads(got["caller"]) if got["caller"].startswith("{") else got["caller"]
    assert isinstance(caller, dict), caller
    assert caller["verdict"] is False and caller["flag"] == 1 and caller["child_ok"], caller
    assert caller["own_zombies"] == [] and caller["calls"] > 20, caller
    assert 1 <= got["host_zombies"] <= 12, got  # (the inits whose bwrap exited before the watch began)


def test_output_printed_before_a_timeout_is_kept():
    # the interpreter runs unbuffered: what the code printed before the kill reaches the caller
    r = run_python("print('partial 123')\nwhile True: pass", timeout_s=1.5)
    assert r.timed_out and r.stdout == "partial 123\n"


def test_cpu_limit_cannot_be_raised():
    t0 = time.monotonic()
    r = run("""
        import resource
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY)); print('RAISED')
        except (ValueError, OSError) as e:
            print('refused', e, flush=True)
        while True: pass""", timeout_s=1.5)
    assert "refused" in r.stdout and "RAISED" not in r.stdout
    assert r.timed_out and not r.ok and time.monotonic() - t0 < 3.5


def _survivors(token: str) -> str:
    """Processes named `token` (the sandboxed code names itself: its code is a file, on no
    command line)."""
    return subprocess.run(["pgrep", "-a", token], capture_output=True, text=True).stdout


def _token() -> str:  # a process name (at most 15 characters)
    return f"wb{uuid.uuid4().hex[:13]}"


def _named(token: str) -> str:
    return f"import ctypes; ctypes.CDLL(None).prctl(15, b'{token}', 0, 0, 0)"  # PR_SET_NAME


def test_escaping_grandchild_does_not_outlive_the_timeout():
    token = _token()
    t0 = time.monotonic()
    r = run(f"""
        {_named(token)}
        import os, time
        try:
            if os.fork() == 0:
                os.setsid()
                if os.fork() == 0:
                    time.sleep(20); os._exit(0)
                os._exit(0)
        except OSError as e:
            print('fork', e.errno, flush=True)
        time.sleep(20)""", timeout_s=2.0)
    elapsed = time.monotonic() - t0
    assert r.timed_out and elapsed < 3.5, elapsed
    assert f"fork {errno.EPERM}" in r.stdout
    assert _survivors(token) == ""


def test_sandbox_dies_with_its_caller():
    # the caller is SIGKILLed mid-run, so no timeout of ours fires: --die-with-parent does it
    token = _token()
    caller = subprocess.Popen([sys.executable, "-c", dedent(f"""
        import importlib.util, os, sys
        spec = importlib.util.spec_from_file_location("sb", {sandbox.__file__!r})
        sb = importlib.util.module_from_spec(spec); sys.modules["sb"] = sb; spec.loader.exec_module(sb)
        sb.run_python({_named(token)!r} + "\\nimport time; time.sleep(60)", timeout_s=60)""")])
    try:
        deadline = time.monotonic() + 10
        while not _survivors(token) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _survivors(token), "the sandbox never started"
    finally:
        caller.kill()
        caller.wait()
    deadline = time.monotonic() + 2
    while _survivors(token) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _survivors(token) == ""


def test_output_flood_is_read_with_bounded_memory():
    """Output past what is kept is read and dropped (bounded memory), and past OUTPUT_FLOOD_BYTES
    the program is killed and told so: one printing in a loop held the caller's thread reading
    until its timeout, every episode (an RL policy finds such loops)."""
    from workbench.sandbox import OUTPUT_FLOOD_BYTES

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    try:
        # 6 MiB (under the flood limit) then the end: read whole, the program's own exit
        r = run("""
            import sys
            chunk = b'x' * (1 << 20)
            for _ in range(6):
                sys.stdout.buffer.write(chunk)
            sys.stderr.write('e' * (1 << 20))""", timeout_s=30, max_output=4096)
        assert r.ok and r.truncated and r.stdout_truncated and len(r.stdout) == 4096 and len(r.stderr) == 4096
        t0 = time.monotonic()
        flood = run("""
            import sys
            while True:
                sys.stdout.write('x' * 65536)""", timeout_s=30, max_output=4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert time.monotonic() - t0 < 10 and not flood.ok and not flood.timed_out and flood.truncated
    assert flood.exit_code == -9 and flood.stderr.endswith(f"killed after more than {OUTPUT_FLOOD_BYTES >> 20} MiB of "
                                                            f"output past what is kept]") and len(flood.stderr) <= 4096
    assert peak < 4 << 20, peak  # a few chunks, never the flood
    assert rss_growth_mb < 50, rss_growth_mb


def test_wall_clock_timeout_kills():
    r = run_python("import time\nwhile True: time.sleep(0.1)", timeout_s=1.0)
    assert r.timed_out and not r.ok


def test_a_tiny_timeout_times_the_code_out_not_the_sandbox():
    """The timeout runs from the code's start, the set-up has its own START_S: from Popen, a code
    agent's last milliseconds of budget (or a busy runner's start-up) ran out before the code began,
    read as a broken sandbox (SandboxUnavailable: the episode failed and was dropped, not scored 0)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:  # a busy runner: set-ups of several at once
        results = list(pool.map(lambda t: run_python("import time\ntime.sleep(1)", timeout_s=t), [0.001, 0.01] * 4))
    assert all(r.timed_out and not r.ok for r in results)
    r = run_python("print('hi')", timeout_s=0.2)
    assert r.ok and r.stdout == "hi\n"


def test_cpu_spin_is_killed():
    r = run_python("while True: pass", timeout_s=1.5)
    assert r.timed_out and not r.ok


def test_memory_limit_kills_big_allocations():
    r = run_python("x = bytearray(512 * 1024 * 1024)\nprint('allocated')", memory_mb=128)
    assert "allocated" not in r.stdout and r.exit_code != 0 and "MemoryError" in r.stderr


def test_output_is_truncated():
    r = run_python("print('x' * 100000)", max_output=100)
    assert r.truncated and r.stdout_truncated and len(r.stdout) == 100
    # stderr alone cut: stdout (a grader's results line) is whole
    r = run_python("import sys\nsys.stderr.write('e' * 1000)\nprint('RESULTS [1]')", max_output=100)
    assert r.ok and r.truncated and not r.stdout_truncated and r.stdout == "RESULTS [1]\n"
    # the launcher's mark takes none of the code's room: a tiny max_output read as a sandbox that never started
    r = run_python("import sys\nprint('hi')\nsys.stderr.write('\U0001F600' * 3)", max_output=3)
    assert r.ok and r.stdout == "hi\n" and r.stderr == "\U0001F600" * 3 and not r.truncated


def test_isolated_interpreter_sees_no_site_packages():
    for module in ("torch", "pytest", "IPython"):  # the venv's and the base install's packages
        r = run_python(f"import {module}")
        assert r.exit_code != 0 and "ModuleNotFoundError" in r.stderr, module


def test_no_inherited_file_descriptors(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s3cr3t")
    fd = os.open(secret, os.O_RDONLY)
    os.set_inheritable(fd, True)
    try:
        r = run("""
            import os
            import fcntl
            def is_open(fd):
                try:
                    return fcntl.fcntl(fd, fcntl.F_GETFD) is not None
                except OSError:
                    return False
            print([fd for fd in range(1024) if is_open(fd)])  # no /proc/self/fd: asked of each descriptor
            for fd in range(3, 1024):
                try:
                    print('OPEN', fd, os.read(fd, 100))
                except OSError:
                    pass""")
    finally:
        os.close(fd)
    assert r.ok and r.stdout.splitlines()[0] == "[0, 1, 2]", r.stdout + r.stderr
    assert "s3cr3t" not in r.stdout and "OPEN" not in r.stdout, r.stdout


def test_task_files_are_read_only_and_fresh_each_call():
    files = {"test_task.py": "assert solve() == 42\n", "data/input.txt": "1 2 3\n"}
    r = run("""
        import os
        print(open('test_task.py').read(), end='')
        attempts = [
            ('write', lambda: open('test_task.py', 'w').write('pass')),
            ('append', lambda: open('test_task.py', 'a').write('pass')),
            ('unlink', lambda: os.unlink('test_task.py')),
            ('rename', lambda: os.rename('test_task.py', 'x.py')),
            ('chmod', lambda: os.chmod('test_task.py', 0o666)),
            ('nested', lambda: open('data/input.txt', 'w').write('0')),
        ]
        for name, f in attempts:
            try:
                f(); print('DONE', name)
            except OSError as e:
                print('denied', name, e.errno)
        open('scratch.txt', 'w').write('the work dir itself is writable')""", files=files)
    assert r.ok and r.stdout.startswith("assert solve() == 42"), r.stdout + r.stderr
    assert "DONE" not in r.stdout and r.stdout.count("denied") == 6, r.stdout
    again = run("import os; print(open('test_task.py').read(), end=''); print(os.listdir('.'))", files=files)
    assert again.stdout.startswith("assert solve() == 42") and "scratch.txt" not in again.stdout


def test_other_episodes_work_dirs_are_invisible():
    token = uuid.uuid4().hex
    first = {}
    t = threading.Thread(target=lambda: first.update(r=run(f"""
        import time
        open('/tmp/{token}', 'w').write('episode A')
        print('written', time.time(), flush=True)
        time.sleep(2.5)""", timeout_s=10)))
    t.start()
    time.sleep(0.7)
    second = run(f"""
        import os, time
        t0 = time.time()
        found = [os.path.join(d, f) for d, _, fs in os.walk('/') for f in fs if '{token}' in f]
        print('found', found, t0, time.time(), os.listdir('/tmp'))""")
    t.join()
    assert first["r"].ok and "written" in first["r"].stdout
    assert second.ok and second.stdout.startswith("found []"), second.stdout
    written = float(first["r"].stdout.split()[1])
    searched_from, searched_to = map(float, second.stdout.split()[2:4])
    assert written < searched_from and searched_to < written + 2.5  # the search ran while A's file existed
    assert not os.path.exists(f"/tmp/{token}")


def test_kernel_memory_is_bounded_by_the_sandboxs_memory_cgroup():
    """Empty directories cost kernel memory (inodes, dentries) that neither RLIMIT_AS nor the
    tmpfs size counts: a reviewer's loop held ~1 GiB in 4 s under memory_mb=64, disk_mb=1. Each
    sandbox runs in a memory cgroup of its own (where the caller can make one: root here), which
    stops it near memory_mb + disk_mb + CGROUP_HEADROOM_MB, and is removed after the call."""
    probe = sandbox._new_memory_cgroup(64 << 20)
    if probe is None:
        pytest.skip("no memory cgroup can be made here (not root, or not delegated): only the rlimits bound memory")
    sandbox._remove_cgroup(probe)
    parent = sandbox._memory_cgroup_parent()
    mine = lambda: [d for d in os.listdir(parent) if d.startswith(f"workbench-sandbox-{os.getpid()}-")]  # noqa: E731
    seen = []

    def watch():  # the sandbox's processes are in its cgroup while it runs
        while not seen and not done.is_set():
            for d in mine():
                with open(os.path.join(parent, d, "cgroup.procs")) as f:
                    if f.read().split():
                        seen.append(d)
            time.sleep(0.01)

    done = threading.Event()
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        r = run("""
            import os, time
            t0, n = time.monotonic(), 0
            try:
                while time.monotonic() - t0 < 4:
                    os.mkdir(f'd{n}')
                    for j in range(1000):
                        os.mkdir(f'd{n}/{j}' + 'y' * 200)
                    n += 1
                print('unbounded', n * 1001)
            except OSError as e:
                print('stopped', e.errno)""", memory_mb=64, disk_mb=1, timeout_s=8)
    finally:
        done.set()
        watcher.join()
    # killed by the cgroup's OOM killer (or refused an allocation) long before 4 s of directories
    assert "unbounded" not in r.stdout and (r.exit_code == -9 or "stopped" in r.stdout), r
    assert seen and mine() == []


def test_disk_exhaustion_hits_enospc_in_a_bounded_tmpfs():
    free0 = shutil.disk_usage("/").free
    r = run("""
        import errno, os
        st = os.statvfs('.')
        print('size', st.f_blocks * st.f_frsize)
        written = 0
        try:
            for i in range(100):
                with open(f'fill{i}', 'wb') as f:
                    for _ in range(4):
                        f.write(b'x' * (1 << 20)); written += 1 << 20
        except OSError as e:
            print('errno', e.errno, 'written', written)""", disk_mb=64)
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert r.ok and int(lines["size"]) == 64 << 20, r.stdout + r.stderr
    err, written = lines["errno"].split(" written ")
    assert int(err) == errno.ENOSPC and 48 << 20 < int(written) <= 64 << 20
    # the 64 MB went to memory, not to the host's disk (tolerance for other processes' writes)
    assert free0 - shutil.disk_usage("/").free < 32 << 20


def test_refuses_without_the_sandbox_unless_opted_out(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(sandbox, "_SANDBOX_OK", [])  # not checked yet in this process
    reason = sandbox._sandbox_problem()
    assert "bubblewrap" in reason and "apt-get install -y bubblewrap" in reason
    monkeypatch.undo()
    monkeypatch.setattr(sandbox, "_SANDBOX_OK", [])
    assert sandbox._sandbox_problem() is None  # a failed check is not remembered: bwrap is back, so is the sandbox
    monkeypatch.delenv(sandbox.UNSAFE_ENV, raising=False)
    monkeypatch.setattr(sandbox, "_sandbox_problem", lambda: reason)
    with pytest.raises(SandboxUnavailable, match=f"bubblewrap.*{sandbox.UNSAFE_ENV}=1"):
        run_python("print(1)")
    monkeypatch.setenv(sandbox.UNSAFE_ENV, "1")
    with pytest.warns(RuntimeWarning, match="UNSANDBOXED"):
        r = run_python("print(open('t.txt').read())", files={"t.txt": "unsafe but limited"})
    assert r.ok and r.stdout.strip() == "unsafe but limited"
    with pytest.warns(RuntimeWarning):
        r = run_python("while True: pass", timeout_s=1.0)
    assert r.timed_out


def test_rootless_sandboxes_warn_of_a_process_limit_they_share(monkeypatch):
    """Rootless, the kernel charges a sandbox's tasks to the caller's uid too (Linux 5.14+): under a
    common `ulimit -u` of 4096, 64 sandboxes of up to 66 tasks each starved one another of threads
    and the runner's user of processes. Said once, where the limit is that low."""
    import resource
    import warnings

    from workbench import sandbox

    for limit, warned in ((4096, True), (resource.RLIM_INFINITY, False), (1 << 20, False)):
        sandbox._warn_low_nproc.cache_clear()
        monkeypatch.setattr(resource, "getrlimit", lambda k, limit=limit: (limit, limit))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sandbox._warn_low_nproc()
        assert any("ulimit -u: 4096" in str(w.message) for w in caught) == warned, limit
    sandbox._warn_low_nproc.cache_clear()


def test_each_process_draws_sandbox_uids_from_its_own_slice():
    """A runner's sandbox uids were unique among its own sandboxes only: 8 runners drew the same uid
    now and then, two sandboxes sharing one RLIMIT_NPROC. Each process holds a slice of the pool."""
    import subprocess
    import sys

    child = ("import sys; from workbench import sandbox; r = sandbox._own_uids(); "
             "print(r.start, r.step, flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    try:
        got = [tuple(map(int, p.stdout.readline().split())) for p in procs]
    finally:
        for p in procs:
            p.stdin.close()
            p.wait(30)
    from workbench.sandbox import UID_SLICES

    assert len({start for start, _ in got}) == 3 and {step for _, step in got} == {UID_SLICES}, got


def test_a_small_uid_pool_is_shared_whole_and_waited_for(monkeypatch):
    """A user namespace mapping few ids (32): the slice past its end was empty, and every sandbox of
    that process failed (IndexError); a call finding every uid of its pool running spun holding the
    lock. A pool too small to slice is shared whole, and a full one is waited on."""
    import threading

    monkeypatch.setattr(sandbox, "_namespace_uids", lambda: range(100_000, 100_032))
    own_uids = sandbox._own_uids
    own_uids.cache_clear()
    try:
        assert sandbox._own_uids() == range(100_000, 100_032)
        monkeypatch.setattr(sandbox, "_own_uids", lambda: range(7, 9))
        taken = [sandbox._take_uid(), sandbox._take_uid()]
        assert sorted(taken) == [7, 8]
        third = []
        waiter = threading.Thread(target=lambda: third.append(sandbox._take_uid()))
        waiter.start()
        waiter.join(0.3)
        assert waiter.is_alive() and not third  # waiting, not given a uid in use
        with sandbox._uids_freed:
            sandbox._uids_in_use.discard(taken[0])
            sandbox._uids_freed.notify()
        waiter.join(5)
        assert third == [taken[0]]
    finally:
        sandbox._uids_in_use.difference_update({7, 8})
        own_uids.cache_clear()
