"""The confined child's environment: what passes, and the proxy settings every tool reads.

Pure. Measured facts behind the choices (DESIGN §7): libcurl reads only the
lower-case `http_proxy`; httpx (under the OpenAI and Anthropic SDKs) crashes
at client creation on a socks `ALL_PROXY` without its socks extra, so
`all_proxy` carries the HTTP proxy URL too; aiohttp takes a WebSocket's proxy
only from `ws_proxy`/`wss_proxy`; Node >= 22.21 honours the variables only
with `NODE_USE_ENV_PROXY=1` (Node 20's fetch ignores them all: a known
limit); ssh and git over ssh need a ProxyCommand.

Secrets stay out by default (DESIGN §7): under `inherited`, a variable whose name
looks like a credential (held_back() says which rules), whose value is a URL with a
password or a token in its user part, or whose value has the shape of a well-known
token, is held back, and so are compiler wrappers that reach a cache server
(sccache as RUSTC_WRAPPER). The run names what it held back on one stderr line
(names only, never values); `--grant NAME` passes one on purpose, `--env-remove NAME`
drops one more.
"""

from __future__ import annotations

import os.path
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
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

# -- what `inherited` holds back -------------------------------------------------------------
# A name is cut into words at every character that is not a letter or digit (upper case).
# Any of these words makes it a credential's name: GITHUB_TOKEN, NODE_AUTH_TOKEN,
# npm's `//registry/:_authToken`, SSH_AUTH_SOCK (the agent would sign for the child),
# AWS_ACCESS_KEY_ID, OPENAI_API_KEY, DOCKER_AUTH_CONFIG. Words, not substrings:
# TOKENIZERS_PARALLELISM, KEYBOARD and GIT_AUTHOR_NAME pass.
CREDENTIAL_WORDS = frozenset({"KEY", "APIKEY", "ACCESSKEY", "PRIVATEKEY", "AUTH", "OAUTH"})
CREDENTIAL_WORDS |= frozenset({"AUTHORIZATION", "WEBHOOK", "COOKIE"})
# A word ending so: NPM_TOKEN, HF_TOKEN, AUTHTOKEN, ACCESSTOKEN.
CREDENTIAL_WORD_ENDINGS = ("TOKEN",)
# Anywhere in the name: AWS_SECRET_ACCESS_KEY, AZURE_CLIENT_SECRET, TWINE_PASSWORD,
# UV_INDEX_X_PASSWORD, PGPASSWORD, GOOGLE_APPLICATION_CREDENTIALS,
# AZURE_STORAGE_CONNECTION_STRING (it carries the account key).
CREDENTIAL_PARTS = (
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "CONNECTION_STRING",
)
# Credentials that no rule above names (Kerberos' ticket cache, gpg's agent, MySQL's password).
CREDENTIAL_NAMES = frozenset({"KRB5CCNAME", "GPG_AGENT_INFO", "MYSQL_PWD"})
# A name git reads config pairs from (`git -c`, GIT_CONFIG_KEY_<n>): the word KEY there is
# a config key's name, judged by its value instead (see _git_config_secrets).
_GIT_CONFIG_KEY = re.compile(r"GIT_CONFIG_KEY_\d+")
_GIT_CONFIG_PAIR = re.compile(r"GIT_CONFIG_(?:KEY_\d+|VALUE_\d+|COUNT)")
# Config keys that carry credentials (http.<url>.extraheader, credential.*, *password*...).
_GIT_SECRET_KEY = re.compile(r"(?i)extraheader|^credential\.|password|token|secret")
# A URL with a password (`user:pass@`), or a user part long enough to be a token (GitHub and
# GitLab take a token as the user name; "git" in ssh://git@host is not one): PIP_INDEX_URL,
# UV_INDEX_URL, DATABASE_URL, GOPROXY...
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://([^/?#@\s]*)@")
TOKEN_AS_USER_LENGTH = 16
# Values with the shape of a well-known token, whatever the variable's name (the vendors'
# documented prefixes, as secret scanners such as gitleaks match them): GitHub (ghp_, gho_,
# ghu_, ghs_, ghr_, github_pat_), GitLab (glpat-), OpenAI and Anthropic (sk-...), Slack
# (xox?-), AWS access key ids (AKIA/ASIA), Hugging Face (hf_), npm (npm_), PyPI (pypi-),
# and an HTTP Authorization header or bearer token.
_TOKEN_VALUE = re.compile(
    r"\b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,}|glpat-[A-Za-z0-9_-]{20,}"
    r"|sk-[A-Za-z0-9_-]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|(?:AKIA|ASIA)[0-9A-Z]{16}"
    r"|hf_[A-Za-z0-9]{30,}|npm_[A-Za-z0-9]{36}|pypi-[A-Za-z0-9_-]{50,})"
    r"|(?i:authorization\s*:|bearer\s+[A-Za-z0-9._~+/=-]{16,})"
)
# Compiler wrappers that reach a server: sccache's client talks to its server over TCP (and
# the server to a remote cache), which a confined run cannot reach, so a build would stall
# or fail in the wrapper. Without it the build runs uncached. ccache (CC="ccache gcc") works
# on local files only and passes.
COMPILER_WRAPPERS = (
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "CARGO_BUILD_RUSTC_WRAPPER",
    "CARGO_BUILD_RUSTC_WORKSPACE_WRAPPER",
)
# The JVM's option variables. JAVA_TOOL_OPTIONS carries our proxy properties after the
# caller's options (-Xmx1g stays); in the others (read after it: Maven's and Gradle's
# command lines, _JAVA_OPTIONS) a proxy property of the caller would override ours and point
# at a proxy the child cannot reach, so those properties (only) are taken out.
JAVA_OPTIONS = "JAVA_TOOL_OPTIONS"
JAVA_OPTION_VARIABLES = ("MAVEN_OPTS", "GRADLE_OPTS", "_JAVA_OPTIONS")
_JAVA_PROXY_PROPERTY = re.compile(
    r"-D(?:https?\.proxy|https?\.nonProxyHosts|socksProxy|ftp\.proxy|java\.net\.useSystemProxies)"
)


