"""Approval on a miss: a destination no allow entry admits is held while a decider answers.

The gate (gate.py) hands a request whose only fault is `no_allow_rule` to `Approvals.ask()`
instead of refusing it, and the connection waits there without a reply. The decider (a
callback, the `--ask-command` program, or the terminal prompt of `run --ask`) answers `deny`,
`once` (the requests it was asked about) or `session` (this host and port until the proxy
stops); no answer within `timeout` seconds denies. Concurrent misses for the same host and port
share one question, asked with every protocol of the requests waiting when it is put; a `once`
answer admits the requests of those protocols only, and a request of another protocol that
joined later is asked about again (a `deny` or `session` answer is about the host and port, so
it settles every waiting request). Open questions are bounded in total and per client, so one
client cannot make every other client's miss denied unasked.

An answer only lifts the missing allow entry for the name, under the policy in force when the
answer arrives (gate.py): a deny entry, deny_cidrs, cloud metadata, the private and special
ranges and the proxy's own listeners win whatever the decider said. Deny entries, bad hosts and
ports, report mode and DNS questions of a captured child are never asked about; neither is an
IP literal whose address is refused anyway. A policy reload settles the open questions its name
rules decide (settle()): refused with `policy_reloaded`, or admitted by a new allow entry.

Reasons in the audit record (one per request, as always): `approved` (allowed once),
`approved_session` (the session answer, and every later request it admits), `approval_denied`
(the decider said deny, failed, or gave no valid answer), `approval_timeout`, and
`policy_reloaded` (a reload refused the request while its question was open).

The `--ask-command` protocol: the program (no shell) gets one JSON line on stdin,
`{"protocol": "connect", "host": "example.org", "port": 443, "protocols": ["connect"]}`, and
the same values in EGRESSBOX_PROTOCOL, EGRESSBOX_HOST, EGRESSBOX_PORT and EGRESSBOX_PROTOCOLS
(comma-separated); its environment holds nothing else but PATH. `protocols` lists every
protocol the question covers (`protocol` is the first of them), so a `once` answer is given
knowing what it admits. It answers with one word on the first line of stdout: `deny`, `once`
or `session`. A non-zero exit status, any other answer or more than MAX_ANSWER_BYTES of output
deny; when the question times out (or the proxy stops), its process group is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum
from typing import NamedTuple

from egressbox.core.errors import Reason
from egressbox.core.hosts import format_authority
from egressbox.fs.held import HeldFile

# How long a question may stay open before it denies (`--ask-timeout`): long enough to read
# a prompt and decide, short enough that a client's own timeout (curl and pip wait longer
# for a connect) does not give up first.
DEFAULT_TIMEOUT = 30.0
# Distinct questions open at once; more are denied at once (a client inventing names must not
# queue unbounded work behind a person or a program).
MAX_OPEN_QUESTIONS = 16
# Of those, how many one client address may have opened: a quarter, so one slow or hostile
# client leaves three quarters of the room to the others (sixteen questions from one client
# used to make every other client's miss denied unasked).
MAX_OPEN_QUESTIONS_PER_CLIENT = 4
# How often one request may be asked about again because a `once` answer covered other
# protocols only: one round per protocol there is (http, connect, socks5, tcp).
MAX_ASK_ROUNDS = 4
# The longest answer --ask-command may write ("session\n" is 8 bytes).
MAX_ANSWER_BYTES = 256
# After a killed --ask-command, how long to wait for it to be reaped.
KILL_WAIT = 2.0
# How long closing the proxy waits for open questions to wind down.
CLOSE_WAIT = 2.0
# PATH for --ask-command when ours has none.
DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"


class Answer(StrEnum):
    """What a decider says about a destination no allow entry admits."""

    DENY = "deny"
    ONCE = "once"  # this request (and those asking the same question with it)
    SESSION = "session"  # this host and port, until the proxy stops


class MissRequest(NamedTuple):
    """What a decider is asked about: the request's protocol and its normalized target (and
    the other protocols of the requests sharing the question, if any)."""

    protocol: str  # http | connect | socks5 | tcp
    host: str
    port: int
    # Empty for a question about one protocol: equal to the three-field request then.
    also: tuple[str, ...] = ()

    @property
    def authority(self) -> str:
        return format_authority(self.host, self.port)

    @property
    def protocols(self) -> tuple[str, ...]:
        """Every protocol the question covers (what a `once` answer admits)."""
        return (self.protocol, *self.also)


# A decider: sync or async, answering an Answer or its text. A sync one runs on the event
# loop, so it must not block (ask a person or a program from an async one).
Decider = Callable[[MissRequest], "Answer | str | Awaitable[Answer | str]"]
Log = Callable[[str], None]


class Outcome(NamedTuple):
    """A question's result, as the gate audits it."""

    answer: Answer
    reason: Reason
    detail: str

    @property
    def allowed(self) -> bool:
        return self.answer is not Answer.DENY


