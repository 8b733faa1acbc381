"""The confined child's environment: what passes, and the proxy settings every tool reads.

Pure. Measured facts behind the choices (DESIGN §7): libcurl reads only the
lower-case `http_proxy`; httpx (under the OpenAI and Anthropic SDKs) crashes
at client creation on a socks `ALL_PROXY` without its socks extra, so
`all_proxy` carries the HTTP proxy URL too; aiohttp takes a WebSocket's proxy
only from `ws_proxy`/`wss_proxy`; Node >= 22.21 honours the variables only
with `NODE_USE_ENV_PROXY=1` (Node 20's fetch ignores them all: a known
limit); ssh and git over ssh need a ProxyCommand.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from enum import StrEnum
from typing import NamedTuple


class EnvPolicy(StrEnum):
    INHERITED = "inherited"  # the caller's environment, proxy settings overridden
    ISOLATED = "isolated"  # a minimal environment plus CA bundles and grants
    GRANTED = "granted"  # only what --grant names (plus PATH/HOME/TERM/LANG basics)


# CA bundle variables pass by default, so TLS through a corporate CA still works.
CA_VARIABLES = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "GIT_SSL_CAINFO",
    "UV_NATIVE_TLS",
)
ISOLATED_BASICS = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TERM", "TZ", "SHELL")
GRANTED_BASICS = ("PATH", "HOME", "TERM", "LANG")
# Proxy-related variables of the caller that must never leak through (they
# would point tools at a proxy the child cannot reach, or bypass ours).
_PROXY_NAMES = (
    "http_proxy",
    "https_proxy",
    "all_proxy",
    "ws_proxy",
    "wss_proxy",
    "no_proxy",
    "ftp_proxy",
    "grpc_proxy",
    "socks_proxy",
    "npm_config_proxy",
    "npm_config_https_proxy",
    "npm_config_noproxy",
    "yarn_proxy",
    "yarn_https_proxy",
)
# Toolchain caches are pointed into the scratch space by confine/toolchains.py (the run's
# assembly applies it after this, so a cache variable the caller set stands).
TEMP_VARIABLES = ("TMPDIR", "TMP", "TEMP")
# The upstream proxy's credentials (protocols/upstream.py) are the proxy's, not the child's.
UPSTREAM_SECRETS = ("EGRESSBOX_UPSTREAM_USER", "EGRESSBOX_UPSTREAM_PASSWORD")


class ProxyEndpoints(NamedTuple):
    """Where the child reaches the proxy. A port may be a "{http}"/"{socks}"
    template, filled in by the launcher once it has bound the listeners."""

    http_host: str
    http_port: int | str
    socks_host: str
    socks_port: int | str

    @property
    def http_url(self) -> str:
        return f"http://{_bracket(self.http_host)}:{self.http_port}"

    @property
    def socks_url(self) -> str:
        return f"socks5h://{_bracket(self.socks_host)}:{self.socks_port}"


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class Scratch(NamedTuple):
    """Directories inside the first writable root for temp files and caches."""

    tmp: str
    cache: str


PORT_TEMPLATES = ProxyEndpoints("127.0.0.1", "{http}", "127.0.0.1", "{socks}")


SSH_COMMAND = "GIT_SSH_COMMAND"
# What proxy_variables() itself sets for GIT_SSH_COMMAND (an outer run's value,
# inherited by a nested run, is replaced rather than extended).
_OWN_SSH_COMMAND = re.compile(r"ssh -o ProxyCommand='nc -X connect -x \S+ %h %p'")
# A first word we may insert options after: ssh itself, by name or plain path.
_SSH_WORD = re.compile(r"(?:[\w./+-]*/)?ssh")


def proxy_variables(proxy: ProxyEndpoints, *, ssh_command: str | None = None) -> dict[str, str]:
    """The proxy settings; `ssh_command` is the caller's GIT_SSH_COMMAND, if any, to extend."""
    http = proxy.http_url
    variables = {}
    for name in ("http_proxy", "https_proxy", "all_proxy", "ws_proxy", "wss_proxy"):
        variables[name] = http
        variables[name.upper()] = http
    hostport = f"{_bracket(proxy.http_host)}:{proxy.http_port}"
    ssh_proxy = f"nc -X connect -x {hostport} %h %p"
    variables |= {
        "EGRESSBOX_SOCKS_PROXY": proxy.socks_url,
        "EGRESSBOX_HTTP_PROXY": http,
        "NODE_USE_ENV_PROXY": "1",
        "npm_config_proxy": http,
        "npm_config_https_proxy": http,
        SSH_COMMAND: _ssh_command(ssh_command, f"-o ProxyCommand={shlex.quote(ssh_proxy)}", proxy),
        "JAVA_TOOL_OPTIONS": _java_options(proxy),
    }
    return variables


