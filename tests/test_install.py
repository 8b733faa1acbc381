"""The built wheel installs and works: into a clean venv of Debian's python3.11 with pip, with
pipx and with uv, with no compiler and no index, then `egressbox check` and a confined curl
to a loopback origin through the installed command (judged by the origin's own log).

The wheel and its dependencies' wheels come from scripts/wheel (dist/, dist/wheelhouse), which
.ci/run runs before the tests: building needs the package index (the isolated build's
setuptools and mypy), which a test may not reach. Without them the tests skip and say so.
Every install runs with --no-index, a clean environment and PATH without a compiler.
"""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from egressbox.runner.facts import host_facts

ROOT = Path(__file__).resolve().parent.parent
DIST = Path(os.environ.get("EGRESSBOX_DIST", ROOT / "dist"))
DEBIAN_PYTHON = "/usr/bin/python3.11"
INSTALL_TIMEOUT = 300.0  # seconds; a wheel install here takes a few (docs/install.md)
RUN_TIMEOUT = 120.0

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox runs on Linux"),
    pytest.mark.timeout(900),
]


def _wheel() -> Path:
    wheels = sorted(DIST.glob("egressbox-*.whl"))
    if not wheels or not (DIST / "wheelhouse").is_dir():
        pytest.skip(f"no built wheel in {DIST} (scripts/wheel builds one; .ci/run does)")
    if not Path(DEBIAN_PYTHON).exists():
        pytest.skip(f"{DEBIAN_PYTHON} is missing (scripts/setup installs python3.11)")
    return wheels[-1]


def _clean_env(tmp: Path, bin_dir: Path) -> dict[str, str]:
    """No pip or uv configuration of this machine, no proxy, and no compiler on PATH."""
    return {
        "PATH": f"{bin_dir}",
        "HOME": str(tmp),
        "LANG": "C.UTF-8",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "UV_NO_CONFIG": "1",
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_CACHE_DIR": str(tmp / "uv-cache"),
        "CC": "/nonexistent/cc",
    }


def _run(argv: list[str], env: dict[str, str], timeout: float = INSTALL_TIMEOUT) -> str:
    done = subprocess.run(
        argv, capture_output=True, text=True, env=env, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"{argv}\nexit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def _install(how: str, tmp: Path) -> Path:
    """Install the wheel `how` (pip, pipx or uv); the path of its `egressbox` command."""
    wheel = _wheel()
    house = str(DIST / "wheelhouse")
    empty = tmp / "empty-bin"  # PATH for the installers: no gcc, cc or headers reachable
    empty.mkdir()
    env = _clean_env(tmp, empty)
    if how == "pip":
        venv = tmp / "venv"
        _run([DEBIAN_PYTHON, "-m", "venv", str(venv)], env)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index"]
        _run([*pip, "--find-links", house, str(wheel)], env)
        return venv / "bin" / "egressbox"
    if how == "pipx":
        env |= {"PIPX_HOME": str(tmp / "pipx"), "PIPX_BIN_DIR": str(tmp / "bin")}
        pipx = [sys.executable, "-m", "pipx", "install", "--python", DEBIAN_PYTHON]
        _run([*pipx, "--pip-args", f"--no-index --find-links {house}", str(wheel)], env)
        return tmp / "bin" / "egressbox"
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (the test extra brings it)")
    env |= {"UV_TOOL_DIR": str(tmp / "uv-tools"), "UV_TOOL_BIN_DIR": str(tmp / "bin")}
    tool = [uv, "tool", "install", "--python", DEBIAN_PYTHON, "--no-index"]
    _run([*tool, "--find-links", house, str(wheel)], env)
    return tmp / "bin" / "egressbox"


@pytest.fixture
def origin() -> Iterator[tuple[int, list[str]]]:
    """An HTTP origin on 127.0.0.1 that logs the paths it served."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "3")
            self.end_headers()
            self.wfile.write(b"ok\n")

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.mark.parametrize("how", ["pip", "pipx", "uv"])
def test_the_built_wheel_installs_and_confines_a_curl(
    how: str, tmp_path: Path, origin: tuple[int, list[str]]
) -> None:
    port, seen = origin
    command = _install(how, tmp_path)
    env = {
        "PATH": f"{command.parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "LANG": "C.UTF-8",
        "EGRESSBOX_STATE_DIR": str(tmp_path / "state"),
    }
    assert "egressbox" in _run([str(command), "--version"], env)
    # The compiled core came with the wheel (nothing was compiled here).
    python = Path(os.path.realpath(command)).parent / "python"
    if not python.exists():  # pipx and uv link the command; the venv's python is beside it
        python = Path(command.resolve()).parent / "python"
    probe = "import egressbox, sys; sys.exit(not egressbox.compiled_core())"
    _run([str(python), "-c", probe], env)
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["localhost:{port}"]\nallow_cidrs = ["127.0.0.1/32", "::1/128"]\n'
    )
    checked = _run([str(command), "check", str(policy)], env)
    assert "ok (1 allow" in checked and "warning" not in checked, checked
    facts = host_facts()
    if not {"landlock", "seccomp"} <= facts.available:
        pytest.skip(f"egressbox run cannot confine here: {facts.status}")
    workspace = tmp_path / "ws"
    workspace.mkdir()
    url = f"http://localhost:{port}/through-{how}"
    argv = [str(command), "run", "--quiet", "--policy", str(policy)]
    argv += ["--write-root", str(workspace), "--", "curl", "-sS", "--max-time", "20", url]
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        env=env,
        cwd=workspace,
        timeout=RUN_TIMEOUT,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    assert done.stdout == "ok\n"
    assert seen == [f"/through-{how}"]  # judged by the origin, on the host
