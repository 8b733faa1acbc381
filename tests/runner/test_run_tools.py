"""Real tools inside `egressbox run`, reaching loopback servers only through its proxy.

curl, wget, urllib, requests, httpx, aiohttp (HTTP and WebSocket), git over
dumb HTTP(S) and over ssh (ProxyCommand through the proxy), pip from a local
PEP 503 index, npm from a local registry, a workspace under /tmp, and a
console script installed in a venv. HTTPS uses a throwaway CA passed with
--grant (SSL_CERT_FILE, REQUESTS_CA_BUNDLE, CURL_CA_BUNDLE, PIP_CERT,
NODE_EXTRA_CA_CERTS, GIT_SSL_CAINFO; wget reads a wgetrc). Each test checks
the tool's real output and the run's audit records; curl and pip are also
refused a destination the policy does not name (403).

Every server is on 127.0.0.1 (tools_fixtures.py); the machine's own pip, npm
and git configuration is switched off so nothing reaches a mirror or the
internet. Every command is bounded by RUN_TIMEOUT.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tools_fixtures import (
    HELLO,
    CertificateAuthority,
    CommandFailedError,
    GitRepo,
    LoopThread,
    NpmPackage,
    Origin,
    Sshd,
    Tripwire,
    build_npm_tarball,
    build_wheel,
    make_ca,
    make_git_repo,
    missing_tools,
    run_command,
)

# Longest one `egressbox run` may take (pip and npm inside included).
RUN_TIMEOUT = 120.0
# The clients' own timeouts (seconds), inside the confined command.
CLIENT_TIMEOUT = 30
PROFILES = ("unrestricted", "workspace_paths", "worktree", "os_hardened")
EXIT_CANNOT_CONFINE = 126

pytestmark = pytest.mark.timeout(300)


# -- servers (one set per module: nothing of ours outlives this file) -------------------


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    if missing_tools("openssl"):
        pytest.skip("the openssl command is not installed")
    return make_ca(tmp_path_factory.mktemp("ca"))


@dataclass(frozen=True)
class Artifacts:
    wheels: Path  # a --find-links directory
    tinypkg: Path  # served by the index (pip test)
    tinytool: Path  # a console script (venv test)
    npm: NpmPackage
    repo: GitRepo | None


TINYPKG_VALUE = "tinypkg from the loopback index"
TINYTOOL_MAIN = """\
import sys
import urllib.request


def main() -> None:
    with urllib.request.urlopen(sys.argv[1], timeout=30) as reply:
        print("tinytool got:", reply.read().decode().strip())