def _ssh_command(command: str | None, option: str, proxy: ProxyEndpoints) -> str:
    """The caller's ssh command (an identity file, options) with our ProxyCommand first.

    ssh keeps the first value it reads for an option, so ours goes right after
    the program word and beats any ProxyCommand/ProxyJump later in the command
    (which could not work from inside the network namespace anyway).
    """
    if command is None or not command.strip() or _OWN_SSH_COMMAND.fullmatch(command.strip()):
        return f"ssh {option}"
    if isinstance(proxy.http_port, str):
        # The value is a str.format template ("{http}") until the launcher fills the port.
        command = command.replace("{", "{{").replace("}", "}}")
    program, sep, rest = command.strip().partition(" ")
    if not _SSH_WORD.fullmatch(program):
        return f"{command} {option}"  # a wrapper (env, sshpass...): options at the end
    return f"{program} {option}{sep}{rest}"


def _java_options(proxy: ProxyEndpoints) -> str:
    host, port = proxy.http_host, proxy.http_port
    parts = [f"-Dhttp.proxyHost={host}", f"-Dhttp.proxyPort={port}"]
    parts += [f"-Dhttps.proxyHost={host}", f"-Dhttps.proxyPort={port}"]
    return " ".join(parts)


def child_environment(
    base: Mapping[str, str],
    *,
    policy: EnvPolicy,
    grants: Mapping[str, str | None],
    proxy: ProxyEndpoints,
    scratch: Scratch | None,
    profile: str,
) -> dict[str, str]:
    """The environment the confined command starts with."""
    env = _base(base, policy)
    for name in CA_VARIABLES:
        if name in base:
            env[name] = base[name]
    for name in list(env):
        if name.lower() in _PROXY_NAMES or name in UPSTREAM_SECRETS:
            del env[name]
    if scratch is not None:
        env |= {name: scratch.tmp for name in TEMP_VARIABLES}
    # Explicit grants win over scratch defaults, never over the proxy settings.
    for name, value in grants.items():
        if value is not None:
            env[name] = value
        elif name in base:
            env[name] = base[name]
    # A GIT_SSH_COMMAND of the caller (inherited or granted) keeps its options
    # (an identity file...) and gains the ProxyCommand; it never replaces it.
    env |= proxy_variables(proxy, ssh_command=env.get(SSH_COMMAND))
    env["EGRESSBOX_PROFILE"] = profile
    return env


def _base(base: Mapping[str, str], policy: EnvPolicy) -> dict[str, str]:
    if policy is EnvPolicy.INHERITED:
        return dict(base)
    basics = ISOLATED_BASICS if policy is EnvPolicy.ISOLATED else GRANTED_BASICS
    env = {name: base[name] for name in basics if name in base}
    if policy is EnvPolicy.ISOLATED:
        env |= {k: v for k, v in base.items() if k.startswith("LC_")}
    return env


def parse_grant(text: str) -> tuple[str, str | None]:
    """`NAME` (pass the caller's value) or `NAME=VALUE`."""
    name, sep, value = text.partition("=")
    if not name or not (name[0].isalpha() or name[0] == "_"):
        raise ValueError(f"--grant {text!r}: expected NAME or NAME=VALUE")
    return name, (value if sep else None)
