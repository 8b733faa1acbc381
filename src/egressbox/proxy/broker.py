"""Credential brokering: the real values behind the child's placeholders, held by the proxy.

The values are read once, when the proxy is made (`from_env` from the invoker's
environment, `from_file`, `from_command` run once with a bounded time and its stderr
dropped), and live only in this object's memory: its repr shows names, never values; the
audit record, diagnostics, metrics and reports get reason codes and host names only. While
a Broker holds values the process is made non-dumpable (no core dump, no ptrace by another
process of the same user: PR_SET_DUMPABLE 0, RLIMIT_CORE 0).

It also keeps the per-run counters of the request budgets ([[request_rule]]).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import secrets as random
import select
import shlex
import signal
import ssl
import subprocess
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from egressbox.core.errors import Reason
from egressbox.core.policy import Policy
from egressbox.core.secrets import (
    PLACEHOLDER_PREFIX,
    RequestRule,
    SecretError,
    SecretSource,
    SecretSpec,
    format_value,
    head_placeholders,
    judge_request,
    substitute,
    terminates,
)
from egressbox.proxy.ca import CertificateAuthority, origin_context

# from_command: how long the command may take (a password manager's CLI answers in well
# under a second; a prompt that waits for a person must not hang the run), and the most of
# its output kept (a token is far smaller; anything bigger is a mistake).
COMMAND_TIMEOUT: Final = 30.0
MAX_VALUE_BYTES: Final = 64 * 1024
# The most of its output read: a value and its line end. Reading stops at one byte more and
# the command's session is killed (a command that writes endlessly must not fill our memory).
MAX_OUTPUT_BYTES: Final = MAX_VALUE_BYTES + 1
PR_SET_DUMPABLE: Final = 4  # <linux/prctl.h>


__all__ = ["Broker", "SecretError", "no_core_dumps", "placeholder", "read_value"]


def placeholder(name: str) -> str:
    """A fresh placeholder for the variable `name` (128 random bits)."""
    return f"{PLACEHOLDER_PREFIX}{name}-{random.token_hex(16)}"


def read_value(spec: SecretSpec, environ: Mapping[str, str]) -> str:
    """The real value of one entry (SecretError when it cannot be had)."""
    where = f"[[secret]] {spec.name}"
    if spec.source is SecretSource.ENV:
        value = environ.get(spec.where[0])
        if not value:
            raise SecretError(f"{where}: the variable {spec.where[0]} is not set (from_env)")
    elif spec.source is SecretSource.FILE:
        try:
            with open(os.path.expanduser(spec.where[0]), "rb") as f:
                data = f.read(MAX_VALUE_BYTES + 1)
        except OSError as exc:
            raise SecretError(f"{where}: cannot read from_file: {exc.strerror}") from None
        value = _text(data, where)
    else:
        value = _text(_run(spec.where, where), where)
    if len(value) > MAX_VALUE_BYTES or any(c in value for c in "\r\n\0"):
        raise SecretError(f"{where}: the value must be one line of at most {MAX_VALUE_BYTES} bytes")
    return value


def _run(argv: Sequence[str], where: str) -> bytes:
    """The command's output, at most MAX_OUTPUT_BYTES. Its own session: on a timeout or an
    output too long the whole group is killed (a password manager's CLI may leave a helper
    behind holding the pipe; a command that never stops writing must not fill our memory)."""
    command = f"from_command {shlex.join(argv)}"
    try:
        child = subprocess.Popen(  # the policy's own command, no shell
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,  # may echo the secret or a prompt: never shown
            start_new_session=True,
        )
    except OSError as exc:
        raise SecretError(f"{where}: {command} cannot run: {exc.strerror}") from None
    deadline = time.monotonic() + COMMAND_TIMEOUT
    with child:
        assert child.stdout is not None
        try:
            out = _bounded(child.stdout.fileno(), deadline)
        except (TimeoutError, OverflowError) as exc:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            if isinstance(exc, OverflowError):
                raise SecretError(
                    f"{where}: {command} printed more than {MAX_VALUE_BYTES // 1024} KiB"
                ) from None
            raise SecretError(f"{where}: {command} took longer than {COMMAND_TIMEOUT:g}s") from None
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:  # closed its output and kept running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise SecretError(f"{where}: {command} took longer than {COMMAND_TIMEOUT:g}s") from None
    if child.returncode != 0:
        code = child.returncode
        how = f"was killed by signal {-code}" if code < 0 else f"exited with {code}"
        raise SecretError(f"{where}: {command} {how}")
    return out


def _bounded(fd: int, deadline: float) -> bytes:
    """What `fd` gives until its end: TimeoutError past `deadline`, OverflowError as soon as
    it gives more than MAX_OUTPUT_BYTES (nothing more is read)."""
    chunks: list[bytes] = []
    size = 0
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        if not poller.poll(left * 1000):
            continue
        chunk = os.read(fd, MAX_OUTPUT_BYTES + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_OUTPUT_BYTES:
            raise OverflowError


def _text(data: bytes, where: str) -> str:
    text = data.decode("utf-8", "replace").strip()
    if not text:
        raise SecretError(f"{where}: the value is empty")
    return text


def no_core_dumps() -> None:
    """Keep the values out of core dumps and away from ptrace by other processes."""
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


@dataclass
class Spent:
    """What one rule's budgets counted for one host:port since `since` (monotonic)."""

    since: float
    requests: int = 0
    bytes: int = 0


def _per(rule: RequestRule) -> str:
    """How the budget's refusal detail ends: when it is reached (no path, no value)."""
    return f" reached in this {rule.window}s window" if rule.window is not None else " reached"


