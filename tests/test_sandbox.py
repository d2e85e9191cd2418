"""The code-execution sandbox: output comes back; network, time and memory are denied."""


from workbench.sandbox import network_isolation_prefix, run_python


def test_runs_code_and_returns_output():
    r = run_python("print(6 * 7)")
    assert r.ok and r.stdout.strip() == "42" and not r.truncated


def test_no_network_even_to_loopback():
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    threading.Thread(target=lambda: srv.accept(), daemon=True).start()
    try:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        r = run_python(code)
        assert network_isolation_prefix() is not None
        assert "connected" not in r.stdout and r.exit_code != 0
        assert "unreachable" in r.stderr.lower() or "refused" in r.stderr.lower(), r.stderr
    finally:
        srv.close()


def test_wall_clock_timeout_kills():
    r = run_python("import time\nwhile True: time.sleep(0.1)", timeout_s=1.0)
    assert r.timed_out and not r.ok


def test_cpu_spin_is_killed():
    r = run_python("while True: pass", timeout_s=1.5)
    assert r.timed_out and not r.ok


def test_memory_limit_kills_big_allocations():
    r = run_python("x = bytearray(512 * 1024 * 1024)\nprint('allocated')", memory_mb=128)
    assert "allocated" not in r.stdout and r.exit_code != 0 and "MemoryError" in r.stderr


def test_output_is_truncated():
    r = run_python("print('x' * 100000)", max_output=100)
    assert r.truncated and len(r.stdout) == 100


def test_isolated_interpreter_sees_no_site_packages():
    r = run_python("import torch")
    assert r.exit_code != 0 and "ModuleNotFoundError" in r.stderr