_STOPPED = Outcome(Answer.DENY, Reason.APPROVAL_DENIED, "not answered: the proxy stopped")
# settle()'s outcomes: a reload's name rules decided the question before any answer.
RELOAD_REFUSED = Outcome(
    Answer.DENY, Reason.POLICY_RELOADED, "the reloaded policy refuses it before any answer"
)
RELOAD_ADMITTED = Outcome(Answer.ONCE, Reason.ALLOWED, "an allow entry of the reloaded policy")


class _Question:
    """One open question (per host and port): its task, the protocols of the requests waiting
    on it, those it was put with (set when the decider is called) and who opened it."""

    __slots__ = ("asked", "client", "protocols", "settled", "task", "waiting")

    def __init__(self, protocol: str, client: str) -> None:
        self.protocols = [protocol]
        self.asked: tuple[str, ...] = ()
        self.client = client
        self.settled: Outcome | None = None  # settle()'s outcome, replacing the answer
        self.waiting = 0
        self.task: asyncio.Task[Outcome] | None = None


_SESSION = Outcome(Answer.SESSION, Reason.APPROVED_SESSION, "approved for the session")


class Approved(NamedTuple):
    """A destination the decider allowed (for --save-approved)."""

    host: str
    port: int
    answer: Answer  # ONCE or SESSION


