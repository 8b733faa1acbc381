"""Chaining to an upstream proxy (EgressProxy(upstream=...), `[egress] upstream`, `serve
--upstream`): a real squid on loopback (Debian's package, a temporary configuration, `-N`)
and a small SOCKS5 server written here.

egressbox decides first, exactly as without an upstream; then it asks the upstream for the
checked address (pinning holds) or, with upstream_target = "name", for the name. Judged
from the host side: squid's access log (which target it was asked for, or that it was asked
nothing), the SOCKS5 server's record of requests, egressbox's audit records, the replies
and reason codes, and what egressbox wrote to its log (never a credential).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from egressbox.core.upstream import UpstreamKind, UpstreamProxy, UpstreamTarget, parse_upstream
from egressbox.protocols.upstream import UpstreamCredentials
from listening import free_port, wait_listening
from proxy_fixtures import (
    BASE_POLICY,
    IO_TIMEOUT,
    LOOPBACK,
    Curl,
    HttpOrigin,
    Origins,
    StartProxy,
    Wire,
)

pytestmark = [pytest.mark.usefixtures("dials"), pytest.mark.timeout(120)]

START_TIMEOUT = 20.0
POLL = 0.05
USER, PASSWORD = "egress-user", "pässword-never-logged"
# Names squid resolves itself (its hosts_file), as the test DNS answers them to egressbox.
SQUID_HOSTS = {"origin.test": LOOPBACK, "unlisted.test": LOOPBACK}


async def until(predicate: object, what: str) -> None:
    assert callable(predicate)
    async with asyncio.timeout(IO_TIMEOUT):
        while not predicate():
            await asyncio.sleep(POLL)


# -- squid ----------------------------------------------------------------------------------


@dataclass
class Squid:
    proc: subprocess.Popen[bytes]
    port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def requests(self) -> list[tuple[str, str, str]]:
        """(method, target, result code) of each access-log line, in order."""
        path = self.workdir / "access.log"
        if not path.exists():
            return []
        found = []
        for line in path.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 7:
                found.append((fields[5], fields[6], fields[3]))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_squid(ports: list[int], *, password_file: Path | None = None) -> Squid:
    """squid on 127.0.0.1, allowing CONNECT from 127.0.0.1 to `ports` only, logging every
    request; with `password_file`, only after Basic proxy authentication."""
    program = shutil.which("squid")
    if program is None:
        pytest.skip("squid is not installed (Debian package squid; scripts/setup --test)")
    workdir = Path(tempfile.mkdtemp(prefix="egressbox-squid-"))
    port = free_port()
    hosts = workdir / "hosts"
    hosts.write_text("".join(f"{ip} {name}\n" for name, ip in SQUID_HOSTS.items()))
    auth: list[str] = []
    if password_file is not None:
        auth = [
            f"auth_param basic program /usr/lib/squid/basic_ncsa_auth {password_file}",
            "auth_param basic realm egressbox-test",
            "acl authenticated proxy_auth REQUIRED",
            "http_access deny !authenticated",
        ]
    conf = workdir / "squid.conf"
    conf.write_text(
        "\n".join(
            [
                f"http_port {LOOPBACK}:{port}",
                f"acl test_client src {LOOPBACK}/32",
                f"acl test_ports port {' '.join(str(p) for p in ports)}",
                "acl CONNECT method CONNECT",
                "http_access deny !CONNECT",
                "http_access deny CONNECT !test_ports",
                *auth,
                "http_access allow test_client",
                "http_access deny all",
                # Names it is asked for resolve from this file; a miss asks a server on
                # loopback that is not there (nothing leaves 127.0.0.0/8).
                f"hosts_file {hosts}",
                "dns_nameservers 127.0.0.1",
                "cache deny all",
                "cache_mem 0 MB",
                f"access_log stdio:{workdir}/access.log",
                "buffered_logs off",
                f"cache_log {workdir}/cache.log",
                "cache_store_log none",
                f"pid_filename {workdir}/squid.pid",
                f"coredump_dir {workdir}",
                "shutdown_lifetime 0 seconds",
                "pinger_enable off",
                "client_db off",
                "visible_hostname egressbox-test",
            ]
        )
        + "\n"
    )
    if os.geteuid() == 0:  # squid drops root for its effective user, which must write here
        with contextlib.suppress(KeyError):
            user = pwd.getpwnam("proxy")
            os.chown(workdir, user.pw_uid, user.pw_gid)
            for path in (hosts, conf, *([password_file] if password_file else [])):
                os.chmod(path, 0o644)
    err = (workdir / "stderr.log").open("wb")
    proc = subprocess.Popen([program, "-N", "-f", str(conf)], stdout=err, stderr=err)
    err.close()
    squid = Squid(proc, port, workdir)
    problem = wait_listening([port], proc, START_TIMEOUT)
    if problem:
        squid.stop()
        logs = [workdir / "stderr.log", workdir / "cache.log"]
        text = "".join(p.read_text(errors="replace") for p in logs if p.exists())
        pytest.fail(f"squid {problem}: {text[-3000:]}")
    return squid


@contextlib.contextmanager
def running_squid(ports: list[int], **kwargs: Path) -> Iterator[Squid]:
    squid = start_squid(ports, **kwargs)
    try:
        yield squid
    finally:
        squid.stop()
        shutil.rmtree(squid.workdir, ignore_errors=True)


def upstream_of(squid: Squid, target: str = "address") -> UpstreamProxy:
    return parse_upstream(squid.url, target)


async def squid_lines(squid: Squid, count: int) -> list[tuple[str, str, str]]:
    """squid's access log once it has `count` lines (it writes one when a tunnel ends)."""
    await until(lambda: len(squid.requests()) >= count, "squid's access log")
    return squid.requests()


