"""Run a test body in a forked child: irreversible steps (Landlock, seccomp,
namespaces, capability drops) must never touch the test process itself."""

from __future__ import annotations

import errno
import json
import os
import signal
import traceback
from collections.abc import Callable
from typing import Any

# A stuck child must not outlive the test run.
CHILD_TIMEOUT_S = 60


def fork_call(body: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``body`` in a forked child and return the dict it produced (or fail with its error)."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(read_fd)
        # The default action, not a handler inherited from pytest-timeout: a
        # Python handler never runs while the main thread is stuck after fork().
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(CHILD_TIMEOUT_S)
        try:
            produced = body()
        except BaseException:
            produced = {"child_error": traceback.format_exc()}
        try:
            os.write(write_fd, json.dumps(produced).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as reader:
        payload = reader.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    result: dict[str, Any] = json.loads(payload)
    assert "child_error" not in result, result.get("child_error")
    return result


def attempt(action: Callable[[], object]) -> str:
    """'ok' or the errno name of the OSError the action raised."""
    try:
        action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno or 0, str(exc))
    return "ok"
