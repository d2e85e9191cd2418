"""The sandbox started by an unprivileged user (bwrap's user-namespace mode), as the reviewer also
tried it. Run from root's tests: a driver process runs as uid 65534 with a system interpreter
(the project's is under /root, closed to other users) and makes the escapes whose targets that
uid could reach without the sandbox: a nobody-writable directory, a nobody-owned process and
unix socket, its own environment, 127.0.0.1."""

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

NOBODY = 65534

DRIVER = r'''
import errno, importlib.util, json, os, signal, socket, subprocess, sys, time, tracemalloc
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sb = importlib.util.module_from_spec(spec); sys.modules["sandbox"] = sb; spec.loader.exec_module(sb)
shared, secret = sys.argv[2], os.environ["WB_TEST_SECRET"]
sb.check_sandbox()
res = {}

srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(4); srv.setblocking(False)
usock = socket.socket(socket.AF_UNIX); usock.bind(f"{shared}/s.sock"); usock.listen(4); usock.setblocking(False)
bystander = subprocess.Popen(["sleep", "30"])
r = sb.run_python(f"""
import os, signal, socket
for addr in [('127.0.0.1', {srv.getsockname()[1]}), '{shared}/s.sock']:
    try:  # (an inet socket is refused at socket(): the filter)
        s = socket.socket(socket.AF_INET if isinstance(addr, tuple) else socket.AF_UNIX)
        s.connect(addr); print('CONNECTED', addr)
    except OSError as e: print('refused')
for p in ['{shared}/escaped', '/proc/sys/vm/overcommit_ratio']:
    try: open(p, 'w').write('50'); print('WROTE', p)
    except OSError as e: print('denied')
for pid in ['{os.getpid()}', 'self']:
    try: print(open(f'/proc/{{pid}}/environ').read())
    except OSError as e: print('no environ', e.errno)
print('pid', os.getpid(), 'proc', os.path.exists('/proc'))
for pid in ({bystander.pid}, -1):
    try: os.kill(pid, signal.SIGKILL); print('sent', pid)
    except OSError as e: print('kill', e.errno)
try: os.fork(); print('FORKED')
except OSError as e: print('fork', e.errno)
import ctypes
print('unshare', ctypes.CDLL(None, use_errno=True).unshare(0x10000000), ctypes.get_errno())  # CLONE_NEWUSER
print('shadow', os.path.exists('/etc/shadow'), 'uid', os.getuid())
""")
time.sleep(0.2)
accepted = []
for s in (srv, usock):
    try: s.accept(); accepted.append(True)
    except BlockingIOError: accepted.append(False)
res["escapes"] = dict(out=r.stdout, err=r.stderr, accepted=accepted, escaped=os.path.exists(f"{shared}/escaped"),
                      bystander_alive=bystander.poll() is None, secret_seen=secret in r.stdout + r.stderr, pid=os.getpid())
bystander.kill()

t0, token = time.monotonic(), f"tok{os.urandom(8).hex()}"  # not in this driver's own command line
r = sb.run_python(f"# {token}\nimport resource\ntry: resource.setrlimit(resource.RLIMIT_CPU, (-1, -1)); print('RAISED')\n"
                  "except (ValueError, OSError): print('refused', flush=True)\nwhile True: pass", timeout_s=1.5)
res["cpu"] = dict(out=r.stdout, timed_out=r.timed_out, elapsed=time.monotonic() - t0,
                  survivors=subprocess.run(["pgrep", "-f", token], capture_output=True, text=True).stdout)

tracemalloc.start()
r = sb.run_python("import sys\nfor _ in range(200): sys.stdout.buffer.write(b'x' * (1 << 20))", timeout_s=30)
res["flood"] = dict(ok=r.ok, truncated=r.truncated, n=len(r.stdout), peak=tracemalloc.get_traced_memory()[1],
                    exit_code=r.exit_code, killed="killed after more than" in r.stderr)
tracemalloc.stop()

r = sb.run_python("import os\ntry:\n  for i in range(100): open(f'f{i}', 'wb').write(b'x' * (1 << 20))\n"
                  "except OSError as e: print(e.errno, i)", disk_mb=16)
res["disk"] = r.stdout.strip()
print(json.dumps(res))
'''


def _nobody_python():
    """A system interpreter that uid 65534 can run, or None."""
    for exe in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.path.exists(exe):
            r = subprocess.run([exe, "-I", "-c", "import json, tracemalloc, ctypes"], user=NOBODY, group=NOBODY,
                               extra_groups=[], cwd="/", capture_output=True)
            if r.returncode == 0:
                return exe
    return None


@pytest.fixture(scope="module")
def driver_result():
    if os.geteuid() != 0:
        pytest.skip("needs root to start the unprivileged driver; as a normal user test_sandbox.py covers this mode")
    exe = _nobody_python()
    if exe is None:
        pytest.skip("no system python3 that uid 65534 can run (the project's interpreter is under /root)")
    work = Path(tempfile.mkdtemp(prefix="wb-sandbox-unpriv-"))
    try:
        work.chmod(0o755)
        shared = work / "shared"
        shared.mkdir(mode=0o777)
        shared.chmod(0o777)  # the driver (nobody) may write here; the code it sandboxes may not
        shutil.copy(Path(__file__).parents[1] / "workbench" / "sandbox.py", work / "sandbox.py")
        (work / "sandbox.py").chmod(0o644)
        secret = f"s3cr3t-{os.urandom(8).hex()}"
        r = subprocess.run([exe, "-I", "-c", DRIVER, str(work / "sandbox.py"), str(shared)], user=NOBODY, group=NOBODY,
                           extra_groups=[], cwd=work, capture_output=True, text=True, timeout=120,
                           env={"PATH": "/usr/bin:/bin", "WB_TEST_SECRET": secret})
        assert r.returncode == 0, r.stderr
        res = json.loads(r.stdout.splitlines()[-1])
        res["secret"] = secret
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_unprivileged_escapes_fail(driver_result):
    e = driver_result["escapes"]
    out = e["out"]
    assert "CONNECTED" not in out and out.count("refused") == 2 and e["accepted"] == [False, False], out
    assert "WROTE" not in out and out.count("denied") == 2 and not e["escaped"], out
    assert f"no environ {2}" in out and not e["secret_seen"], out  # ENOENT: the driver's /proc entry is not there
    # no /proc: through /proc/1/mem the code took over bwrap's PID 1 (the code's uid in this mode)
    assert "pid 2 proc False" in out and "sent" not in out.replace("sent -1", "") and e["bystander_alive"], out
    assert "FORKED" not in out and "fork 1" in out, out
    assert "unshare -1 1" in out, out  # no nested user namespace (EPERM)
    assert "shadow False uid 65534" in out, out + e["err"]


def test_unprivileged_limits_hold(driver_result):
    cpu, flood = driver_result["cpu"], driver_result["flood"]
    assert "refused" in cpu["out"] and "RAISED" not in cpu["out"] and cpu["timed_out"] and cpu["elapsed"] < 3.5
    assert cpu["survivors"] == ""
    # killed past OUTPUT_FLOOD_BYTES (8 MiB of the 200), read with bounded memory until then
    assert not flood["ok"] and flood["exit_code"] == -9 and flood["killed"] and flood["truncated"], flood
    assert flood["n"] == 4096 and flood["peak"] < 4 << 20, flood
    err, _ = driver_result["disk"].split()
    assert int(err) == 28, driver_result["disk"]  # ENOSPC