# -- through squid ---------------------------------------------------------------------------


async def test_allowed_through_squid_asks_for_the_checked_address(
    start_proxy: StartProxy, origin: HttpOrigin, curl: Curl, wire: Wire
) -> None:
    with running_squid([origin.port]) as squid:
        proxy = await start_proxy(upstream=upstream_of(squid))
        assert proxy.ready_line()["upstream"] == squid.url
        assert proxy.ready_line()["pinning"] == "full"
        via = f"-x{proxy.http_url}"
        tunnelled = await curl("-p", via, origin.url("origin.test"))
        forwarded = await curl(via, origin.url("origin.test", "/echo?x=1"))
        assert tunnelled.stdout == b"hello from v4"
        assert json.loads(forwarded.stdout)["path_qs"] == "/echo?x=1"
        # Both reached squid as CONNECT to the IP literal egressbox checked, never the name:
        # plain HTTP too (origin-form inside the tunnel), so squid resolved nothing.
        target = f"{LOOPBACK}:{origin.port}"
        assert await squid_lines(squid, 2) == [
            ("CONNECT", target, "TCP_TUNNEL/200"),
            ("CONNECT", target, "TCP_TUNNEL/200"),
        ]
    assert wire.summary(proxy.records) == [
        ("connect", "origin.test", origin.port, "allow", "allowed"),
        ("http", "origin.test", origin.port, "allow", "allowed"),
    ]
    assert [r.path_qs for r in origin.requests] == ["/hello", "/echo?x=1"]


