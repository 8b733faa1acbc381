"""Credential brokering inside `egressbox run`: the child holds a placeholder, the proxy puts
the real value into requests to the one host it is bound to.

Real clients inside the sandbox (curl, Python requests and httpx, git over HTTPS with
http.extraHeader, Node's fetch, which ignores the proxy variables and so goes through
capture, and pip against a token-protected simple index with the placeholder in the index
URL's credentials) reach a loopback HTTPS origin (Python's ssl server, its certificate from
a test CA given as [tls] origin_ca) that accepts only the real token. Judged from the host:
the origin's log, the audit log, the run's output, the files the child downloaded; the real
value is searched for in every one of them, in what the child saw of its environment and
its CA bundle, and in a dump of a client's memory taken after its request. The same as the
unprivileged test user (tests/unprivileged.py). A from_command that fails ends the run with
exit 2 before the command starts.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressbox.proxy.ca import CertificateAuthority
from egressbox.runner.facts import host_facts
from unprivileged import Actor, UnavailableError, unprivileged_actor

pytestmark = [
    pytest.mark.skipif(sys.platform != "linux", reason="egressbox run confines on Linux only"),
    pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl"),
    pytest.mark.timeout(300),
]

TOKEN = "real-token-0b8d2c41e9"
RUN_TIMEOUT = 120.0
# An empty repository's ref advertisement (git's smart HTTP, protocol v0): `ls-remote` succeeds.
EMPTY_REFS = b"001e# service=git-upload-pack\n0000" + b"0000"


# The package the token-protected index serves (a wheel the test builds).
PACKAGE = "tinypkg"
WHEEL = f"{PACKAGE}-0.1-py3-none-any.whl"


def _holds_token(auth: str) -> bool:
    """The real token as a Bearer value or as a Basic credential's password."""
    if TOKEN in auth:
        return True
    scheme, _, rest = auth.partition(" ")
    if scheme.lower() != "basic":
        return False
    try:
        return base64.b64decode(rest).decode().partition(":")[2] == TOKEN
    except ValueError:
        return False