class Broker:
    """The run's placeholders, the values behind them, the CA and the request budgets."""

    def __init__(
        self,
        secrets: Sequence[SecretSpec],
        rules: Sequence[RequestRule],
        *,
        ca: CertificateAuthority,
        origin_ca: str | None = None,
        placeholders: Mapping[str, str] | None = None,
    ) -> None:
        self.secrets = tuple(secrets)
        self.rules = tuple(rules)
        self.ca = ca
        self.origin_ca = origin_ca
        self.placeholders: dict[str, str] = dict(placeholders or {})
        for spec in self.secrets:
            self.placeholders.setdefault(spec.name, placeholder(spec.name))
        self._values: dict[str, str] = {}  # placeholder -> value
        self._by_placeholder = {self.placeholders[s.name]: s for s in self.secrets}
        self._origin: ssl.SSLContext | None = None
        # Per rule and host:port: what its budgets counted (in its window, if it has one).
        self._counts: dict[tuple[int, str, int], Spent] = {}
        self.clock: Callable[[], float] = time.monotonic

    def __repr__(self) -> str:
        return f"Broker(secrets={[s.name for s in self.secrets]}, loaded={bool(self._values)})"

    @classmethod
    def for_policy(cls, policy: Policy, ca: CertificateAuthority | None = None) -> Broker | None:
        """The broker a policy asks for (None when it has no secret and no request rule)."""
        if not policy.secrets and not policy.request_rules:
            return None
        return cls(
            policy.secrets,
            policy.request_rules,
            ca=ca or CertificateAuthority.generate(),
            origin_ca=policy.tls.origin_ca,
        )

    def load(self, environ: Mapping[str, str] | None = None, *, skip: Collection[str] = ()) -> None:
        """Read each value not read yet and not in `skip` (once). Raises SecretError
        naming the entry."""
        env = os.environ if environ is None else environ
        if self.secrets:
            no_core_dumps()
        for spec in self.secrets:
            token = self.placeholders[spec.name]
            if spec.name not in skip and token not in self._values:
                self._values[token] = read_value(spec, env)

    def set_value(self, name: str, value: str) -> None:
        """The library's way: a value given directly (egressbox.run(secrets={NAME: VALUE}))."""
        no_core_dumps()
        self._values[self.placeholders[name]] = value

    def origin_context(self) -> ssl.SSLContext:
        if self._origin is None:
            self._origin = origin_context(self.origin_ca)
        return self._origin

    def terminates(self, host: str, port: int) -> bool:
        return terminates(self.secrets, self.rules, host, port)

    # -- per request ----------------------------------------------------------------

    def misdirected(
        self, host: str, port: int, target: str, headers: Sequence[tuple[str, str]]
    ) -> str | None:
        """The name of a secret whose placeholder is in this head but not bound to
        `host:port`, else None."""
        for token in head_placeholders(target, headers):
            spec = self._by_placeholder.get(token)
            if spec is not None and not spec.binds(host, port):
                return spec.name
        return None

    def judge(
        self, host: str, port: int, method: str, target: str, size: int
    ) -> tuple[Reason, str] | None:
        """Rules and budgets for one request of `size` head+declared body bytes, counted
        when admitted."""
        refused = judge_request(self.rules, host, port, method, target)
        if refused is not None:
            return refused
        spent = self._spent(host, port)
        for rule, counted in spent:
            if rule.max_requests is not None and counted.requests >= rule.max_requests:
                return Reason.BUDGET_EXCEEDED, f"max_requests ({rule.max_requests}){_per(rule)}"
            budget = rule.max_request_bytes
            if budget is not None and counted.bytes + size > budget:
                return Reason.BUDGET_EXCEEDED, f"max_request_bytes ({budget}){_per(rule)}"
        for _, counted in spent:
            counted.requests += 1
            counted.bytes += size
        return None

    def more_bytes(self, host: str, port: int, size: int) -> tuple[Reason, str] | None:
        """Body bytes beyond what was declared (a chunked body): counted, and refused once
        over a budget."""
        refused = None
        for rule, counted in self._spent(host, port):
            counted.bytes += size
            budget = rule.max_request_bytes
            if refused is None and budget is not None and counted.bytes > budget:
                refused = Reason.BUDGET_EXCEEDED, f"max_request_bytes ({budget}){_per(rule)}"
        return refused

    def _spent(self, host: str, port: int) -> list[tuple[RequestRule, Spent]]:
        """Each budgeted rule that applies to host:port with its counters, started again
        when its window has passed (a fixed window from the first request in it)."""
        now = self.clock()
        found = []
        for index, rule in enumerate(self.rules):
            if not rule.applies(host, port):
                continue
            if rule.max_requests is None and rule.max_request_bytes is None:
                continue
            key = (index, host, port)
            counted = self._counts.get(key)
            if counted is None or (rule.window is not None and now - counted.since >= rule.window):
                counted = self._counts[key] = Spent(since=now)
            found.append((rule, counted))
        return found

    def rewrite(
        self, host: str, port: int, target: str, headers: Sequence[tuple[str, str]]
    ) -> tuple[str, list[tuple[str, str]]]:
        """The head with each bound placeholder replaced by its value, and each bound
        secret's header added in its format when the child sent none."""
        table = {
            token: value
            for token, value in self._values.items()
            if self._by_placeholder[token].binds(host, port)
        }
        fields = [(name, substitute(value, table)) for name, value in headers]
        target = substitute(target, table)
        sent = {name.lower() for name, _ in headers}
        for spec in self.secrets:
            if spec.header is None or spec.header.lower() in sent or not spec.binds(host, port):
                continue
            value = self._values.get(self.placeholders[spec.name])
            if value is not None:
                fields.append((spec.header, format_value(spec.format, value)))
        return target, fields
