"""Loopback servers for the real-tool tests of `egressbox run` (test_run_tools.py).

A throwaway certificate authority (openssl CLI) and a certificate for
`localhost`/127.0.0.1; one aiohttp origin served over HTTP and HTTPS that
also plays a PEP 503 package index, an npm registry, a dumb-HTTP git server
and a WebSocket echo; a throwaway sshd on a loopback port for git over ssh;
and the tiny artifacts they serve (a wheel, an npm tarball, a git repository),
built here so nothing comes from the internet.

The servers run in the pytest process (an asyncio loop in a thread, sshd as
a child process); the confined tools run in `egressbox run` child processes
and reach them only through the run's proxy. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import csv
import getpass
import hashlib
import io
import json
import os
import shutil
import socket
import ssl
import subprocess
import tarfile
import threading
import time
import zipfile
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import WSMsgType, web

T = TypeVar("T")

LOOPBACK = "127.0.0.1"
# Longest a server-side step (start, stop, a probe connection) may take.
IO_TIMEOUT = 30.0
# Longest a helper command (openssl, git, ssh-keygen) may take.
COMMAND_TIMEOUT = 60.0
# sshd start-up: probe its port this often, at most this many times (~10 s).
SSHD_PROBE_INTERVAL = 0.05
SSHD_PROBE_TRIES = 200
# The body every /hello answers with, so each tool's output can be checked.
HELLO = "hello from the loopback origin\n"
# Fixed timestamps make the built artifacts reproducible.
ZIP_DATE = (2024, 1, 1, 0, 0, 0)


class CommandFailedError(AssertionError):
    pass


def run_command(
    args: list[str],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = COMMAND_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """Run a helper command (bounded), raising with its output when it fails."""
    done = subprocess.run(
        args,
        cwd=cwd,
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise CommandFailedError(
            f"{' '.join(args)} exited {done.returncode}\n"
            f"stdout: {done.stdout[-2000:]}\nstderr: {done.stderr[-2000:]}"
        )
    return done


def missing_tools(*names: str) -> list[str]:
    return [name for name in names if shutil.which(name) is None]


# -- a throwaway certificate authority ------------------------------------------------


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA certificate and a server certificate it signed for localhost/127.0.0.1."""

    ca_cert: Path
    server_cert: Path
    server_key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.server_cert, self.server_key)
        return context

    def client_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_cert))


_EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
_SERVER_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def make_ca(folder: Path) -> CertificateAuthority:
    """A CA (valid two days) and a server certificate for localhost, with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise FileNotFoundError("the openssl command is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = folder / "ca.key", folder / "ca.pem"
    key, csr, cert = folder / "server.key", folder / "server.csr", folder / "server.pem"
    extensions = folder / "server.ext"
    extensions.write_text(_SERVER_EXTENSIONS, encoding="ascii")
    run_command(
        [
            *(openssl, "req", "-x509", *_EC, "-days", "2", "-subj", "/CN=egressbox test CA"),
            *("-addext", "basicConstraints=critical,CA:TRUE"),
            *("-addext", "keyUsage=critical,keyCertSign,cRLSign"),
            *("-keyout", str(ca_key), "-out", str(ca_cert)),
        ]
    )
    run_command(
        [
            *(openssl, "req", "-new", *_EC, "-subj", "/CN=localhost"),
            *("-keyout", str(key), "-out", str(csr)),
        ]
    )
    run_command(
        [
            *(openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca_cert)),
            *("-CAkey", str(ca_key), "-CAcreateserial", "-days", "2"),
            *("-extfile", str(extensions), "-out", str(cert)),
        ]
    )
    return CertificateAuthority(ca_cert, cert, key)


# -- artifacts: a wheel, an npm tarball, a git repository ------------------------------


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode("ascii")


def build_wheel(
    folder: Path,
    name: str,
    version: str,
    files: Mapping[str, str],
    *,
    console_scripts: Mapping[str, str] | None = None,
) -> Path:
    """A pure-Python wheel (py3-none-any) with these files and console scripts."""
    dist_info = f"{name}-{version}.dist-info"
    members: dict[str, bytes] = {path: text.encode() for path, text in files.items()}
    members[f"{dist_info}/METADATA"] = (
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        "Summary: a tiny package served by a loopback index in egressbox's tests\n"
    ).encode()
    members[f"{dist_info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: egressbox-tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n"
    )
    if console_scripts:
        lines = ["[console_scripts]"] + [f"{k} = {v}" for k, v in console_scripts.items()]
        members[f"{dist_info}/entry_points.txt"] = ("\n".join(lines) + "\n").encode()
    record = io.StringIO()
    writer = csv.writer(record, lineterminator="\n")
    for member, data in members.items():
        writer.writerow([member, _record_hash(data), str(len(data))])
    writer.writerow([f"{dist_info}/RECORD", "", ""])
    members[f"{dist_info}/RECORD"] = record.getvalue().encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for member, data in members.items():
            info = zipfile.ZipInfo(member, ZIP_DATE)
            info.external_attr = 0o644 << 16
            archive.writestr(info, data)
    return path


def build_npm_tarball(name: str, version: str, files: Mapping[str, str]) -> bytes:
    """An npm package tarball: package/package.json plus these files."""
    manifest = {"name": name, "version": version, "main": "index.js", "license": "MIT"}
    members = {"package.json": json.dumps(manifest, indent=2) + "\n", **files}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(f"package/{member}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 1_704_067_200
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@dataclass(frozen=True)
class NpmPackage:
    name: str
    version: str
    tarball: bytes

    @property
    def tarball_name(self) -> str:
        return f"{self.name}-{self.version}.tgz"

    def document(self, registry_url: str) -> dict[str, Any]:
        """The registry's package document (what `GET /NAME` returns)."""
        integrity = base64.b64encode(hashlib.sha512(self.tarball).digest()).decode()
        version = {
            "name": self.name,
            "version": self.version,
            "main": "index.js",
            "dist": {
                "tarball": f"{registry_url}{self.name}/-/{self.tarball_name}",
                "shasum": hashlib.sha1(self.tarball).hexdigest(),  # npm's format
                "integrity": f"sha512-{integrity}",
            },
        }
        return {
            "name": self.name,
            "dist-tags": {"latest": self.version},
            "versions": {self.version: version},
        }


GIT_IDENTITY = [
    "-c",
    "user.name=egressbox tests",
    "-c",
    "user.email=tests@example.invalid",
    "-c",
    "init.defaultBranch=main",
]


@dataclass(frozen=True)
class GitRepo:
    bare: Path  # a bare repository, ready for dumb HTTP (update-server-info) and ssh
    commit: str
    files: Mapping[str, str]


def make_git_repo(folder: Path, files: Mapping[str, str]) -> GitRepo:
    """A bare repository with one commit holding `files`."""
    git = shutil.which("git")
    if git is None:
        raise FileNotFoundError("git is not installed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {"GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}
    work, bare = folder / "work", folder / "repo.git"
    work.mkdir(parents=True)
    for path, text in files.items():
        (work / path).parent.mkdir(parents=True, exist_ok=True)
        (work / path).write_text(text, encoding="utf-8")
    run_command([git, *GIT_IDENTITY, "init", "-q", str(work)], env=env)
    run_command([git, *GIT_IDENTITY, "-C", str(work), "add", "-A"], env=env)
    run_command([git, *GIT_IDENTITY, "-C", str(work), "commit", "-q", "-m", "first"], env=env)
    run_command([git, "clone", "-q", "--bare", str(work), str(bare)], env=env)
    # Dumb HTTP needs info/refs and objects/info/packs.
    run_command([git, "-C", str(bare), "update-server-info"], env=env)
    head = run_command([git, "-C", str(bare), "rev-parse", "HEAD"], env=env).stdout.strip()
    return GitRepo(bare, head, dict(files))


# -- the origin: HTTP(S), WebSocket, package index, npm registry, dumb git -----------------


