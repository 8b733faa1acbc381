"""Reason codes and the error tree shared by every part of egressbox.

This module imports nothing of ours, so any module may depend on it. Reason
codes are a contract: the audit log, HTTP/SOCKS replies and stderr
diagnostics all carry the same stable snake_case values, so never rename one.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from typing import TextIO


class Reason(StrEnum):
    """Why a destination was admitted or refused (stable; see README)."""

    ALLOWED = "allowed"
    NO_ALLOW_RULE = "no_allow_rule"
    DENY_RULE = "deny_rule"
    DENY_CIDR = "deny_cidr"
    PRIVATE_ADDRESS = "private_address"
    SPECIAL_ADDRESS = "special_address"
    # A cloud metadata or instance-identity endpoint (addresses.METADATA_ENDPOINTS):
    # admitted only by an allow entry naming that exact address.
    METADATA_ADDRESS = "metadata_address"
    SELF_CONNECTION = "self_connection"
    DNS_FAILURE = "dns_failure"
    DNS_TIMEOUT = "dns_timeout"
    BAD_HOST = "bad_host"
    BAD_PORT = "bad_port"
    NO_POLICY = "no_policy"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    # A tunnel's TLS ClientHello names another host than its target (or cannot
    # be read): the tunnel is closed before any byte goes upstream.
    SNI_MISMATCH = "sni_mismatch"
    # A captured plain-HTTP connection's Host header names another host than the name it
    # was decided for: closed before any byte goes upstream.
    HOST_MISMATCH = "host_mismatch"
    # Approval on a miss (proxy/approval.py): a destination no allow entry admits, let
    # through once or for the session by the decider that was asked, or refused by it
    # (a deny answer, a failed decider) or because nobody answered in time.
    APPROVED = "approved"
    APPROVED_SESSION = "approved_session"
    APPROVAL_DENIED = "approval_denied"
    APPROVAL_TIMEOUT = "approval_timeout"
    # A policy reload (SIGHUP, --watch-policy, set_policy) closed an open connection, or
    # refused a request held for an approval answer, that the new policy does not admit.
    POLICY_RELOADED = "policy_reloaded"
    # Request rules on a host the proxy terminates (core/secrets.py, [[request_rule]]): a
    # method or a path outside the rule, or a request beyond its budget (requests or bytes).
    METHOD_DENIED = "method_denied"
    PATH_DENIED = "path_denied"
    BUDGET_EXCEEDED = "budget_exceeded"
    # A secret's placeholder in a request to a host its [[secret]] entry does not bind.
    SECRET_MISDIRECTED = "secret_misdirected"  # noqa: S105 - a reason code
    # Replies and logs only: the audit sink failed, so nothing is admitted
    # (and no record can say so).
    AUDIT_UNAVAILABLE = "audit_unavailable"


class Verdict(StrEnum):
    """The decision an audit record carries."""

    ALLOW = "allow"
    DENY = "deny"
    # Report mode only: a name rule would have denied, but it was let through.
    WOULD_DENY = "would_deny"


class EgressboxError(Exception):
    """Base of every error egressbox raises on purpose."""


class HostError(EgressboxError):
    """A host or port that is not acceptable; carries the reason code."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class PolicyError(EgressboxError):
    """A policy that cannot be used; lists every problem found, each located."""

    def __init__(self, problems: list[str], source: str = "") -> None:
        self.problems = list(problems)
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in self.problems))


class ResolveError(EgressboxError):
    """DNS resolution failed; reason is dns_failure or dns_timeout."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class AuditError(EgressboxError):
    """An audit record could not be written or read."""


def print_policy_error(exc: PolicyError, out: TextIO) -> None:
    """Every problem of a policy, one per line under the file's name (for a person)."""
    count = len(exc.problems)
    where = exc.source or "policy"
    out.write(f"{where}: {count} problem{'s' if count != 1 else ''}:\n")
    for problem in exc.problems:
        out.write(f"  {problem}\n")
