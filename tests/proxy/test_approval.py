"""The approvals (proxy/approval.py) on their own: shared questions, the bound on open ones,
answers of every kind, the --ask-command protocol with real programs (stdin, environment,
exit status, timeouts that kill its whole process group) and --save-approved output that
`egressbox check` accepts."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from egressbox.core.errors import Reason
from egressbox.core.policy import load_policy
from egressbox.proxy.approval import (
    MAX_ANSWER_BYTES,
    MAX_OPEN_QUESTIONS,
    MAX_OPEN_QUESTIONS_PER_CLIENT,
    RELOAD_ADMITTED,
    RELOAD_REFUSED,
    Answer,
    Approvals,
    Approved,
    CommandDecider,
    MissRequest,
    approved_policy,
    command_argv,
    save_approved,
)

IO_TIMEOUT = 15.0
SHORT = 0.5  # a question's timeout where the test waits for it
REQUEST = MissRequest("connect", "example.test", 443)


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


async def test_concurrent_asks_share_one_question() -> None:
    calls: list[MissRequest] = []
    gate = asyncio.Event()

    async def decider(request: MissRequest) -> str:
        calls.append(request)
        await gate.wait()
        return "once"

    approvals = Approvals(decider)
    waiters = [asyncio.create_task(approvals.ask(REQUEST)) for _ in range(5)]
    other = asyncio.create_task(approvals.ask(REQUEST._replace(port=80)))
    async with asyncio.timeout(IO_TIMEOUT):
        while len(calls) < 2:
            await asyncio.sleep(0.01)
    gate.set()
    outcomes = await asyncio.gather(*waiters, other)
    assert {o.reason for o in outcomes} == {Reason.APPROVED}
    assert sorted(r.port for r in calls) == [80, 443]
    # Answered: the next request asks again.
    assert (await approvals.ask(REQUEST)).reason is Reason.APPROVED
    assert len(calls) == 3


async def test_one_waiter_leaving_does_not_end_the_question() -> None:
    gate = asyncio.Event()

    async def decider(request: MissRequest) -> str:
        await gate.wait()
        return "session"

    approvals = Approvals(decider)
    leaving = asyncio.create_task(approvals.ask(REQUEST))
    staying = asyncio.create_task(approvals.ask(REQUEST))
    await asyncio.sleep(0)
    leaving.cancel()
    gate.set()
    assert (await staying).reason is Reason.APPROVED_SESSION
    assert approvals.admits("example.test", 443)


async def test_open_questions_are_bounded() -> None:
    gate = asyncio.Event()

    async def decider(request: MissRequest) -> str:
        await gate.wait()
        return "once"

    approvals = Approvals(decider)
    held = [
        asyncio.create_task(approvals.ask(REQUEST._replace(port=1000 + n), client=f"10.0.0.{n}"))
        for n in range(MAX_OPEN_QUESTIONS)
    ]
    await asyncio.sleep(0)
    over = await approvals.ask(REQUEST._replace(port=9), client="10.0.1.1")
    assert over.reason is Reason.APPROVAL_DENIED
    assert "too many questions are open" in over.detail
    gate.set()
    assert {o.reason for o in await asyncio.gather(*held)} == {Reason.APPROVED}


async def test_questions_are_bounded_per_client() -> None:
    """One client's slow questions leave room for the others' (they are asked, not denied)."""
    calls: list[MissRequest] = []
    gate = asyncio.Event()

    async def decider(request: MissRequest) -> str:
        calls.append(request)
        await gate.wait()
        return "once"

    approvals = Approvals(decider)
    greedy = [
        asyncio.create_task(approvals.ask(REQUEST._replace(port=2000 + n), client="10.0.0.1"))
        for n in range(MAX_OPEN_QUESTIONS_PER_CLIENT)
    ]
    await asyncio.sleep(0)
    over = await approvals.ask(REQUEST._replace(port=9), client="10.0.0.1")
    assert (over.reason, over.allowed) == (Reason.APPROVAL_DENIED, False)
    assert "10.0.0.1" in over.detail and "too many questions open" in over.detail
    # Another client is asked, while the greedy one's questions are still open.
    other = asyncio.create_task(approvals.ask(REQUEST._replace(port=9), client="10.0.0.2"))
    async with asyncio.timeout(IO_TIMEOUT):
        while len(calls) < MAX_OPEN_QUESTIONS_PER_CLIENT + 1:
            await asyncio.sleep(0.01)
    assert approvals.open_questions == MAX_OPEN_QUESTIONS_PER_CLIENT + 1
    gate.set()
    assert (await other).reason is Reason.APPROVED
    assert {o.reason for o in await asyncio.gather(*greedy)} == {Reason.APPROVED}
    # Answered: the greedy client has its room back.
    assert (await approvals.ask(REQUEST._replace(port=9), client="10.0.0.1")).allowed


async def test_once_admits_only_the_protocols_it_was_asked_about() -> None:
    calls: list[MissRequest] = []
    answers = [asyncio.Event(), asyncio.Event()]

    async def decider(request: MissRequest) -> str:
        calls.append(request)
        await answers[len(calls) - 1].wait()
        return "once" if len(calls) == 1 else "deny"

    approvals = Approvals(decider)
    plain = asyncio.create_task(approvals.ask(REQUEST._replace(protocol="http")))
    async with asyncio.timeout(IO_TIMEOUT):
        while not calls:
            await asyncio.sleep(0.01)
    # These join the open question after it was put about http only.
    tunnels = [
        asyncio.create_task(approvals.ask(REQUEST._replace(protocol=name)))
        for name in ("connect", "socks5")
    ]
    await asyncio.sleep(0.01)
    answers[0].set()
    assert (await plain).reason is Reason.APPROVED
    # The once answer about http admitted neither: they are asked again, together.
    async with asyncio.timeout(IO_TIMEOUT):
        while len(calls) < 2:
            await asyncio.sleep(0.01)
    assert not any(task.done() for task in tunnels)
    assert calls == [
        MissRequest("http", "example.test", 443),
        MissRequest("connect", "example.test", 443, ("socks5",)),
    ]
    assert calls[1].protocols == ("connect", "socks5")
    answers[1].set()
    assert {o.reason for o in await asyncio.gather(*tunnels)} == {Reason.APPROVAL_DENIED}


async def test_a_session_answer_admits_every_protocol_waiting() -> None:
    calls: list[MissRequest] = []
    gate = asyncio.Event()

    async def decider(request: MissRequest) -> str:
        calls.append(request)
        await gate.wait()
        return "session"

    approvals = Approvals(decider)
    first = asyncio.create_task(approvals.ask(REQUEST._replace(protocol="http")))
    async with asyncio.timeout(IO_TIMEOUT):
        while not calls:
            await asyncio.sleep(0.01)
    later = asyncio.create_task(approvals.ask(REQUEST._replace(protocol="connect")))
    await asyncio.sleep(0.01)
    gate.set()
    assert {o.reason for o in await asyncio.gather(first, later)} == {Reason.APPROVED_SESSION}
    assert len(calls) == 1


async def test_settle_ends_the_questions_a_reload_decides(tmp_path: Path) -> None:
    script = _script(
        tmp_path, "ask", f"sleep 60 &\necho $$ $! > {tmp_path}/$EGRESSBOX_HOST\nwait\necho once\n"
    )
    pids = tmp_path / "example.test"  # the refused question's command and its child
    approvals = Approvals(CommandDecider([str(script)]))
    refused = [asyncio.create_task(approvals.ask(REQUEST)) for _ in range(2)]
    admitted = asyncio.create_task(approvals.ask(REQUEST._replace(host="now.test")))
    standing = asyncio.create_task(approvals.ask(REQUEST._replace(host="still.test")))
    async with asyncio.timeout(IO_TIMEOUT):
        while not pids.exists() or approvals.open_questions < 3:
            await asyncio.sleep(0.05)
    verdicts = {"example.test": RELOAD_REFUSED, "now.test": RELOAD_ADMITTED}
    assert approvals.settle(lambda host, port: verdicts.get(host)) == 2  # requests refused
    outcomes = await asyncio.gather(*refused)
    assert {(o.reason, o.allowed) for o in outcomes} == {(Reason.POLICY_RELOADED, False)}
    assert (await admitted) is RELOAD_ADMITTED
    assert not standing.done()  # the reload did not decide it: its question stands
    # The refused question's command was killed with its process group, not left to run.
    for pid in (int(p) for p in pids.read_text().split()):
        deadline = time.monotonic() + IO_TIMEOUT
        while _alive(pid) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not _alive(pid)
    await approvals.aclose()
    assert (await standing).reason is Reason.APPROVAL_DENIED


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        ("once", Reason.APPROVED),
        (" Session\n", Reason.APPROVED_SESSION),
        (Answer.DENY, Reason.APPROVAL_DENIED),
        ("yes", Reason.APPROVAL_DENIED),
        (True, Reason.APPROVAL_DENIED),
        (None, Reason.APPROVAL_DENIED),
    ],
)
async def test_sync_and_async_answers(answer: object, reason: Reason) -> None:
    async def later(request: MissRequest) -> object:
        return answer

    for decider in (lambda request: answer, later):
        approvals = Approvals(decider)  # type: ignore[arg-type]
        assert (await approvals.ask(REQUEST)).reason is reason


async def test_a_raising_decider_denies_and_is_said() -> None:
    lines: list[str] = []

    def decider(request: MissRequest) -> str:
        raise RuntimeError("boom")

    approvals = Approvals(decider, log=lines.append)
    assert (await approvals.ask(REQUEST)).reason is Reason.APPROVAL_DENIED
    assert len(lines) == 1 and "boom" in lines[0]


async def test_a_silent_decider_times_out_and_close_denies_the_rest() -> None:
    async def never(request: MissRequest) -> str:
        await asyncio.Event().wait()
        return "once"

    approvals = Approvals(never, timeout=SHORT)
    outcome = await approvals.ask(REQUEST)
    assert (outcome.reason, outcome.allowed) == (Reason.APPROVAL_TIMEOUT, False)
    patient = Approvals(never)
    waiting = asyncio.create_task(patient.ask(REQUEST))
    await asyncio.sleep(0)
    await patient.aclose()
    assert (await waiting).reason is Reason.APPROVAL_DENIED
    assert (await patient.ask(REQUEST)).reason is Reason.APPROVAL_DENIED  # closed: not asked


async def test_approved_lists_once_and_session_in_order() -> None:
    answers = iter(["once", "session", "once", "deny"])
    approvals = Approvals(lambda request: next(answers))
    await approvals.ask(REQUEST)
    await approvals.ask(REQUEST._replace(host="two.test"))
    await approvals.ask(REQUEST._replace(host="three.test"))
    await approvals.ask(REQUEST._replace(host="four.test"))
    assert approvals.approved() == [
        Approved("example.test", 443, Answer.ONCE),
        Approved("two.test", 443, Answer.SESSION),
        Approved("three.test", 443, Answer.ONCE),
    ]


def test_a_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="more than 0"):
        Approvals(lambda request: "deny", timeout=0)


# -- --ask-command --------------------------------------------------------------------------


async def test_the_command_reads_json_and_answers(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        "ask",
        """\
        read line
        case "$line" in
          *'"host": "ok.test"'*'"port": 443'*) echo session ;;
          *) echo deny ;;
        esac
        """,
    )
    decider = CommandDecider([str(script)])
    assert await decider(MissRequest("connect", "ok.test", 443)) is Answer.SESSION
    assert await decider(MissRequest("connect", "other.test", 443)) is Answer.DENY


async def test_the_command_sees_only_path_and_the_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    seen = tmp_path / "seen.json"
    code = (
        "import json, os, sys\n"
        "line = sys.stdin.readline()\n"
        f"json.dump({{'env': dict(os.environ), 'line': line}}, open({str(seen)!r}, 'w'))\n"
        "print('once')\n"
    )
    decider = CommandDecider([sys.executable, "-c", code])
    assert await decider(MissRequest("tcp", "203.0.113.7", 22)) is Answer.ONCE
    found = json.loads(seen.read_text())
    # Python itself adds LC_CTYPE when it coerces a C locale (PEP 538): not ours.
    if found["env"].get("LC_CTYPE") == "C.UTF-8":
        del found["env"]["LC_CTYPE"]
    assert set(found["env"]) == {
        "PATH",
        "EGRESSBOX_PROTOCOL",
        "EGRESSBOX_HOST",
        "EGRESSBOX_PORT",
        "EGRESSBOX_PROTOCOLS",
    }
    assert found["env"]["EGRESSBOX_HOST"] == "203.0.113.7"
    assert found["env"]["EGRESSBOX_PORT"] == "22"
    assert found["env"]["EGRESSBOX_PROTOCOLS"] == "tcp"
    assert json.loads(found["line"]) == {
        "protocol": "tcp",
        "host": "203.0.113.7",
        "port": 22,
        "protocols": ["tcp"],
    }


async def test_a_shared_question_is_put_to_the_command_with_every_protocol(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "seen.jsonl"
    script = _script(
        tmp_path,
        "ask",
        f"""        read line
        printf '%s %s\n' "$line" "$EGRESSBOX_PROTOCOLS" >> {seen}
        echo once
        """,
    )
    approvals = Approvals(CommandDecider([str(script)]))
    asked = [REQUEST._replace(protocol=name) for name in ("http", "connect", "socks5")]
    # Made in one turn of the loop: all three wait when the question is put.
    outcomes = await asyncio.gather(*(approvals.ask(request) for request in asked))
    assert {o.reason for o in outcomes} == {Reason.APPROVED}
    line, _, protocols = seen.read_text().strip().rpartition(" ")
    assert json.loads(line) == {
        "protocol": "http",
        "host": "example.test",
        "port": 443,
        "protocols": ["http", "connect", "socks5"],
    }
    assert protocols == "http,connect,socks5"
    assert len(seen.read_text().splitlines()) == 1  # one question for the three


@pytest.mark.parametrize(
    "body",
    [
        "echo once; exit 3\n",  # a failing command denies whatever it printed
        "echo maybe\n",
        "echo\n",
        "exit 0\n",
        f"head -c {MAX_ANSWER_BYTES + 1} /dev/zero; echo once\n",
    ],
)
async def test_anything_but_a_clean_answer_denies(tmp_path: Path, body: str) -> None:
    decider = CommandDecider([str(_script(tmp_path, "ask", body))])
    assert await decider(REQUEST) is Answer.DENY


async def test_a_command_that_ignores_its_stdin_still_answers(tmp_path: Path) -> None:
    decider = CommandDecider([str(_script(tmp_path, "ask", "exec echo session\n"))])
    assert await decider(REQUEST) is Answer.SESSION


async def test_a_slow_command_times_out_and_its_process_group_is_killed(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = _script(tmp_path, "ask", f"sleep 60 &\necho $$ $! > {pids}\nwait\necho once\n")
    approvals = Approvals(CommandDecider([str(script)]), timeout=SHORT)
    outcome = await approvals.ask(REQUEST)
    assert outcome.reason is Reason.APPROVAL_TIMEOUT
    shell, sleeper = (int(p) for p in pids.read_text().split())
    deadline = time.monotonic() + IO_TIMEOUT
    while any(_alive(pid) for pid in (shell, sleeper)) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not _alive(shell) and not _alive(sleeper)


def _alive(pid: int) -> bool:
    """Running (a zombie counts as gone: it no longer runs)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_command_lines_are_checked(tmp_path: Path) -> None:
    script = _script(tmp_path, "ask", "echo deny\n")
    assert command_argv(f"{script} --flag 'a b'") == [str(script), "--flag", "a b"]
    for bad, why in [("", "empty"), ("'unclosed", "quotation"), ("no-such-asker", "executable")]:
        with pytest.raises(ValueError, match=why):
            command_argv(bad)


# -- --save-approved ------------------------------------------------------------------------


def test_saved_approvals_are_a_policy_check_accepts(tmp_path: Path) -> None:
    approved = [
        Approved("pypi.org", 443, Answer.SESSION),
        Approved("once.test", 80, Answer.ONCE),
        Approved("2001:db8::1", 8443, Answer.SESSION),
        Approved("203.0.113.7", 22, Answer.SESSION),
    ]
    path = tmp_path / "approved.toml"
    save_approved(str(path), approved)
    assert path.read_text() == approved_policy(approved)
    done = subprocess.run(
        [sys.executable, "-m", "egressbox", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("EGRESSBOX_ALLOW")},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    policy = load_policy(str(path))
    assert [rule.text for rule in policy.allow.rules] == [
        "pypi.org:443",
        "[2001:db8::1]:8443",
        "203.0.113.7:22",
    ]
    assert '# "once.test:80",  # allowed once' in path.read_text()


def test_nothing_approved_is_still_a_valid_policy(tmp_path: Path) -> None:
    path = tmp_path / "approved.toml"
    save_approved(str(path), [])
    policy = load_policy(str(path))
    assert list(policy.allow.rules) == []