"""
NPM_VALUE = "tinynpm from the loopback registry"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Artifacts:
    folder = tmp_path_factory.mktemp("artifacts")
    wheels = folder / "wheels"
    tinypkg = build_wheel(
        wheels, "tinypkg", "1.0", {"tinypkg/__init__.py": f"VALUE = {TINYPKG_VALUE!r}\n"}
    )
    tinytool = build_wheel(
        wheels,
        "tinytool",
        "1.0",
        {"tinytool/__init__.py": "", "tinytool/main.py": TINYTOOL_MAIN},
        console_scripts={"tinytool": "tinytool.main:main"},
    )
    index_js = f"module.exports = {{ value: {json.dumps(NPM_VALUE)} }};\n"
    tarball = build_npm_tarball("tinynpm", "1.0.0", {"index.js": index_js})
    npm = NpmPackage("tinynpm", "1.0.0", tarball)
    repo = None
    if not missing_tools("git"):
        files = {"README.md": "cloned through egressbox\n", "src/data.txt": "line 1\nline 2\n"}
        repo = make_git_repo(folder / "git", files)
    return Artifacts(wheels, tinypkg, tinytool, npm, repo)


# Named like the conftest's function-scoped `origin` on purpose: in this module
# every test talks to this one module-wide origin instead.
@pytest.fixture(scope="module")
def origin(ca: CertificateAuthority, artifacts: Artifacts) -> Iterator[Origin]:
    thread = LoopThread()
    server = Origin(ca, wheels=[artifacts.tinypkg, artifacts.tinytool])
    server.npm_packages[artifacts.npm.name] = artifacts.npm
    if artifacts.repo is not None:
        server.git_repos["repo.git"] = artifacts.repo
    try:
        thread.call(server.start())
        yield server
    finally:
        thread.call(server.close())
        thread.close()


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    missing = missing_tools("ssh", "ssh-keygen", "nc", "git")
    if missing or not os.path.isfile(shutil.which("sshd") or "/usr/sbin/sshd"):
        pytest.skip(f"git over ssh needs ssh, sshd, ssh-keygen, nc: missing {missing or ['sshd']}")
    server = Sshd(tmp_path_factory.mktemp("sshd"))
    try:
        try:
            server.start()
        except CommandFailedError as exc:
            if os.geteuid() == 0:
                raise
            pytest.skip(f"a throwaway sshd does not start for a non-root user here: {exc}")
        yield server
    finally:
        server.stop()


@pytest.fixture
def tripwire() -> Iterator[Tripwire]:
    wire = Tripwire()
    yield wire
    wire.close()


# -- one confined workspace per test ----------------------------------------------------

# Variables of the caller that would steer a tool to the machine's own
# mirrors, proxies or CA files (FIELD-NOTES: this machine's pip and npm
# configuration points at local mirrors), or nest a profile.
_DROP_PREFIXES = ("PIP_", "NPM_CONFIG_", "GIT_", "EGRESSBOX_", "UV_", "YARN_")
_DROP_NAMES = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "NODE_OPTIONS",
    "WGETRC",
    "PYTHONPATH",
    "PYTHONHOME",
    "VIRTUAL_ENV",
    "CURL_HOME",
)


def clean_environment(home: Path, empty: Path) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if "proxy" not in name.lower()
        and not name.upper().startswith(_DROP_PREFIXES)
        and name.upper() not in _DROP_NAMES
    }
    env |= {
        "HOME": str(home),
        "PIP_CONFIG_FILE": os.devnull,  # no pip.conf at all (the machine's points at mirrors)
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_NO_INPUT": "1",
        "npm_config_userconfig": str(empty / "npmrc"),
        "npm_config_globalconfig": str(empty / "global-npmrc"),
        "npm_config_update_notifier": "false",
        "npm_config_audit": "false",
        "npm_config_fund": "false",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
    }
    return env


@dataclass
class Box:
    """A workspace under /tmp, a policy naming the loopback servers, and an audit log."""

    root: Path
    workspace: Path
    ca: CertificateAuthority
    env: dict[str, str]
    allow_ports: list[int]
    policy_file: Path = field(init=False)
    audit_log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.policy_file = self.root / "policy.toml"
        self.audit_log = self.root / "audit.jsonl"
        allow = ", ".join(f'"localhost:{port}"' for port in self.allow_ports)
        self.policy_file.write_text(
            f'[egress]\nallow = [{allow}]\nallow_cidrs = ["127.0.0.1/32", "::1/128"]\n',
            encoding="utf-8",
        )

    def ca_grants(self) -> dict[str, str]:
        cafile = str(self.ca.ca_cert)
        names = (
            "SSL_CERT_FILE",
            "REQUESTS_CA_BUNDLE",
            "CURL_CA_BUNDLE",
            "PIP_CERT",
            "NODE_EXTRA_CA_CERTS",
            "GIT_SSL_CAINFO",
        )
        return dict.fromkeys(names, cafile)

    def run(
        self,
        *cmd: str,
        grants: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        profile: str | None = None,
        read_roots: Sequence[Path] = (),
        report: bool = False,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        args = [sys.executable, "-m", "egressbox", "run", "--policy", str(self.policy_file)]
        if report:
            args.append("--report")
        args += ["--write-root", str(self.workspace), "--audit-log", str(self.audit_log)]
        # The CA lives outside the workspace, under /tmp: it must be bound back read-only.
        for root in (self.ca.ca_cert.parent, *read_roots):
            args += ["--read-root", str(root)]
        if profile is not None:
            args += ["--profile", profile]
        for name, value in (self.ca_grants() | dict(grants or {})).items():
            args += ["--grant", f"{name}={value}"]
        done = subprocess.run(
            [*args, "--", *cmd],
            cwd=self.workspace,
            env=self.env | dict(env or {}),
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise AssertionError(describe(done))
        return done

    def records(self) -> list[dict[str, Any]]:
        if not self.audit_log.exists():
            return []
        lines = self.audit_log.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line]

    def decisions(self) -> set[tuple[str, str, int, str, str]]:
        return {
            (r["protocol"], r["host"], r["port"], r["decision"], r["reason"])
            for r in self.records()
        }


def describe(done: subprocess.CompletedProcess[str]) -> str:
    return (
        f"exit {done.returncode}: {shlex.join(str(a) for a in done.args)}\n"
        f"--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )


@pytest.fixture
def box(tmp_path: Path, origin: Origin, ca: CertificateAuthority) -> Box:
    """tmp_path is under /tmp: `--write-root tmp_path/ws` must just work."""
    workspace = tmp_path / "ws"
    home = workspace / "home"
    home.mkdir(parents=True)
    empty = workspace / "empty-config"
    empty.mkdir()
    for name in ("npmrc", "global-npmrc"):
        (empty / name).write_text("", encoding="utf-8")
    env = clean_environment(home, empty)
    return Box(tmp_path, workspace, ca, env, [origin.http_port, origin.https_port])


def allowed(protocol: str, port: int) -> tuple[str, str, int, str, str]:
    return (protocol, "localhost", port, "allow", "allowed")


def denied(protocol: str, port: int) -> tuple[str, str, int, str, str]:
    return (protocol, "localhost", port, "deny", "no_allow_rule")


def target(origin: Origin, scheme: str, path: str = "/hello") -> tuple[str, str, int]:
    """(URL, audit protocol, port): https goes through CONNECT, http is forwarded."""
    if scheme == "https":
        return origin.url(path), "connect", origin.https_port
    return origin.url(path, tls=False), "http", origin.http_port


# -- curl and wget ----------------------------------------------------------------------


@pytest.mark.parametrize("profile", PROFILES)
@pytest.mark.parametrize("scheme", ["https", "http"])
def test_curl_through_the_proxy(box: Box, origin: Origin, profile: str, scheme: str) -> None:
    if missing_tools("curl"):
        pytest.skip("curl is not installed")
    url, protocol, port = target(origin, scheme)
    done = box.run(
        "curl", "-q", "-sS", "--max-time", str(CLIENT_TIMEOUT), url, profile=profile, check=False
    )
    if done.returncode == EXIT_CANNOT_CONFINE and profile == "os_hardened":
        pytest.skip(f"os_hardened refused on this host: {done.stderr.strip()}")
    assert done.returncode == 0, describe(done)
    assert done.stdout == HELLO
    assert allowed(protocol, port) in box.decisions()


def test_curl_denied_destination_is_refused_with_403(
    box: Box, origin: Origin, tripwire: Tripwire
) -> None:
    if missing_tools("curl"):
        pytest.skip("curl is not installed")
    curl = ["curl", "-q", "-sS", "--max-time", str(CLIENT_TIMEOUT)]
    https = box.run(
        *curl,
        "-o",
        "/dev/null",
        "-w",
        "%{http_connect}",
        f"https://localhost:{tripwire.port}/",
        check=False,
    )
    assert https.returncode == 56, describe(https)  # CONNECT tunnel failed
    assert https.stdout == "403"
    plain = box.run(*curl, "-D", "-", f"http://localhost:{tripwire.port}/secret", check=False)
    assert plain.returncode == 0, describe(plain)
    assert plain.stdout.startswith("HTTP/1.1 403"), plain.stdout
    assert "x-egressbox-reason: no_allow_rule" in plain.stdout.lower()
    assert {denied("connect", tripwire.port), denied("http", tripwire.port)} <= box.decisions()
    assert "refused by egress" in https.stderr
    assert tripwire.connections() == 0


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_wget_through_the_proxy(box: Box, origin: Origin, scheme: str) -> None:
    if missing_tools("wget"):
        pytest.skip("wget is not installed")
    # Debian's wget reads no CA variable: a wgetrc names the CA.
    wgetrc = box.workspace / "wgetrc"
    wgetrc.write_text(f"ca_certificate = {box.ca.ca_cert}\n", encoding="utf-8")
    url, protocol, port = target(origin, scheme)
    done = box.run(
        "wget",
        "-nv",
        "-T",
        str(CLIENT_TIMEOUT),
        "-t",
        "1",
        "-O",
        "-",
        url,
        env={"WGETRC": str(wgetrc)},
    )
    assert done.stdout == HELLO
    assert allowed(protocol, port) in box.decisions()


# -- Python clients ---------------------------------------------------------------------

PYTHON_CLIENTS = {
    "urllib": """
        import sys, urllib.request
        with urllib.request.urlopen(sys.argv[1], timeout=30) as reply:
            sys.stdout.write(reply.read().decode())
    """,
    "requests": """
        import sys, requests
        reply = requests.get(sys.argv[1], timeout=30)
        reply.raise_for_status()
        sys.stdout.write(reply.text)
    """,
    # httpx without its socks extra: all_proxy must be the HTTP proxy URL.
    "httpx": """
        import os, sys, httpx
        assert os.environ["all_proxy"].startswith("http://"), os.environ["all_proxy"]
        with httpx.Client(timeout=30) as client:
            reply = client.get(sys.argv[1])
            reply.raise_for_status()
            sys.stdout.write(reply.text)
    """,
    "aiohttp": """
        import asyncio, sys, aiohttp

        async def main():
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(trust_env=True, timeout=timeout) as session:
                async with session.get(sys.argv[1]) as reply:
                    reply.raise_for_status()
                    sys.stdout.write(await reply.text())

        asyncio.run(main())
    """,
}


@pytest.mark.parametrize("client", sorted(PYTHON_CLIENTS))
@pytest.mark.parametrize("scheme", ["https", "http"])
def test_python_client_through_the_proxy(
    box: Box, origin: Origin, client: str, scheme: str
) -> None:
    pytest.importorskip(client)
    url, protocol, port = target(origin, scheme)
    # sys.executable is the project's venv python (a symlink to the base
    # interpreter): the venv must be granted from the path as named.
    code = textwrap.dedent(PYTHON_CLIENTS[client])
    done = box.run(sys.executable, "-c", code, url)
    assert done.stdout == HELLO
    assert allowed(protocol, port) in box.decisions()


AIOHTTP_WEBSOCKET = """
    import asyncio, sys, aiohttp

    async def main():
        timeout = aiohttp.ClientTimeout(total=30)
        async with aiohttp.ClientSession(trust_env=True, timeout=timeout) as session:
            async with session.ws_connect(sys.argv[1]) as ws:
                await ws.send_str("ping")
                message = await ws.receive(timeout=30)
                print(message.data)

    asyncio.run(main())
