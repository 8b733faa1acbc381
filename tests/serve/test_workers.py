"""`serve --workers`: the pure parts (the processes are tested in tests/test_serve.py)."""

from __future__ import annotations

import os
import socket

import pytest

from egressbox.core.policy import parse_policy
from egressbox.serve.workers import MAX_WORKERS, ReloadRound, bind_group, share_limits, worker_count


def test_worker_count_accepts_1_to_256_and_auto() -> None:
    assert worker_count("1") == 1
    assert worker_count(str(MAX_WORKERS)) == MAX_WORKERS
    assert worker_count("auto") == min(MAX_WORKERS, len(os.sched_getaffinity(0)))


@pytest.mark.parametrize("text", ["0", "-1", "257", "two", "", "1.5"])
def test_worker_count_refuses_the_rest(text: str) -> None:
    with pytest.raises(ValueError, match="use 1-256 or auto"):
        worker_count(text)


@pytest.mark.parametrize(
    ("total", "count", "each"), [(4096, 2, 2048), (5, 2, 3), (1, 4, 1), (100, 3, 34)]
)
def test_max_connections_is_split_rounding_up(total: int, count: int, each: int) -> None:
    policy = parse_policy(
        {"egress": {"allow_cidrs": ["10.0.0.0/8"]}, "limits": {"max_connections": total}}
    )
    shared = share_limits(policy, count)
    assert shared.limits.max_connections == each
    assert each * count >= total
    # Everything else is the same policy, and the original is untouched.
    assert policy.limits.max_connections == total
    assert shared.limits.drain_timeout == policy.limits.drain_timeout
    assert shared.allow_cidrs == policy.allow_cidrs
    ip = policy.allow_cidrs[0].network_address
    assert shared.allow_cidr_for(ip) == policy.allow_cidr_for(ip) == policy.allow_cidrs[0]


def test_one_worker_keeps_the_policy_as_it_is() -> None:
    policy = parse_policy({})
    assert share_limits(policy, 1) is policy


def test_bind_group_shares_one_port_and_refuses_a_taken_one() -> None:
    group = bind_group("127.0.0.1", 0, 3)
    try:
        assert len({sock.getsockname()[1] for sock in group}) == 1
        assert all(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) for sock in group)
    finally:
        for sock in group:
            sock.close()
    with socket.create_server(("127.0.0.1", 0)) as taken, pytest.raises(OSError):
        bind_group("127.0.0.1", taken.getsockname()[1], 2)


def test_reload_round_says_each_answer_once() -> None:
    agreed = ReloadRound(3)
    for _ in range(3):
        agreed.add("policy reloaded from p.toml")
    assert agreed.expected == 0
    assert agreed.lines(3) == ["policy reloaded from p.toml"]
    split = ReloadRound(2)
    split.add("policy reloaded from p.toml")
    split.add("reload refused, keeping the old policy: bad")
    assert split.lines(2) == [
        "policy reloaded from p.toml (in 1 of 2 workers)",
        "reload refused, keeping the old policy: bad (in 1 of 2 workers)",
    ]