class Approvals:
    """The questions of one proxy: open ones (shared per host and port), session answers."""

    def __init__(
        self, decider: Decider, *, timeout: float = DEFAULT_TIMEOUT, log: Log | None = None
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"the approval timeout must be more than 0 seconds, got {timeout}")
        self.decider = decider
        self.timeout = timeout
        self.log = log
        self._session: dict[tuple[str, int], None] = {}
        self._approved: dict[tuple[str, int], Answer] = {}
        self._open: dict[tuple[str, int], _Question] = {}
        self._by_client: dict[str, int] = {}  # open questions per client that opened them
        self._closed = False

    def admits(self, host: str, port: int) -> bool:
        """Whether a session answer admits `host:port` (no question needed)."""
        return (host, port) in self._session

    def approved(self) -> list[Approved]:
        """Every destination allowed so far, in the order first allowed; a session answer
        wins over an earlier once."""
        return [Approved(host, port, answer) for (host, port), answer in self._approved.items()]

    @property
    def open_questions(self) -> int:
        return len(self._open)

    async def ask(self, request: MissRequest, *, client: str = "") -> Outcome:
        """The outcome for `request` (from the client address `client`): at once for a
        session answer, else the (shared) question's. A `once` answer to a question put with
        other protocols than this request's asks again."""
        for _ in range(MAX_ASK_ROUNDS):
            outcome, asked = await self._ask_once(request, client)
            # A decider's `once` is about the protocols it was asked with, no others.
            if outcome.reason is not Reason.APPROVED or request.protocol in asked:
                return outcome
        return Outcome(Answer.DENY, Reason.APPROVAL_DENIED, "not asked: asked too often")

    async def _ask_once(self, request: MissRequest, client: str) -> tuple[Outcome, tuple[str, ...]]:
        key = (request.host, request.port)
        if key in self._session:
            return _SESSION, ()
        question = self._open.get(key)
        if question is None:
            refused = self._room_for(client)
            if refused:
                return Outcome(Answer.DENY, Reason.APPROVAL_DENIED, f"not asked: {refused}"), ()
            question = _Question(request.protocol, client)
            opened = asyncio.get_running_loop().create_task(self._question(request, question))
            question.task = opened
            self._open[key] = question
            self._by_client[client] = self._by_client.get(client, 0) + 1
            opened.add_done_callback(lambda done: self._closed_question(key, question))
        elif request.protocol not in question.protocols:
            question.protocols.append(request.protocol)
        task = question.task
        assert task is not None
        question.waiting += 1
        # Shielded: one waiter leaving (its client gone) must not end the others' question.
        try:
            return await asyncio.shield(task), question.asked
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if task.cancelled() and (current is None or not current.cancelling()):
                # Ended before it began: by settle() (a reload) or by close().
                settled = question.settled
                return (settled if settled is not None else _STOPPED), ()
            raise
        finally:
            question.waiting -= 1

    def _room_for(self, client: str) -> str:
        """Why a new question from `client` is not put (empty: it is)."""
        if self._closed:
            return "the proxy is stopping"
        if len(self._open) >= MAX_OPEN_QUESTIONS:
            return "too many questions are open"
        if self._by_client.get(client, 0) >= MAX_OPEN_QUESTIONS_PER_CLIENT:
            return f"this client ({client or '-'}) has too many questions open"
        return ""

    def _closed_question(self, key: tuple[str, int], question: _Question) -> None:
        if self._open.get(key) is question:
            del self._open[key]
        count = self._by_client.get(question.client, 0) - 1
        if count > 0:
            self._by_client[question.client] = count
        else:
            self._by_client.pop(question.client, None)

    def settle(self, judge: Callable[[str, int], Outcome | None]) -> int:
        """A policy reload: `judge` each open question's host and port; one it answers (a
        refusal or an admission by the new rules) ends with that outcome and its decider is
        stopped (a command is killed). Returns how many waiting requests were refused."""
        refused = 0
        for (host, port), question in list(self._open.items()):
            outcome = judge(host, port)
            if outcome is None or question.settled is not None or question.task is None:
                continue
            question.settled = outcome
            question.task.cancel()
            if not outcome.allowed:
                refused += question.waiting
        return refused

    async def _question(self, request: MissRequest, question: _Question) -> Outcome:
        # Put now (a turn after it was opened): every request that joined meanwhile is in it.
        question.asked = tuple(question.protocols)
        request = request._replace(protocol=question.asked[0], also=question.asked[1:])
        try:
            if question.settled is not None:
                return question.settled
            async with asyncio.timeout(self.timeout):
                answer = await self._call(request)
        except TimeoutError:
            detail = f"no answer within {self.timeout:g} s"
            return Outcome(Answer.DENY, Reason.APPROVAL_TIMEOUT, detail)
        except asyncio.CancelledError:
            if question.settled is not None:
                return question.settled  # settle(): the reload decided it
            if not self._closed:
                raise
            # close(): every request still waiting gets its refusal, audited as any other.
            return _STOPPED
        except Exception as exc:  # the decider's failure denies; it never breaks the proxy
            self._say(f"ask {request.protocol} {request.authority}: the decider failed: {exc!r}")
            return Outcome(Answer.DENY, Reason.APPROVAL_DENIED, "the decider failed")
        return self._settle(request, answer)

    async def _call(self, request: MissRequest) -> Answer | str:
        answer = self.decider(request)
        if isinstance(answer, Awaitable):
            return await answer
        return answer

    def _settle(self, request: MissRequest, answer: object) -> Outcome:
        key = (request.host, request.port)
        try:
            if not isinstance(answer, str):
                raise ValueError(answer)
            chosen = Answer(answer.strip().lower())
        except ValueError:
            self._say(f"ask {request.protocol} {request.authority}: not an answer: {answer!r}")
            return Outcome(Answer.DENY, Reason.APPROVAL_DENIED, "no valid answer")
        if chosen is Answer.DENY:
            return Outcome(chosen, Reason.APPROVAL_DENIED, "denied when asked")
        if chosen is Answer.SESSION:
            self._session[key] = None
            self._approved[key] = chosen
            return _SESSION
        self._approved.setdefault(key, chosen)
        return Outcome(chosen, Reason.APPROVED, "approved once")

    def _say(self, line: str) -> None:
        if self.log is not None:
            self.log(line)

    def close(self) -> None:
        """Deny every open question now (the proxy stops); new ones are denied too."""
        self._closed = True
        for question in list(self._open.values()):
            if question.task is not None:
                question.task.cancel()

    async def aclose(self) -> None:
        """close(), then wait (bounded) until the deciders have let go (a killed command)."""
        tasks = [question.task for question in self._open.values() if question.task is not None]
        self.close()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_WAIT)


# -- --ask-command -------------------------------------------------------------------------


def command_argv(text: str) -> list[str]:
    """An --ask-command line as argv (split as a shell would; no shell runs it). ValueError
    says why it cannot run: it does not parse, is empty, or names no executable program."""
    import shlex
    import shutil

    argv = shlex.split(text)
    if not argv:
        raise ValueError("empty command")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"{argv[0]!r} is not an executable program (or not on PATH)")
    return argv