async def test_denied_requests_never_reach_squid_even_those_it_would_allow(
    start_proxy: StartProxy, origin: HttpOrigin, curl: Curl, wire: Wire
) -> None:
    with running_squid([origin.port]) as squid:
        proxy = await start_proxy(upstream=upstream_of(squid))
        # Not in the policy, but squid allows its port and resolves it (hosts_file).
        request = f"CONNECT unlisted.test:{origin.port} HTTP/1.1\r\n\r\n".encode()
        assert (await wire.exchange(proxy.http_address, request)).status == 403
        plain = await curl(
            f"-x{proxy.http_url}", "-w", "%{http_code}", origin.url("unlisted.test"), check=False
        )
        assert plain.stdout.endswith(b"403")
        # A name egressbox admits, resolving to an address it refuses (outside allow_cidrs).
        socks = await Wire.socks_exchange(
            proxy.socks_address, "private.ok.test", origin.port, as_domain=True
        )
        assert socks == (0x02, True)
        # squid would have let the first one through: asked directly, it does.
        reader, writer = await Wire.open((LOOPBACK, squid.port))
        writer.write(f"CONNECT unlisted.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
        assert (await Wire.read_head(reader))[0] == 200
        await Wire.close(writer)
        # That direct request is the only one squid ever saw.
        assert await squid_lines(squid, 1) == [
            ("CONNECT", f"unlisted.test:{origin.port}", "TCP_TUNNEL/200")
        ]
    assert wire.summary(proxy.records) == [
        ("connect", "unlisted.test", origin.port, "deny", "no_allow_rule"),
        ("http", "unlisted.test", origin.port, "deny", "no_allow_rule"),
        ("socks5", "private.ok.test", origin.port, "deny", "private_address"),
    ]


async def test_by_name_squid_resolves_and_pinning_is_partial(
    start_proxy: StartProxy, origin: HttpOrigin, curl: Curl
) -> None:
    with running_squid([origin.port]) as squid:
        proxy = await start_proxy(upstream=upstream_of(squid, "name"))
        assert proxy.ready_line()["pinning"] == "partial"
        result = await curl("-p", f"-x{proxy.http_url}", origin.url("origin.test"))
        assert result.stdout == b"hello from v4"
        assert await squid_lines(squid, 1) == [
            ("CONNECT", f"origin.test:{origin.port}", "TCP_TUNNEL/200")
        ]


async def test_squid_refusing_the_destination_is_upstream_denied(
    start_proxy: StartProxy, origins: Origins, wire: Wire
) -> None:
    """egressbox allows it; squid's own ACL (not its port) refuses: a 502 that says so."""
    allowed = await origins.http(LOOPBACK, label="v4")
    other = await origins.http(LOOPBACK, label="other")
    with running_squid([allowed.port]) as squid:
        proxy = await start_proxy(upstream=upstream_of(squid))
        reader, writer = await wire.open(proxy.http_address)
        writer.write(f"CONNECT origin.test:{other.port} HTTP/1.1\r\n\r\n".encode())
        reply = await wire.read_reply(reader)
        await wire.close(writer)
        assert reply.status == 502
        assert reply.header("x-egressbox-reason") == "upstream_denied"
        assert await squid_lines(squid, 1) == [
            ("CONNECT", f"{LOOPBACK}:{other.port}", "TCP_DENIED/403")
        ]
    # The audit record is egressbox's own decision: allowed.
    assert wire.summary(proxy.records) == [
        ("connect", "origin.test", other.port, "allow", "allowed")
    ]


def _password_file(workdir: Path) -> Path | None:
    openssl = shutil.which("openssl")
    if openssl is None:
        return None
    done = subprocess.run(
        [openssl, "passwd", "-apr1", PASSWORD], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        return None
    path = workdir / "passwords"
    path.write_text(f"{USER}:{done.stdout.strip()}\n")
    return path


async def test_squid_with_credentials_from_the_environment(
    start_proxy: StartProxy,
    origin: HttpOrigin,
    curl: Curl,
    wire: Wire,
    proxy_log: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    if not Path("/usr/lib/squid/basic_ncsa_auth").exists():
        pytest.skip("squid's basic_ncsa_auth helper is not installed")
    folder = Path(tempfile.mkdtemp(prefix="egressbox-auth-"))
    os.chmod(folder, 0o755)
    try:
        passwords = _password_file(folder)
        if passwords is None:
            pytest.skip("openssl cannot make an APR1 password hash here")
        with running_squid([origin.port], password_file=passwords) as squid:
            without = await start_proxy(upstream=upstream_of(squid), log=proxy_log.append)
            reader, writer = await wire.open(without.http_address)
            writer.write(f"CONNECT origin.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
            reply = await wire.read_reply(reader)
            await wire.close(writer)
            assert reply.status == 502 and b"wants credentials" in reply.body
            monkeypatch.setenv("EGRESSBOX_UPSTREAM_USER", USER)
            monkeypatch.setenv("EGRESSBOX_UPSTREAM_PASSWORD", PASSWORD)
            proxy = await start_proxy(upstream=upstream_of(squid), log=proxy_log.append)
            result = await curl("-p", f"-x{proxy.http_url}", origin.url("origin.test"))
            assert result.stdout == b"hello from v4"
            wrong = await start_proxy(
                upstream=upstream_of(squid),
                upstream_credentials=UpstreamCredentials(USER, "wrong-" + PASSWORD),
                log=proxy_log.append,
            )
            reader, writer = await wire.open(wrong.http_address)
            writer.write(f"CONNECT origin.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
            refused = await wire.read_reply(reader)
            await wire.close(writer)
            assert refused.status == 502 and b"refused the credentials" in refused.body
            lines = await squid_lines(squid, 3)
        assert [line[2] for line in lines] == ["TCP_DENIED/407", "TCP_TUNNEL/200", "TCP_DENIED/407"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    encoded = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    said = "\n".join(proxy_log) + capfd.readouterr().err + reply.body.decode()
    said += refused.body.decode() + repr(proxy.records) + repr(proxy.state.upstream)
    for secret in (PASSWORD, encoded, USER):
        assert secret not in said


async def test_an_unreachable_upstream_is_upstream_failed(
    start_proxy: StartProxy, origins: Origins, origin: HttpOrigin, wire: Wire
) -> None:
    closed = origins.refusing_port()
    proxy = await start_proxy(upstream=parse_upstream(f"http://{LOOPBACK}:{closed}"))
    reader, writer = await wire.open(proxy.http_address)
    writer.write(f"CONNECT origin.test:{origin.port} HTTP/1.1\r\n\r\n".encode())
    reply = await wire.read_reply(reader)
    await wire.close(writer)
    assert reply.status == 502
    assert reply.header("x-egressbox-reason") == "upstream_failed"
    assert f"{LOOPBACK}:{closed}".encode() in reply.body
    socks = await wire.socks_exchange(
        proxy.socks_address, "origin.test", origin.port, as_domain=True
    )
    assert socks == (0x01, True)
    assert origin.accepted == 0


async def test_the_policy_key_chains_and_a_reload_follows_it(
    start_proxy: StartProxy, origin: HttpOrigin, curl: Curl
) -> None:
    from egressbox.core.policy import parse_policy

    with running_squid([origin.port]) as squid:
        chained = {"egress": {**BASE_POLICY["egress"], "upstream": squid.url}}
        proxy = await start_proxy(chained)
        url = origin.url("origin.test")
        await curl("-p", f"-x{proxy.http_url}", url)
        assert len(await squid_lines(squid, 1)) == 1
        proxy.set_policy(parse_policy(BASE_POLICY, env={}))  # no upstream any more
        assert "upstream" not in proxy.ready_line()
        await curl("-p", f"-x{proxy.http_url}", url + "?direct")
        proxy.set_policy(parse_policy(chained, env={}))  # chained again: a sentinel request
        await curl("-p", f"-x{proxy.http_url}", url)
        assert len(await squid_lines(squid, 2)) == 2  # the direct one never reached squid
    assert origin.accepted == 3


# -- a SOCKS5 upstream -------------------------------------------------------------------------


@dataclass
class SocksRequest:
    atyp: int
    host: str
    port: int
    user: str | None


@dataclass
class TinySocks5:
    """A SOCKS5 server (RFC 1928, optional RFC 1929) that connects only to loopback, maps
    the names in SQUID_HOSTS itself, relays, and records every request."""

    credentials: tuple[str, str] | None = None
    requests: list[SocksRequest] = field(default_factory=list)
    server: asyncio.Server | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> TinySocks5:
        self.server = await asyncio.start_server(self._serve, LOOPBACK, 0)
        return self

    @property
    def port(self) -> int:
        assert self.server is not None
        port: int = self.server.sockets[0].getsockname()[1]
        return port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await asyncio.wait_for(self._handshake(reader, writer), IO_TIMEOUT)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError, ValueError):
            pass
        finally:
            self.tasks.discard(task)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        version, count = await reader.readexactly(2)
        methods = await reader.readexactly(count)
        wanted = 2 if self.credentials else 0
        if version != 5 or wanted not in methods:
            writer.write(b"\x05\xff")
            return
        writer.write(bytes([5, wanted]))
        user = None
        if self.credentials:
            _, ulen = await reader.readexactly(2)
            user = (await reader.readexactly(ulen)).decode()
            plen = (await reader.readexactly(1))[0]
            password = (await reader.readexactly(plen)).decode()
            ok = (user, password) == self.credentials
            writer.write(b"\x01\x00" if ok else b"\x01\x01")
            if not ok:
                return
        _, command, _, atyp = await reader.readexactly(4)
        if atyp == 1:
            host = str(ipaddress.ip_address(await reader.readexactly(4)))
        elif atyp == 4:
            host = str(ipaddress.ip_address(await reader.readexactly(16)))
        else:
            host = (await reader.readexactly((await reader.readexactly(1))[0])).decode()
        port = int.from_bytes(await reader.readexactly(2), "big")
        self.requests.append(SocksRequest(atyp, host, port, user))
        address = SQUID_HOSTS.get(host, host)
        if command != 1 or not ipaddress.ip_address(address).is_loopback:
            writer.write(b"\x05\x02\x00\x01" + bytes(6))
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(address, port)
        except OSError:
            writer.write(b"\x05\x05\x00\x01" + bytes(6))
            return
        writer.write(b"\x05\x00\x00\x01" + bytes(6))
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    @staticmethod
    async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
            sink.write_eof()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def socks_upstream() -> AsyncIterator[TinySocks5]:
    server = await TinySocks5(credentials=(USER, PASSWORD)).start()
    try:
        yield server
    finally:
        await server.close()


@pytest.mark.parametrize(
    ("target", "atyp", "asked"),
    [("address", 1, LOOPBACK), ("name", 3, "origin.test")],
)
async def test_socks5_upstream_by_address_and_by_name(
    start_proxy: StartProxy,
    socks_upstream: TinySocks5,
    origin: HttpOrigin,
    curl: Curl,
    wire: Wire,
    target: str,
    atyp: int,
    asked: str,
) -> None:
    upstream = UpstreamProxy(
        UpstreamKind.SOCKS5, LOOPBACK, socks_upstream.port, UpstreamTarget(target)
    )
    credentials = UpstreamCredentials(USER, PASSWORD)
    proxy = await start_proxy(upstream=upstream, upstream_credentials=credentials)
    tunnelled = await curl("-p", f"-x{proxy.http_url}", origin.url("origin.test"))
    forwarded = await curl(f"-x{proxy.http_url}", origin.url("origin.test"))
    assert proxy.socks_address is not None
    via_socks = await curl(
        "--socks5-hostname", f"{LOOPBACK}:{proxy.socks_address[1]}", origin.url("origin.test")
    )
    assert tunnelled.stdout == forwarded.stdout == via_socks.stdout == b"hello from v4"
    assert [(r.atyp, r.host, r.port, r.user) for r in socks_upstream.requests] == [
        (atyp, asked, origin.port, USER)
    ] * 3
    assert [r.reason.value for r in proxy.records] == ["allowed"] * 3


async def test_socks5_upstream_refusals_map_to_reasons(
    start_proxy: StartProxy, origins: Origins, origin: HttpOrigin, wire: Wire
) -> None:
    upstream_server = await TinySocks5(credentials=(USER, PASSWORD)).start()
    try:
        upstream = UpstreamProxy(UpstreamKind.SOCKS5, LOOPBACK, upstream_server.port)
        wrong = await start_proxy(
            upstream=upstream, upstream_credentials=UpstreamCredentials(USER, "nope")
        )
        reply = await wire.exchange(
            wrong.http_address, f"CONNECT origin.test:{origin.port} HTTP/1.1\r\n\r\n".encode()
        )
        assert (reply.status, reply.header("x-egressbox-reason")) == (502, "upstream_failed")
        assert b"refused the credentials" in reply.body
        right = await start_proxy(
            upstream=upstream, upstream_credentials=UpstreamCredentials(USER, PASSWORD)
        )
        closed = origins.refusing_port()  # allowed by the policy (127.0.0.1), nothing there
        reply = await wire.exchange(
            right.http_address, f"CONNECT 127.0.0.1:{closed} HTTP/1.1\r\n\r\n".encode()
        )
        assert (reply.status, reply.header("x-egressbox-reason")) == (502, "connect_refused")
    finally:
        await upstream_server.close()


# -- serve --upstream ---------------------------------------------------------------------------


def _serve(policy: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_UPSTREAM")}
    return subprocess.Popen(
        [sys.executable, "-m", "egressbox", "serve", "--policy", str(policy), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**base, **(env or {})},
    )


async def test_serve_upstream_ready_line_and_usage_errors(
    origin: HttpOrigin, tmp_path: Path, curl: Curl
) -> None:
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["127.0.0.1:{origin.port}"]\nallow_cidrs = ["127.0.0.1/32"]\n'
    )
    with running_squid([origin.port]) as squid:
        proc = _serve(policy, "--upstream", squid.url, "--upstream-target", "name")
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), START_TIMEOUT)
            ready = json.loads(line)
            assert (ready["upstream"], ready["pinning"]) == (squid.url, "partial")
            result = await curl("-p", f"-xhttp://{ready['http']}", origin.url("127.0.0.1"))
            assert result.stdout == b"hello from v4"
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.to_thread(proc.communicate, timeout=START_TIMEOUT)
        assert proc.returncode == 0
        assert b"pinning: partial" in err
        assert await squid_lines(squid, 1) == [
            ("CONNECT", f"127.0.0.1:{origin.port}", "TCP_TUNNEL/200")
        ]
    cases = [
        (["--upstream", "http://someone:hunter2@127.0.0.1:3128"], {}, b"EGRESSBOX_UPSTREAM_USER"),
        (["--upstream", "https://127.0.0.1:3128"], {}, b"not supported"),
        (["--upstream", "http://127.0.0.1"], {}, b"port"),
        (["--upstream-target", "name"], {}, b"needs --upstream"),
        (["--upstream", "socks5://[::1]:1080"], {"EGRESSBOX_UPSTREAM_USER": "x"}, b"both"),
    ]
    for flags, env, message in cases:
        proc = _serve(policy, *flags, env=env)
        out, err = await asyncio.to_thread(proc.communicate, timeout=START_TIMEOUT)
        assert proc.returncode == 2 and out == b"", (flags, err)
        assert message in err and b"hunter2" not in err, err


async def test_run_upstream_chains_the_confined_command(origin: HttpOrigin, tmp_path: Path) -> None:
    """`egressbox run --upstream`: the managed proxy decides, then asks squid; the command
    never sees the upstream's credentials."""
    if sys.platform != "linux" or shutil.which("curl") is None:
        pytest.skip("needs Linux confinement and curl")
    policy = tmp_path / "policy.toml"
    policy.write_text(
        f'[egress]\nallow = ["127.0.0.1:{origin.port}"]\nallow_cidrs = ["127.0.0.1/32"]\n'
    )
    script = (
        'printf "%s\\n" "${EGRESSBOX_UPSTREAM_PASSWORD-unset}"; '
        f"curl -sS --max-time 20 http://127.0.0.1:{origin.port}/hello"
    )
    base = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env = {**base, "EGRESSBOX_UPSTREAM_USER": USER, "EGRESSBOX_UPSTREAM_PASSWORD": PASSWORD}
    with running_squid([origin.port]) as squid:
        argv = [sys.executable, "-m", "egressbox", "run", "--policy", str(policy)]
        argv += ["--write-root", str(tmp_path), "--upstream", squid.url, "--", "sh", "-c", script]
        done = await asyncio.to_thread(
            subprocess.run, argv, capture_output=True, env=env, cwd=tmp_path, timeout=120
        )
        assert done.returncode == 0, done.stderr.decode(errors="replace")[-2000:]
        assert done.stdout.decode().splitlines() == ["unset", "hello from v4"]
        assert await squid_lines(squid, 1) == [
            ("CONNECT", f"127.0.0.1:{origin.port}", "TCP_TUNNEL/200")
        ]
    assert PASSWORD.encode() not in done.stderr