"""


# ws:// through an HTTP proxy is `GET ws://host/path` with Upgrade (relayed
# after the 101); wss:// is a CONNECT tunnel.
@pytest.mark.parametrize("scheme", ["wss", "ws"])
def test_aiohttp_websocket_through_the_proxy(box: Box, origin: Origin, scheme: str) -> None:
    """aiohttp takes a WebSocket's proxy only from ws_proxy/wss_proxy."""
    url, protocol, port = target(origin, "https" if scheme == "wss" else "http", "/ws")
    url = scheme + url[url.index(":") :]
    done = box.run(sys.executable, "-c", textwrap.dedent(AIOHTTP_WEBSOCKET), url)
    assert done.stdout == "echo: ping\n"
    assert allowed(protocol, port) in box.decisions()


# -- git --------------------------------------------------------------------------------


def cloned_files(clone: Path, repo: GitRepo) -> None:
    for path, text in repo.files.items():
        assert (clone / path).read_text(encoding="utf-8") == text
    head = run_command(["git", "-C", str(clone), "rev-parse", "HEAD"]).stdout.strip()
    assert head == repo.commit


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_git_clone_over_http(box: Box, origin: Origin, artifacts: Artifacts, scheme: str) -> None:
    if artifacts.repo is None:
        pytest.skip("git is not installed")
    url, protocol, port = target(origin, scheme, "/git/repo.git")
    mark = len(origin.requests)
    done = box.run("git", "clone", "-q", url, "clone")
    cloned_files(box.workspace / "clone", artifacts.repo)
    assert allowed(protocol, port) in box.decisions(), describe(done)
    refs = (scheme, "/git/repo.git/info/refs?service=git-upload-pack")
    assert refs in origin.seen_since(mark)