class HeldBack(NamedTuple):
    """What `inherited` kept from the child: variable names only, never their values."""

    credentials: tuple[str, ...] = ()
    wrappers: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()  # --env-remove

    def notice(self) -> str | None:
        """The one stderr line that names them (None: nothing was held back)."""
        parts = []
        if self.credentials:
            parts.append(f"{', '.join(self.credentials)} (credentials, by name or value)")
        if self.wrappers:
            parts.append(
                f"{', '.join(self.wrappers)} (a compiler wrapper such as sccache reaches a "
                "cache server the command cannot reach)"
            )
        if not parts:
            return None
        return (
            f"held back from the command's environment: {'; '.join(parts)}; --grant NAME passes one"
        )


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


def proxy_variables(
    proxy: ProxyEndpoints, *, ssh_command: str | None = None, java_options: str | None = None
) -> dict[str, str]:
    """The proxy settings; `ssh_command` is the caller's GIT_SSH_COMMAND and `java_options`
    its JAVA_TOOL_OPTIONS, if any, to extend."""
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
        JAVA_OPTIONS: _java_options(proxy, java_options),
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


def _java_options(proxy: ProxyEndpoints, caller: str | None) -> str:
    """The caller's JVM options without their proxy properties, then ours (for a system
    property the JVM keeps the last value it reads)."""
    host, port = proxy.http_host, proxy.http_port
    parts = [f"-Dhttp.proxyHost={host}", f"-Dhttp.proxyPort={port}"]
    parts += [f"-Dhttps.proxyHost={host}", f"-Dhttps.proxyPort={port}"]
    kept = without_java_proxy(caller or "")
    if kept and isinstance(port, str):
        # The value is a str.format template ("{http}") until the launcher fills the port.
        kept = kept.replace("{", "{{").replace("}", "}}")
    return " ".join([kept, *parts] if kept else parts)


def without_java_proxy(options: str) -> str:
    """JVM options without -Dhttp(s).proxy*, -DsocksProxy* and the like; unchanged (quotes
    and all) when there is none."""
    words = options.split()
    kept = [word for word in words if not _JAVA_PROXY_PROPERTY.match(word)]
    return options.strip() if len(kept) == len(words) else " ".join(kept)


def child_environment(
    base: Mapping[str, str],
    *,
    policy: EnvPolicy,
    grants: Mapping[str, str | None],
    proxy: ProxyEndpoints,
    scratch: Scratch | None,
    profile: str,
    remove: Iterable[str] = (),
    writable: Sequence[str] = (),
    held: HeldBack | None = None,
) -> dict[str, str]:
    """The environment the confined command starts with.

    `remove` names variables dropped on purpose (--env-remove); `writable` the write roots,
    inside which an inherited TMPDIR (TMP, TEMP) is kept rather than pointed at the scratch
    space. Grants (--grant NAME[=VALUE]) win over both and over what is held back. `held` is
    held_back() of `base` when the caller has it already (it reads every value once).
    """
    env = _base(base, policy)
    for name in CA_VARIABLES:
        if name in base:
            env[name] = base[name]
    if held is None:
        held = held_back(env, policy=policy, grants=grants, remove=remove)
    for name in (*held.credentials, *held.wrappers, *held.removed):
        env.pop(name, None)
    for name in list(env):
        if name.lower() in _PROXY_NAMES or name in UPSTREAM_SECRETS:
            del env[name]
    _tool_defaults(env, scratch, writable)
    # Explicit grants win over scratch defaults, never over the proxy settings.
    for name, value in grants.items():
        if value is not None:
            env[name] = value
        elif name in base:
            env[name] = base[name]
    # A GIT_SSH_COMMAND of the caller (inherited or granted) keeps its options
    # (an identity file...) and gains the ProxyCommand; it never replaces it. The same for
    # the JVM's options (-Xmx1g stays).
    env |= proxy_variables(
        proxy, ssh_command=env.get(SSH_COMMAND), java_options=env.get(JAVA_OPTIONS)
    )
    env["EGRESSBOX_PROFILE"] = profile
    return env


