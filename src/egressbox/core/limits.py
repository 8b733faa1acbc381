"""Named limits with where each value came from; overridable in `[limits]`.

Pure. The proxy reads these from the policy's `Limits`; the constants are the
defaults and the documentation of why each number is what it is.
"""

from __future__ import annotations

from typing import Final, NamedTuple

# Largest TCP port number (RFC 9293: ports are 16 bits). Final: the compiled
# modules that read it get the number itself, not a module lookup.
MAX_PORT: Final = 65535

# SIGINT/SIGTERM: how long open tunnels may finish before they are aborted
# (DESIGN §4: 5 s, long enough for a request in flight, short enough for CI).
DRAIN_TIMEOUT = 5.0
# TCP connect to a pinned address. Linux's own SYN retries take ~127 s; a
# client behind a proxy gives up far sooner, so fail at 10 s with a 504.
CONNECT_TIMEOUT = 10.0
# A whole request head or SOCKS handshake must arrive within this time, so a
# slowloris client cannot hold a connection slot (nginx's
# client_header_timeout is 60 s; a machine client needs far less).
HEAD_TIMEOUT = 10.0
# A tunnel with no byte in either direction for this long is closed; long
# enough for a slow build step's idle keep-alive, short enough to reclaim
# slots abandoned by killed clients.
IDLE_TIMEOUT = 300.0
# A kept-alive client connection that sends no next request for this long is
# closed: idle keep-alive connections hold slots (nginx's keepalive_timeout is
# 75 s, squid's client_idle_pconn_timeout 2 min, HAProxy's examples 1-10 s; a
# machine client that pauses longer than this reconnects cheaply).
KEEPALIVE_TIMEOUT = 15.0
# Connections one client address may hold at once (0: no cap beyond
# max_connections): a single misbehaving client cannot take every slot.
MAX_CONNECTIONS_PER_CLIENT = 0
# Concurrent client connections; each costs two descriptors (client and
# upstream) and a few KiB, so 4096 fits a default 20,000-fd hard limit.
MAX_CONNECTIONS = 4096
# Largest HTTP request head (request line plus headers). 64 KiB matches
# common servers (nginx large_client_header_buffers 4x8k is smaller; Node 16 KiB).
MAX_HEAD_BYTES = 64 * 1024


class Limits(NamedTuple):
    """[limits]: timeouts and bounds of the proxy."""

    drain_timeout: float = DRAIN_TIMEOUT
    connect_timeout: float = CONNECT_TIMEOUT
    head_timeout: float = HEAD_TIMEOUT
    idle_timeout: float = IDLE_TIMEOUT
    max_connections: int = MAX_CONNECTIONS
    max_head_bytes: int = MAX_HEAD_BYTES
    keepalive_timeout: float = KEEPALIVE_TIMEOUT
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT


# Key -> (type, smallest allowed, largest allowed): the bounds keep a typo
# (say 5000 meant as ms) from silently making the proxy useless.
LIMIT_BOUNDS: dict[str, tuple[type, float, float]] = {
    "drain_timeout": (float, 0.0, 3600.0),
    "connect_timeout": (float, 0.1, 600.0),
    "head_timeout": (float, 0.1, 600.0),
    "idle_timeout": (float, 1.0, 86400.0),
    "max_connections": (int, 1, 1_000_000),
    "max_head_bytes": (int, 1024, 1024 * 1024),
    "keepalive_timeout": (float, 0.1, 86400.0),
    "max_connections_per_client": (int, 0, 1_000_000),
}

# DNS: a whole resolution (A and AAAA, every server, TCP fallback) must end
# within this time; glibc's default is 5 s per try, and a proxy client waits
# for the answer, so one try's worth is the budget.
DNS_TIMEOUT = 5.0
# Cached names; an entry is a few hundred bytes, so 4096 costs about 1 MiB.
DNS_CACHE_SIZE = 4096
# Answers are cached no longer than this even when their TTL is longer, so
# a policy-relevant change in DNS is seen within five minutes.
DNS_MAX_TTL = 300.0