def test_git_clone_over_ssh(box: Box, sshd: Sshd, artifacts: Artifacts) -> None:
    """A granted GIT_SSH_COMMAND keeps its options and gains the ProxyCommand (nc -X connect)."""
    assert artifacts.repo is not None
    policy = Box(box.root, box.workspace, box.ca, box.env, [sshd.port])
    # ~/.ssh is on the credential read-deny list: the key comes from the workspace.
    key = box.workspace / "id_test"
    shutil.copyfile(sshd.client_key, key)
    key.chmod(0o600)
    ssh = f"ssh -F /dev/null -i {key} -o IdentitiesOnly=yes -o BatchMode=yes"
    ssh += " -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null"
    url = f"ssh://{sshd.user}@localhost:{sshd.port}{artifacts.repo.bare}"
    script = 'printf "%s\\n" "$GIT_SSH_COMMAND"; exec git clone -q "$1" clone'
    done = policy.run("sh", "-c", script, "sh", url, grants={"GIT_SSH_COMMAND": ssh})
    used = done.stdout.splitlines()[0]
    assert used.startswith("ssh -o ProxyCommand='nc -X connect -x 127.0.0.1:"), used
    assert used.endswith(ssh.removeprefix("ssh")), used
    cloned_files(box.workspace / "clone", artifacts.repo)
    assert allowed("connect", sshd.port) in policy.decisions()