def _tool_defaults(env: dict[str, str], scratch: Scratch | None, writable: Sequence[str]) -> None:
    """TMPDIR (TMP, TEMP) in the scratch space unless the caller's is inside a write root;
    the caller's proxy properties out of the JVM's option variables."""
    if scratch is not None:
        for name in TEMP_VARIABLES:
            if not _inside(env.get(name), writable):
                env[name] = scratch.tmp
    for name in JAVA_OPTION_VARIABLES:
        if name in env:
            env[name] = without_java_proxy(env[name])


def held_back(
    base: Mapping[str, str],
    *,
    policy: EnvPolicy,
    grants: Mapping[str, str | None],
    remove: Iterable[str] = (),
) -> HeldBack:
    """What the child does not get of `base` (the caller's environment): under `inherited`,
    credentials and compiler wrappers (see the module docstring); under any policy, what
    `remove` names. A name granted is never held back."""
    removed = tuple(name for name in dict.fromkeys(remove) if name in base and name not in grants)
    if policy is not EnvPolicy.INHERITED:
        return HeldBack(removed=removed)
    secrets = _git_config_secrets(base)
    credentials, wrappers = [], []
    for name, value in base.items():
        if name in grants or name in removed or name.lower() in _PROXY_NAMES:
            continue
        if name in COMPILER_WRAPPERS:
            wrappers.append(name)
        elif name in secrets or looks_like_credential(name, value):
            credentials.append(name)
    return HeldBack(tuple(sorted(credentials)), tuple(sorted(wrappers)), removed)


def looks_like_credential(name: str, value: str) -> bool:
    """Whether a variable looks like a credential, by its name or by its value."""
    upper = name.upper()
    if upper in CREDENTIAL_NAMES or any(part in upper for part in CREDENTIAL_PARTS):
        return True
    if not _GIT_CONFIG_KEY.fullmatch(upper):
        for word in re.split(r"[^A-Z0-9]+", upper):
            if word in CREDENTIAL_WORDS or word.endswith(CREDENTIAL_WORD_ENDINGS):
                return True
    return _secret_value(value)


def _secret_value(value: str) -> bool:
    for match in _URL_USERINFO.finditer(value):
        user, colon, password = match.group(1).partition(":")
        if (colon and password) or len(user) >= TOKEN_AS_USER_LENGTH:
            return True
    return _TOKEN_VALUE.search(value) is not None


def _git_config_secrets(base: Mapping[str, str]) -> set[str]:
    """git's config pairs from the environment when one carries a credential (a
    GIT_CONFIG_KEY_<n> naming http.extraheader, credential.* or a password): all of them
    with GIT_CONFIG_COUNT, since git refuses to start on a count whose pair is missing; and
    GIT_CONFIG_PARAMETERS (`git -c`'s) when it sets such a key."""
    found = set()
    if any(
        _GIT_CONFIG_KEY.fullmatch(name) and _GIT_SECRET_KEY.search(value)
        for name, value in base.items()
    ):
        found = {name for name in base if _GIT_CONFIG_PAIR.fullmatch(name)}
    parameters = base.get("GIT_CONFIG_PARAMETERS", "")
    if any(_GIT_SECRET_KEY.search(word) for word in re.split(r"[\s'=]+", parameters)):
        found.add("GIT_CONFIG_PARAMETERS")
    return found


def _inside(path: str | None, roots: Sequence[str]) -> bool:
    """Whether `path` (absolute) lies in or under one of `roots`, by its spelling alone
    (a path through a symlink is not recognised and gets the scratch space instead)."""
    if not path or not os.path.isabs(path):
        return False
    path = os.path.normpath(path)
    for root in map(os.path.normpath, roots):
        if path == root or path.startswith(root.rstrip("/") + "/"):
            return True
    return False


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