class CommandDecider:
    """Asks a program (see the module docstring for its protocol)."""

    def __init__(self, argv: Sequence[str], *, path: str | None = None) -> None:
        if not argv:
            raise ValueError("the ask command is empty")
        self.argv = tuple(argv)
        self.path = path if path is not None else os.environ.get("PATH") or DEFAULT_PATH

    def environment(self, request: MissRequest) -> dict[str, str]:
        """Nothing of ours: PATH and the request."""
        return {
            "PATH": self.path,
            "EGRESSBOX_PROTOCOL": request.protocol,
            "EGRESSBOX_HOST": request.host,
            "EGRESSBOX_PORT": str(request.port),
            "EGRESSBOX_PROTOCOLS": ",".join(request.protocols),
        }

    async def __call__(self, request: MissRequest) -> Answer:
        line = json.dumps(
            {
                "protocol": request.protocol,
                "host": request.host,
                "port": request.port,
                "protocols": list(request.protocols),
            }
        )
        proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            env=self.environment(request),
            start_new_session=True,  # its own process group: a timeout kills all of it
        )
        try:
            out = await _exchange(proc, (line + "\n").encode())
            code = await proc.wait()
        except BaseException:
            await _kill(proc)
            raise
        if out is None or code != 0:
            return Answer.DENY
        first = out.decode("ascii", "replace").partition("\n")[0].strip().lower()
        try:
            return Answer(first)
        except ValueError:
            return Answer.DENY


async def _exchange(proc: asyncio.subprocess.Process, line: bytes) -> bytes | None:
    """Write the request, read the answer to its end; None when it says too much."""
    assert proc.stdin is not None and proc.stdout is not None
    with contextlib.suppress(ConnectionError):  # it need not read its stdin
        proc.stdin.write(line)
        await proc.stdin.drain()
    proc.stdin.close()
    out = b""
    while chunk := await proc.stdout.read(MAX_ANSWER_BYTES + 1):
        out += chunk
        if len(out) > MAX_ANSWER_BYTES:
            await _kill(proc)
            return None
    return out


async def _kill(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(proc.wait()), KILL_WAIT)


# -- --save-approved -----------------------------------------------------------------------


def approved_policy(approved: Sequence[Approved]) -> str:
    """A policy file admitting what was allowed for the session; once answers are listed
    commented out (remove the `#` to keep one). `egressbox check` accepts it."""
    lines = [
        "# Destinations approved when asked (egressbox run --ask, --ask-command).",
        "# Allowed for the session: entries. Allowed once: commented out.",
        "[egress]",
        "allow = [",
    ]
    for item in approved:
        entry = json.dumps(format_authority(item.host, item.port))
        if item.answer is Answer.SESSION:
            lines.append(f"    {entry},")
        else:
            lines.append(f"    # {entry},  # allowed once")
    lines.append("]")
    return "\n".join(lines + _approved_grants(approved)) + "\n"


def _approved_grants(approved: Sequence[Approved]) -> list[str]:
    """allow_cidrs for the approved local destinations (localhost, loopback, private IP
    literals): without it the entry could never work, every address being checked. A
    grant only an allowed-once entry needs is commented out like that entry."""
    from egressbox.core.local import grants_needed

    session: dict[str, list[str]] = {}
    once: dict[str, list[str]] = {}
    for item in approved:
        into = session if item.answer is Answer.SESSION else once
        for grant in grants_needed(item.host, item.port):
            into.setdefault(str(grant.network), []).append(grant.why)
    if not session and not once:
        return []
    lines = ["allow_cidrs = ["]
    for network, whys in session.items():
        lines += [f"    # {why}" for why in whys]
        lines.append(f"    {json.dumps(network)},")
    for network, whys in once.items():
        if network not in session:
            lines += [f"    # {why}" for why in whys]
            lines.append(f"    # {json.dumps(network)},  # for an entry allowed once")
    lines.append("]")
    return lines


# A policy file: readable by whoever loads it, as before (0644).
APPROVED_MODE = 0o644


def save_approved(path: str | HeldFile, approved: Sequence[Approved]) -> None:
    """Write approved_policy() to `path` in one step (a reader never sees half of it).

    Give a HeldFile made before the run's child started: its directory is held from then
    on (egressbox.fs.held), so a directory on the way that the child replaced with a symbolic
    link cannot send the file elsewhere. A plain path is resolved now. Raises OSError.
    """
    data = approved_policy(approved).encode("utf-8")
    if isinstance(path, HeldFile):
        path.write(data, APPROVED_MODE)
        return
    target = HeldFile(path)
    try:
        target.write(data, APPROVED_MODE)
    finally:
        target.close()