# -- pip and npm ------------------------------------------------------------------------

PIP_INSTALL = ["-m", "pip", "install", "--no-cache-dir", "--retries", "0", "--timeout", "30"]


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_pip_install_from_a_local_index(box: Box, origin: Origin, scheme: str) -> None:
    url, protocol, port = target(origin, scheme, "/simple/")
    mark = len(origin.requests)
    box.run(sys.executable, *PIP_INSTALL, "--index-url", url, "--target", "t", "tinypkg")
    target_dir = box.workspace / "t"
    assert (target_dir / "tinypkg" / "__init__.py").is_file()
    imported = run_command(
        [sys.executable, "-c", "import tinypkg; print(tinypkg.VALUE)"],
        env=box.env | {"PYTHONPATH": str(target_dir)},
    )
    assert imported.stdout == f"{TINYPKG_VALUE}\n"
    assert allowed(protocol, port) in box.decisions()
    assert (scheme, "/files/tinypkg-1.0-py3-none-any.whl") in origin.seen_since(mark)


@pytest.mark.parametrize("scheme", ["https", "http"])
def test_uv_pip_install_from_a_local_index(box: Box, origin: Origin, scheme: str) -> None:
    uv = os.path.join(os.path.dirname(sys.executable), "uv")
    if not os.access(uv, os.X_OK):
        pytest.skip("uv is not installed beside this interpreter (the test extra installs it)")
    url, protocol, port = target(origin, scheme, "/simple/")
    mark = len(origin.requests)
    box.run(
        uv,
        "pip",
        "install",
        "--no-cache",
        "--python",
        sys.executable,
        "--index-url",
        url,
        "--target",
        "t",
        "tinypkg",
    )
    assert (box.workspace / "t" / "tinypkg" / "__init__.py").is_file()
    assert allowed(protocol, port) in box.decisions()
    assert (scheme, "/files/tinypkg-1.0-py3-none-any.whl") in origin.seen_since(mark)


