"""Ray and servers locked down (issue 16, item 6): the loopback server and JupyterLab bind
127.0.0.1 and check their key/token; connect() refuses a non-local Ray address without Ray's
authentication token, before connecting."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from workbench.cluster import is_local_address, ray_address_host

ROOT = Path(__file__).resolve().parents[1]


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on `port` (from /proc/net/tcp{,6})."""
    out = set()
    for name in ("tcp", "tcp6"):
        path = Path("/proc/net") / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            f = line.split()
            addr, p = f[1].split(":")
            if int(p, 16) == port and f[3] == "0A":  # LISTEN
                if len(addr) == 8:
                    out.add(socket.inet_ntop(socket.AF_INET, bytes.fromhex(addr)[::-1]))
                else:  # /proc shows IPv6 as 4 little-endian words
                    raw = b"".join(bytes.fromhex(addr[i:i + 8])[::-1] for i in range(0, 32, 8))
                    out.add(socket.inet_ntop(socket.AF_INET6, raw))
    return out


def test_loopback_server_binds_loopback_and_checks_the_key_on_every_route(moe_path):
    from workbench.loopback.server import LoopbackServer
    from workbench.toy.models import load_tokenizer

    assert LoopbackServer(None, load_tokenizer(moe_path), api_key="").api_key  # an empty key is never "no key"
    with LoopbackServer(None, load_tokenizer(moe_path)) as server:  # no engine: nothing may get that far
        assert server.host == "127.0.0.1" and listening_addresses(server.port) == {"127.0.0.1"}
        sid = server.open_session()
        routes = [(m, r.path.replace("{sid}", sid)) for r in server.app.routes for m in sorted(r.methods - {"HEAD"})]
        assert ("GET", "/health") in routes and sum(m == "POST" for m, _ in routes) >= 4
        good = {"Authorization": f"Bearer {server.api_key}"}
        bad = [{}, {"Authorization": "Bearer"}, {"x-api-key": ""}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"},
               {"Authorization": server.api_key}]  # (the key without "Bearer " is not the key)
        with httpx.Client(base_url=server.url, timeout=10) as client:
            for method, path in routes:
                if path == "/health":
                    assert client.request(method, path).status_code == 200
                    continue
                for headers in bad:
                    r = client.request(method, path, headers=headers, content=b"{}")
                    assert r.status_code == 401, (method, path, headers, r.status_code)
                for headers in (good, {"x-api-key": server.api_key}):  # the key opens it (GET: 200; POST {}: a 400)
                    r = client.request(method, path, headers=headers, content=b"{}")
                    assert r.status_code in ((200,) if method == "GET" else (400,)), (method, path, r.status_code, r.text)
        assert sid in server.sessions and not server.sessions[sid].segments  # nothing was recorded


