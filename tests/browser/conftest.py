"""Browser tests: JupyterLab in Debian's chromium, driven by Python Playwright (tests/browser/lab.py).

They skip, naming what to install, when chromium or the playwright package is missing
(`.ci/run` installs chromium with apt, so CI always runs them)."""

from __future__ import annotations

import tempfile

import pytest

from .lab import CHROMIUM_ARGS, Lab, chromium_path


@pytest.fixture(scope="session")
def chromium():
    path = chromium_path()
    if path is None:
        pytest.skip("no chromium found: install the Debian package `chromium` (apt-get install -y chromium) "
                    "to run the browser tests")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        pytest.skip("the Python package `playwright` is missing: scripts/setup.sh installs it (the dev extra)")
    return path


# one JupyterLab server for every browser test (its start is seconds); each test writes its own
# notebooks and shuts the kernels down first
@pytest.fixture(scope="session")
def lab(chromium, tmp_path_factory):
    from workbench.notebooks import ensure_kernel

    ensure_kernel("workbench-local")
    root = tmp_path_factory.mktemp("lab") / "root"
    root.mkdir()
    server = Lab(root)
    yield server
    server.stop()


# the browser lives for one test module, not the session: Playwright's sync API keeps an asyncio
# loop running in this thread while it is open, so every later asyncio.run() in the session (the
# engine and loopback tests) would fail with "cannot be called from a running event loop"
@pytest.fixture(scope="module")
def browser(chromium):
    """A function giving a fresh browser context (its own profile dir); each is closed at the end."""
    from playwright.sync_api import sync_playwright

    contexts, profiles = [], []
    with sync_playwright() as p:
        def new():
            profiles.append(tempfile.TemporaryDirectory(prefix="wb-chromium-", ignore_cleanup_errors=True))
            ctx = p.chromium.launch_persistent_context(profiles[-1].name, executable_path=chromium,
                                                       headless=True, args=CHROMIUM_ARGS,
                                                       viewport={"width": 1400, "height": 1000})
            contexts.append(ctx)
            return ctx

        yield new
        for ctx in contexts:
            ctx.close()
    for profile in profiles:  # ~2.5 MB each
        profile.cleanup()