def test_a_test_runner_inside_run(box: Box) -> None:
    tests = box.workspace / "test_inside.py"
    tests.write_text("def test_ok():\n    assert 1 + 1 == 2\n", encoding="utf-8")
    done = box.run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests))
    assert "1 passed" in done.stdout, describe(done)


def test_pip_denied_index_is_refused_with_403(box: Box, tripwire: Tripwire) -> None:
    index = f"https://localhost:{tripwire.port}/simple/"
    # pip logs why it could not fetch the index page only at -vv.
    done = box.run(
        sys.executable,
        *PIP_INSTALL,
        "-vv",
        "--index-url",
        index,
        "--target",
        "t",
        "tinypkg",
        check=False,
    )
    assert done.returncode == 1, describe(done)
    assert "Tunnel connection failed: 403" in done.stdout + done.stderr, describe(done)
    assert denied("connect", tripwire.port) in box.decisions()
    assert f"refused by egress: localhost:{tripwire.port} (no_allow_rule)" in done.stderr
    assert tripwire.connections() == 0


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_npm_install_from_a_local_registry(box: Box, origin: Origin, scheme: str) -> None:
    if missing_tools("node", "npm"):
        pytest.skip("node/npm is not installed")
    registry, protocol, port = target(origin, scheme, "/npm/")
    script = (
        "set -e\n"
        'npm install --no-audit --no-fund --registry "$1" tinynpm\n'
        "exec node -e \"console.log(require('tinynpm').value)\""
    )
    done = box.run("sh", "-c", script, "sh", registry)
    assert done.stdout.splitlines()[-1] == NPM_VALUE, describe(done)
    assert (box.workspace / "node_modules" / "tinynpm" / "index.js").is_file()
    assert allowed(protocol, port) in box.decisions()


# -- the workspace and a venv -----------------------------------------------------------


def test_workspace_under_tmp(box: Box) -> None:
    """The workspace under /tmp is bound back; the rest of /tmp is hidden; TMPDIR is inside."""
    outside = box.root / "outside.txt"
    outside.write_text("not for the child\n", encoding="utf-8")
    script = (
        'pwd; echo written > made-inside.txt; t=$(mktemp); echo scratch > "$t"; echo "$t"\n'
        'if [ -e "$1" ]; then echo visible; else echo hidden; fi'
    )
    done = box.run("sh", "-c", script, "sh", str(outside), report=True)
    cwd, scratch, visibility = done.stdout.splitlines()
    assert cwd == str(box.workspace)
    assert (box.workspace / "made-inside.txt").read_text(encoding="utf-8") == "written\n"
    assert scratch.startswith(str(box.workspace / ".egressbox" / "tmp") + "/")
    assert Path(scratch).read_text(encoding="utf-8") == "scratch\n"
    if "enforcement: mount_namespace: full" in done.stderr:
        assert visibility == "hidden"  # the rest of /tmp is behind a private tmpfs


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_console_script_installed_in_a_venv(
    box: Box, origin: Origin, artifacts: Artifacts, where: str
) -> None:
    """A venv's console script, found on PATH; the venv inside or outside the workspace."""
    venv = (box.workspace if where == "inside" else box.root) / "tool-venv"
    base = os.path.realpath(sys.executable)  # the base interpreter of the test's venv
    run_command([base, "-m", "venv", "--without-pip", str(venv)])
    pip_env = box.env | {"PIP_CONFIG_FILE": os.devnull}
    run_command(
        [
            *(sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install"),
            *("--no-index", "--find-links", str(artifacts.wheels), "tinytool"),
        ],
        env=pip_env,
    )
    path = f"{venv / 'bin'}{os.pathsep}{box.env.get('PATH', os.defpath)}"
    done = box.run("tinytool", origin.url(), env={"PATH": path, "VIRTUAL_ENV": str(venv)})
    assert done.stdout == f"tinytool got: {HELLO.strip()}\n"
    assert allowed("connect", origin.https_port) in box.decisions()
