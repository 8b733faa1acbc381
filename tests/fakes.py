"""Test doubles shared by several test modules."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from egressbox.core.errors import Reason, ResolveError
from egressbox.core.ip import IPAddress
from egressbox.net.resolve import Resolution


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


class FakeResolver:
    """Answers from a dict and records every query (an unknown name is NXDOMAIN)."""

    def __init__(
        self,
        answers: Mapping[str, Sequence[str] | ResolveError] | None = None,
        cnames: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        self.answers = dict(answers or {})
        self.cnames = dict(cnames or {})
        self.queries: list[str] = []

    async def resolve(self, host: str) -> Resolution:
        self.queries.append(host)
        answer = self.answers.get(host)
        if isinstance(answer, ResolveError):
            raise answer
        if answer is None:
            raise ResolveError(Reason.DNS_FAILURE, f"{host}: no such name (NXDOMAIN)")
        names = (host, *self.cnames.get(host, ()))
        return Resolution(tuple(ip(a) for a in answer), names, 60.0, "dns")