def loopback_listener(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((LOOPBACK, port))
        sock.listen(128)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


class LoopThread:
    """An asyncio loop in a daemon thread, for servers that outlive one test's calls."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = IO_TIMEOUT) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(IO_TIMEOUT)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass
class Origin:
    """One aiohttp app on a plain HTTP port and an HTTPS port (127.0.0.1).

    /hello            HELLO
    /ws               WebSocket echo (text frames come back prefixed "echo: ")
    /simple/...       PEP 503 index of `wheels`; files under /files/NAME
    /npm/NAME         npm package document; tarball at /npm/NAME/-/FILE
    /git/REPO/...     static files of each bare repository (git's dumb HTTP)
    """

    ca: CertificateAuthority
    wheels: list[Path] = field(default_factory=list)
    npm_packages: dict[str, NpmPackage] = field(default_factory=dict)
    git_repos: dict[str, GitRepo] = field(default_factory=dict)
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # scheme, method, path
    http_port: int = 0
    https_port: int = 0
    _runner: web.AppRunner | None = None
    _sites: list[web.BaseSite] = field(default_factory=list)

    def url(self, path: str = "/hello", *, tls: bool = True, host: str = "localhost") -> str:
        if tls:
            return f"https://{host}:{self.https_port}{path}"
        return f"http://{host}:{self.http_port}{path}"

    def seen_since(self, mark: int) -> list[tuple[str, str]]:
        """(scheme, path) of the requests served since len(requests) was `mark`."""
        return [(scheme, path) for scheme, _, path in self.requests[mark:]]

    async def start(self) -> None:
        app = web.Application(middlewares=[self._log])
        app.router.add_get("/hello", self._hello)
        app.router.add_get("/ws", self._ws)
        app.router.add_get("/simple/", self._simple_root)
        app.router.add_get("/simple/{name}/", self._simple_project)
        app.router.add_get("/files/{file}", self._file)
        app.router.add_get("/npm/{name}", self._npm_document)
        app.router.add_get("/npm/{name}/-/{file}", self._npm_tarball)
        app.router.add_get("/git/{repo}/{path:.*}", self._git)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        self._runner = runner
        plain_sock, tls_sock = loopback_listener(), loopback_listener()
        self.http_port = plain_sock.getsockname()[1]
        self.https_port = tls_sock.getsockname()[1]
        plain = web.SockSite(runner, plain_sock)
        tls = web.SockSite(runner, tls_sock, ssl_context=self.ca.server_context())
        for site in (plain, tls):
            await site.start()
            self._sites.append(site)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _log(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.scheme, request.method, request.path_qs))
        response: web.StreamResponse = await handler(request)
        return response

    async def _hello(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text=HELLO)

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await ws.send_str(f"echo: {message.data}")
            elif message.type == WSMsgType.BINARY:
                await ws.send_bytes(message.data)
        return ws

    # PEP 503: a project page lists its files with a #sha256= fragment.
    def _projects(self) -> dict[str, list[Path]]:
        found: dict[str, list[Path]] = {}
        for wheel in self.wheels:
            project = wheel.name.split("-", 1)[0].replace("_", "-").lower()
            found.setdefault(project, []).append(wheel)
        return found

    async def _simple_root(self, request: web.Request) -> web.StreamResponse:
        links = "".join(f'<a href="{p}/">{p}</a>\n' for p in sorted(self._projects()))
        return web.Response(
            text=f"<!DOCTYPE html><html><body>\n{links}</body></html>\n", content_type="text/html"
        )

    async def _simple_project(self, request: web.Request) -> web.StreamResponse:
        wheels = self._projects().get(request.match_info["name"].lower())
        if not wheels:
            raise web.HTTPNotFound()
        links = "".join(
            f'<a href="../../files/{w.name}#sha256={hashlib.sha256(w.read_bytes()).hexdigest()}"'
            f">{w.name}</a>\n"
            for w in wheels
        )
        return web.Response(
            text=f"<!DOCTYPE html><html><body>\n{links}</body></html>\n", content_type="text/html"
        )

    async def _file(self, request: web.Request) -> web.StreamResponse:
        for wheel in self.wheels:
            if wheel.name == request.match_info["file"]:
                return web.Response(body=wheel.read_bytes(), content_type="application/zip")
        raise web.HTTPNotFound()

    async def _npm_document(self, request: web.Request) -> web.StreamResponse:
        package = self.npm_packages.get(request.match_info["name"])
        if package is None:
            raise web.HTTPNotFound()
        registry = f"{request.scheme}://{request.host}/npm/"
        return web.json_response(package.document(registry))

    async def _npm_tarball(self, request: web.Request) -> web.StreamResponse:
        package = self.npm_packages.get(request.match_info["name"])
        if package is None or request.match_info["file"] != package.tarball_name:
            raise web.HTTPNotFound()
        return web.Response(body=package.tarball, content_type="application/octet-stream")

    async def _git(self, request: web.Request) -> web.StreamResponse:
        repo = self.git_repos.get(request.match_info["repo"])
        if repo is None:
            raise web.HTTPNotFound()
        root = repo.bare.resolve()
        path = (root / request.match_info["path"]).resolve()
        if not path.is_relative_to(root) or not path.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes(), content_type="application/octet-stream")


# -- a throwaway sshd --------------------------------------------------------------------

_SSHD_CONFIG = """\
ListenAddress 127.0.0.1
HostKey {host_key}
AuthorizedKeysFile {authorized_keys}
PidFile none
UsePAM no
StrictModes no
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
AllowUsers {user}
AllowTcpForwarding no
X11Forwarding no
PrintMotd no
LogLevel VERBOSE
"""
# OpenSSH's privilege separation directory (Debian's service unit makes it).
PRIVSEP_DIR = "/run/sshd"


@dataclass
class Sshd:
    """sshd -D on 127.0.0.1:port with its own host key and one authorized client key."""

    folder: Path
    port: int = 0
    user: str = ""
    client_key: Path = Path()
    log: Path = Path()
    _process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        sshd, keygen = shutil.which("sshd") or "/usr/sbin/sshd", shutil.which("ssh-keygen")
        if not os.path.isfile(sshd) or keygen is None:
            raise FileNotFoundError("sshd or ssh-keygen is not installed")
        if os.geteuid() == 0:
            os.makedirs(PRIVSEP_DIR, mode=0o755, exist_ok=True)
        self.folder.mkdir(parents=True, exist_ok=True)
        host_key, self.client_key = self.folder / "host_key", self.folder / "client_key"
        for key in (host_key, self.client_key):
            run_command([keygen, "-q", "-t", "ed25519", "-N", "", "-C", "", "-f", str(key)])
        authorized = self.folder / "authorized_keys"
        shutil.copyfile(self.client_key.with_suffix(".pub"), authorized)
        self.user = getpass.getuser()
        config = self.folder / "sshd_config"
        config.write_text(
            _SSHD_CONFIG.format(host_key=host_key, authorized_keys=authorized, user=self.user),
            encoding="utf-8",
        )
        with contextlib.closing(loopback_listener()) as probe:
            self.port = probe.getsockname()[1]
        self.log = self.folder / "sshd.log"
        with open(self.log, "wb") as log:
            # sshd re-execs itself and needs an absolute path to do so.
            self._process = subprocess.Popen(
                [os.path.abspath(sshd), "-D", "-e", "-f", str(config), "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        self._wait_ready()

    def _wait_ready(self) -> None:
        for _ in range(SSHD_PROBE_TRIES):
            assert self._process is not None
            if self._process.poll() is not None:
                raise CommandFailedError(f"sshd exited: {self.log.read_text(errors='replace')}")
            try:
                with socket.create_connection((LOOPBACK, self.port), timeout=IO_TIMEOUT) as conn:
                    if conn.recv(8).startswith(b"SSH-"):
                        return
            except OSError:
                time.sleep(SSHD_PROBE_INTERVAL)
        raise CommandFailedError(f"sshd did not listen: {self.log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(IO_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(IO_TIMEOUT)


# -- a port nobody may reach ------------------------------------------------------------


class Tripwire:
    """A loopback listener that no policy allows: a connection to it would be a leak."""

    def __init__(self) -> None:
        self.sock = loopback_listener()
        self.port: int = self.sock.getsockname()[1]

    def connections(self) -> int:
        seen = 0
        for _ in range(100):
            try:
                conn, _ = self.sock.accept()
            except BlockingIOError:
                break
            conn.close()
            seen += 1
        return seen

    def close(self) -> None:
        self.sock.close()