def test_make_lab_binds_loopback_with_its_token(tmp_path):
    """`make lab`'s command binds 127.0.0.1 and leaves Jupyter's token on; started briefly on a
    free port, the server listens on 127.0.0.1 only and refuses the API without the token."""
    printed = subprocess.run(["make", "-n", "lab", "LAB_PORT=0"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    command = next(line for line in printed.replace("\\\n", " ").splitlines() if "-m jupyterlab" in line)
    assert "--ServerApp.ip=127.0.0.1" in command
    assert not re.search(r"token=(''|\"\"|\s|$)|--ServerApp.password|disable_check_xsrf|allow_remote_access", command)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = command.replace("--ServerApp.port=0", f"--ServerApp.port={port}").split()
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"), "JUPYTER_CONFIG_DIR": str(tmp_path / "config")}
    lab = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.time() + 120
        while url is None and time.time() < deadline:
            line = lab.stdout.readline()
            assert line or lab.poll() is None, "jupyter lab exited"
            m = re.search(rf"(http://127\.0\.0\.1:{port}/lab\?token=(\w+))", line)
            url = m and m.group(1)
        assert url, "jupyter lab printed no URL with a token"
        token = url.rsplit("=", 1)[1]
        deadline = time.time() + 60  # (the URL is printed a moment before the socket listens)
        while not listening_addresses(port) and time.time() < deadline:
            time.sleep(0.1)
        assert listening_addresses(port) == {"127.0.0.1"}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            assert client.get("/api/kernels").status_code == 403
            assert client.get("/api/kernels", headers={"Authorization": "token wrong"}).status_code == 403
            assert client.get("/api/kernels", headers={"Authorization": f"token {token}"}).status_code == 200
    finally:
        lab.terminate()
        try:
            lab.wait(30)
        except subprocess.TimeoutExpired:
            lab.kill()


def test_ray_address_locality():
    import ray

    own = ray.util.get_node_ip_address()  # the address a local Ray's GCS listens on
    for a in (None, "local", "auto", "127.0.0.1:6379", "ray://127.0.0.1:10001", "ray://localhost:10001", "[::1]:6379",
              "ray://127.0.1.1:10001", f"{own}:6379"):
        assert is_local_address(a), a
    for a in ("ray://10.0.0.5:10001", "10.0.0.5:6379", "ray://head:10001", "ray://[2001:db8::1]:10001", "0.0.0.0:6379"):
        assert not is_local_address(a), a
    assert ray_address_host("ray://head-node:10001/") == "head-node"


CASES = """
import json, os, sys, time
import ray, workbench
from workbench.cluster import InsecureRayAddress, check_ray_address

base = dict(os.environ)
results = []
for how, address, env in json.loads(sys.argv[1]):
    os.environ.clear()
    os.environ.update(base, **env)
    t0 = time.time()
    try:
        if how == "connect":
            workbench.connect(address, backend="reference", run_dir=sys.argv[2])
        else:
            check_ray_address(address)
        results.append({"refused": False, "mode": os.environ.get("RAY_AUTH_MODE")})
    except InsecureRayAddress as e:
        results.append({"refused": True, "message": str(e), "s": time.time() - t0, "ray_started": ray.is_initialized()})
print("RESULT " + json.dumps(results))
"""


def test_connect_refuses_a_non_local_ray_address_without_a_token(tmp_path):
    """connect("ray://10.0.0.5:10001") with no token anywhere is refused before anything starts
    (no Ray, no connection attempt), naming RAY_AUTH_TOKEN; so is RAY_AUTH_MODE=disabled. With a
    token (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token), the address passes the check
    and Ray's token mode is switched on for the client; a local address needs nothing. (One
    subprocess: HOME without this machine's ~/.ray/auth_token, no RAY_* variables.)"""
    home, other_home = tmp_path / "home", tmp_path / "home2"
    (other_home / ".ray").mkdir(parents=True)
    (other_home / ".ray" / "auth_token").write_text("t0ken")  # Ray's default token file
    home.mkdir()
    (tmp_path / "token").write_text("t0ken")
    remote = "ray://10.0.0.5:10001"
    cases = [
        ("connect", remote, {}),
        ("connect", None, {"RAY_ADDRESS": remote}),  # the cluster kernel's way
        ("connect", "ray://head:10001", {"RAY_AUTH_TOKEN": "t0ken", "RAY_AUTH_MODE": "disabled"}),
        ("connect", "ray://head:10001", {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")}),
        ("check", remote, {"RAY_AUTH_TOKEN": "t0ken"}),
        ("check", remote, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "token")}),
        ("check", remote, {"HOME": str(other_home)}),
        ("check", "ray://127.0.0.1:10001", {}),
        ("check", "auto", {}),
        # an SSH tunnel to a cluster with its token: sent (token mode was left off, the cluster refused)
        ("check", "ray://127.0.0.1:10001", {"RAY_AUTH_TOKEN": "t0ken"}),
        ("check", "localhost:6379", {"RAY_AUTH_TOKEN": "t0ken", "RAY_AUTH_MODE": "disabled"}),  # the user's choice
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["HOME"] = str(home)
    out = subprocess.run([sys.executable, "-c", CASES, json.dumps(cases), str(tmp_path / "run")], env=env,
                         capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    no_token, via_env, disabled, missing_file, *allowed = json.loads(line[0][len("RESULT "):])
    for r in (no_token, via_env, disabled, missing_file):
        assert r["refused"] and not r["ray_started"] and r["s"] < 5, r
    assert "RAY_AUTH_TOKEN" in no_token["message"] and "10.0.0.5" in no_token["message"]
    assert "internal network" in no_token["message"] and via_env["message"] == no_token["message"]
    assert "RAY_AUTH_MODE=disabled" in disabled["message"] and "RAY_AUTH_TOKEN_PATH" in missing_file["message"]
    assert allowed == [{"refused": False, "mode": "token"}] * 3 + [{"refused": False, "mode": None}] * 2 + [
        {"refused": False, "mode": "token"}, {"refused": False, "mode": "disabled"}]


def test_a_local_connect_shows_no_token_notice_and_a_cluster_keeps_it():
    """A new local Ray logs "Token authentication is enabled ..." as a warning (a red box under
    every notebook connect); init_ray drops that one message for the local default only."""
    import logging

    from workbench.cluster import _LocalTokenNotice

    code = ("import os; from workbench.cluster import init_ray, shutdown_ray; init_ray(num_cpus=1); "
            "print('mode', os.environ.get('RAY_AUTH_MODE')); shutdown_ray()")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "mode token" in out.stdout  # Ray took the path that logs the notice (it turned token mode on) ...
    assert "Token authentication" not in out.stderr  # ... and the notice did not show
    record = lambda msg: logging.LogRecord("ray", logging.WARNING, "", 0, msg, None, None)  # noqa: E731
    notice = _LocalTokenNotice()
    assert not notice.filter(record("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled"))
    assert notice.filter(record("Token authentication is disabled for this Ray cluster. Anyone with network access"))