def build_wheel() -> bytes:
    """A minimal, valid pure-Python wheel (PEP 427) of PACKAGE."""
    dist = f"{PACKAGE}-0.1.dist-info"
    files = {
        f"{PACKAGE}/__init__.py": b"ANSWER = 42\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: 0.1\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = ""
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record += f"{name},sha256={digest},{len(data)}\n"
    files[f"{dist}/RECORD"] = (record + f"{dist}/RECORD,,\n").encode()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, data in files.items():  # a fixed date: the same bytes on every build
            archive.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return out.getvalue()


@dataclass
class Origin:
    port: int = 0
    seen: list[tuple[str, str, str, str]] = field(default_factory=list)  # method path auth agent

    def authorized(self) -> list[tuple[str, str]]:
        return [(p, agent.split("/")[0]) for _, p, auth, agent in self.seen if _holds_token(auth)]


def _content(path: str, wheel: bytes) -> tuple[bytes, str]:
    """What the origin serves an authorized GET of `path`: git's refs, the index, the wheel."""
    if "/info/refs" in path:
        return EMPTY_REFS, "application/x-git-upload-pack-advertisement"
    if path.rstrip("/") == f"/simple/{PACKAGE}":
        digest = hashlib.sha256(wheel).hexdigest()
        page = f'<html><body><a href="/files/{WHEEL}#sha256={digest}">{WHEEL}</a></body></html>'
        return page.encode(), "text/html"
    if path == f"/files/{WHEEL}":
        return wheel, "application/octet-stream"
    return b"welcome\n", "text/plain"


def _origin(context: ssl.SSLContext) -> tuple[Origin, http.server.ThreadingHTTPServer]:
    found = Origin()
    wheel = build_wheel()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            auth = self.headers.get("Authorization") or ""
            agent = self.headers.get("User-Agent") or ""
            found.seen.append((self.command, self.path, auth, agent))
            ok = _holds_token(auth)
            body, kind = _content(self.path, wheel) if ok else (b"no\n", "text/plain")
            self.send_response(200 if ok else 401)
            if not ok:  # pip sends its credentials only once asked (RFC 7617)
                self.send_header("WWW-Authenticate", 'Basic realm="index"')
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    found.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return found, server


@dataclass
class Box:
    tmp: Path
    bound: Origin
    other: Origin
    origin_ca: Path

    def policy(self) -> Path:
        b, o = self.bound.port, self.other.port
        text = f"""
[egress]
allow = ["127.0.0.1:{b}", "127.0.0.1:{o}"]
allow_cidrs = ["127.0.0.1/32"]

[[secret]]
name = "API_TOKEN"
from_env = "EGRESSBOX_TEST_REAL"
hosts = ["127.0.0.1:{b}"]
header = "Authorization"
format = "Bearer {{value}}"

[[request_rule]]
hosts = ["127.0.0.1:{o}"]

[tls]
origin_ca = "{self.origin_ca}"
"""
        path = self.tmp / "policy.toml"
        path.write_text(text)
        return path

    def run(
        self, script: str, *, actor: Actor | None = None, policy: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`egressbox run` of `script` (as `actor`: the unprivileged test user)."""
        env = dict(os.environ, EGRESSBOX_TEST_REAL=TOKEN, API_TOKEN=TOKEN)  # granted or not
        egressbox = [sys.executable, "-m", "egressbox"]
        if actor is not None:
            env = dict(actor.base_env("/nonexistent"), EGRESSBOX_TEST_REAL=TOKEN, API_TOKEN=TOKEN)
            egressbox = list(actor.egressbox)
        argv = [
            *egressbox,
            "run",
            "--policy",
            str(policy or self.policy()),
            "--audit-log",
            str(self.tmp / "audit.jsonl"),
            "--read-root",
            sys.prefix,
            "--grant",
            "API_TOKEN",
            "--",
            "/bin/sh",
            "-c",
            script,
        ]
        if actor is not None:
            argv, env = actor.command(argv, env)
        return subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=env,
            cwd=self.tmp,
            timeout=RUN_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )

    def records(self) -> list[tuple[str, int, str, str]]:
        lines = (self.tmp / "audit.jsonl").read_text().splitlines()
        return [
            (r["protocol"], r["port"], r["decision"], r["reason"]) for r in map(json.loads, lines)
        ]


@pytest.fixture
def box(tmp_path: Path) -> Iterator[Box]:
    with _box(tmp_path) as made:
        yield made


@contextlib.contextmanager
def _box(tmp_path: Path) -> Iterator[Box]:
    facts = host_facts()
    if not {"network_namespace", "mount_namespace"} <= facts.available:
        pytest.skip(f"the child's view needs a mount and network namespace: {facts.status}")
    tmp_path.chmod(0o755)
    ca = CertificateAuthority.generate()
    origin_ca = tmp_path / "origin-ca.pem"
    origin_ca.write_text(ca.cert_pem)
    bound, s1 = _origin(ca.server_context("127.0.0.1"))
    other, s2 = _origin(ca.server_context("127.0.0.1"))
    try:
        yield Box(tmp_path, bound, other, origin_ca)
    finally:
        for server in (s1, s2):
            server.shutdown()
            server.server_close()


def _python(code: str) -> str:
    return f"{sys.executable} -c '{code}'; "


def test_real_clients_reach_the_origin_with_the_value_they_never_hold(box: Box) -> None:
    url = f"https://127.0.0.1:{box.bound.port}"
    script = (
        'echo "env=$API_TOKEN"; '
        "cat /etc/ssl/certs/ca-certificates.crt > seen-bundle.pem; env > seen-env.txt; "
        f"curl -sS --max-time 20 {url}/curl; "
        f'curl -sS --max-time 20 -H "Authorization: token $API_TOKEN" {url}/curl-sent; '
        + _python(f'import requests; print(requests.get("{url}/requests", timeout=20).text)')
        + _python(f'import httpx; print(httpx.get("{url}/httpx", timeout=20).text)')
        + f'git -c http.extraHeader="Authorization: Bearer $API_TOKEN" ls-remote {url}/repo.git '
        "&& echo git-ok; "
        # The same placeholder to another allowed (terminated) host: refused.
        f'curl -sS -o /dev/null -w "other=%{{http_code}}\\n" -H "X-Key: $API_TOKEN" '
        f"https://127.0.0.1:{box.other.port}/leak"
    )
    done = box.run(script)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "env=egressbox-placeholder-API_TOKEN-" in done.stdout
    assert done.stdout.count("welcome") == 4 and "git-ok" in done.stdout, out
    assert "other=403" in done.stdout
    assert [agent for _, agent in box.bound.authorized()] == [
        "curl",
        "curl",
        "python-requests",
        "python-httpx",
        "git",
    ]
    assert box.other.seen == []
    records = box.records()
    assert ("connect", box.other.port, "deny", "secret_misdirected") in records
    # The child's view: its bundle is the system's plus the run's CA; its environment and
    # files hold the placeholder, never the value (and the host's bundle is untouched).
    bundle = (box.tmp / "seen-bundle.pem").read_text()
    assert bundle.count("BEGIN CERTIFICATE") >= 2
    assert bundle != Path("/etc/ssl/certs/ca-certificates.crt").read_text()
    seen_env = (box.tmp / "seen-env.txt").read_text()
    assert "REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt" in seen_env
    for text in (out, seen_env, bundle, (box.tmp / "audit.jsonl").read_text()):
        assert TOKEN not in text


def _dump_own_memory(where: Path, url: str) -> str:
    """A Python client that makes its request with the placeholder, then writes every
    readable mapping of its own memory to mem.bin (what a core dump would hold)."""
    code = f"""
import os, re, requests
token = os.environ["API_TOKEN"]
print(requests.get("{url}/dumped", headers={{"X-Held": token}}, timeout=20).text)
out = open("mem.bin", "wb")
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        start, end = (int(x, 16) for x in line.split()[0].split("-"))
        if line.split()[1][0] != "r" or "[vvar" in line or "[vsyscall" in line:
            continue
        try:
            mem.seek(start)
            out.write(mem.read(end - start))
        except (OSError, ValueError, OverflowError):
            pass
"""
    (where / "dump.py").write_text(code)
    return f"{sys.executable} dump.py; "


def test_node_fetch_pip_and_a_memory_dump(box: Box) -> None:
    """Node's fetch (no proxy variables: captured), pip from a token-protected index with
    the placeholder as the index URL's password, and a client's own memory after its
    request: the origin gets the real token, the child holds only the placeholder."""
    if shutil.which("node") is None:
        pytest.skip("needs node")
    url = f"https://127.0.0.1:{box.bound.port}"
    index = f"https://__token__:$API_TOKEN@127.0.0.1:{box.bound.port}/simple/"
    pip = f"{sys.executable} -m pip --disable-pip-version-check --no-cache-dir -q"
    script = (
        f'node -e \'fetch("{url}/node").then(r => r.text()).then(t => console.log("node:", t))\'; '
        f"{pip} download --no-deps -d dl --index-url {index} {PACKAGE} && echo pip-download-ok; "
        f'PIP_INDEX_URL="{index}" {pip} install --no-deps --target site {PACKAGE} '
        "&& echo pip-install-ok; " + _dump_own_memory(box.tmp, url)
    )
    done = box.run(script)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "node: welcome" in done.stdout, out
    assert "pip-download-ok" in done.stdout and "pip-install-ok" in done.stdout, out
    agents = [agent for _, agent in box.bound.authorized()]
    assert agents.count("node") == 1 and agents.count("pip") >= 4, box.bound.seen
    assert agents[-1] == "python-requests"
    # Judged on the host: the files pip got are the origin's wheel, installed.
    assert (box.tmp / "dl" / WHEEL).read_bytes() == build_wheel()
    assert (box.tmp / "site" / PACKAGE / "__init__.py").read_text() == "ANSWER = 42\n"
    # The captured connection (Node's) was decided and audited as any.
    assert ("tcp", box.bound.port, "allow", "allowed") in box.records()
    memory = (box.tmp / "mem.bin").read_bytes()
    assert b"egressbox-placeholder-API_TOKEN-" in memory  # the dump holds what it held
    assert TOKEN.encode() not in memory
    for text in (out, (box.tmp / "audit.jsonl").read_text()):
        assert TOKEN not in text
    for path in (box.tmp / "site").rglob("*"):
        assert path.is_dir() or TOKEN.encode() not in path.read_bytes()


@pytest.mark.parametrize(
    ("command", "said"),
    [
        ('["false"]', "from_command false exited with 1"),
        (
            '["egressbox-no-such-command"]',
            "from_command egressbox-no-such-command cannot run: No such file or directory",
        ),
        (
            '["sh", "-c", "echo half; exit 7"]',
            "from_command sh -c 'echo half; exit 7' exited with 7",
        ),
    ],
)
def test_a_failing_from_command_ends_the_run_before_it_starts(
    box: Box, command: str, said: str
) -> None:
    text = (
        box.policy()
        .read_text()
        .replace('from_env = "EGRESSBOX_TEST_REAL"', f"from_command = {command}")
    )
    policy = box.tmp / "command.toml"
    policy.write_text(text)
    done = box.run("touch ran", policy=policy)
    assert done.returncode == 2, done.stderr
    assert not (box.tmp / "ran").exists()  # the command never started
    # One line says it, last (after the run's own announcements), and no traceback.
    assert done.stderr.splitlines()[-1] == f"egressbox: [[secret]] API_TOKEN: {said}"
    assert done.stderr.count("[[secret]]") == 1 and "Traceback" not in done.stderr
    assert box.bound.seen == []


@pytest.fixture
def test_user() -> Actor:
    try:
        return unprivileged_actor()
    except UnavailableError as exc:
        pytest.skip(str(exc))


def test_as_the_unprivileged_user(test_user: Actor) -> None:
    """`egressbox run` started by the unprivileged test user: its own user namespace builds
    the child's view with the run's CA; the origin gets the real token."""
    from unprivileged import BASE_DIR

    top = test_user.make_dir(BASE_DIR, "run-secrets-")
    try:
        with _box(top) as made:
            made.origin_ca.chmod(0o644)
            url = f"https://127.0.0.1:{made.bound.port}"
            script = (
                'echo "env=$API_TOKEN"; env > seen-env.txt; id -u; '
                f'curl -sS --max-time 20 -H "Authorization: token $API_TOKEN" {url}/user'
            )
            done = made.run(script, actor=test_user)
            out = done.stdout + done.stderr
            assert done.returncode == 0, out
            assert f"{test_user.uid}\nwelcome" in done.stdout, out
            assert "env=egressbox-placeholder-API_TOKEN-" in done.stdout
            assert made.bound.authorized() == [("/user", "curl")]
            seen_env = (made.tmp / "seen-env.txt").read_text()
            for text in (out, seen_env, (made.tmp / "audit.jsonl").read_text()):
                assert TOKEN not in text
    finally:
        shutil.rmtree(top, ignore_errors=True)


LIBRARY = """
import sys
import egressbox
from egressbox.core.policy import load_policy

policy = load_policy(sys.argv[1])
script = 'echo "env=$API_TOKEN"; curl -sS --max-time 20 -H "X-Sent: $API_TOKEN" ' + sys.argv[2]
result = egressbox.run_sync(
    ["/bin/sh", "-c", script],
    policy=policy,
    capture_output=True,
    secrets={"API_TOKEN": sys.argv[3]},
)
sys.stdout.write(result.stdout.decode())
try:
    egressbox.run_sync(["/bin/sh", "-c", "touch ran"], policy=policy, secrets={"NOPE": "x"})
except ValueError as exc:
    print("refused:", exc)
sys.exit(result.exit_code)
"""


def test_the_library_takes_the_value_directly(box: Box) -> None:
    """egressbox.run_sync(..., secrets={NAME: VALUE}) (in a child process: it forks): the
    entry's from_env variable is unset, the value given is what the origin gets."""
    env = {k: v for k, v in os.environ.items() if k not in ("EGRESSBOX_TEST_REAL", "API_TOKEN")}
    url = f"https://127.0.0.1:{box.bound.port}/library"
    done = subprocess.run(
        [sys.executable, "-c", LIBRARY, str(box.policy()), url, TOKEN],
        capture_output=True,
        text=True,
        env=env,
        cwd=box.tmp,
        timeout=RUN_TIMEOUT,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "env=egressbox-placeholder-API_TOKEN-" in done.stdout
    assert "welcome" in done.stdout
    assert "refused: secrets= names no [[secret]] entry of the policy: NOPE" in done.stdout
    assert not (box.tmp / "ran").exists()
    assert box.bound.authorized() == [("/library", "curl")]
    assert TOKEN not in done.stdout + done.stderr
