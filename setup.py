"""Build egressbox, with its proxy core compiled by mypyc when it can be.

The modules below are plain, typed Python (mypy --strict) that mypyc turns
into C extensions: the same code, about a fifth less CPU per short tunnel and
half as much per plain-HTTP request (benchmarks/README.md). Everything else
stays interpreted. Set EGRESSBOX_COMPILE=0 for a pure-Python build; without a
C compiler or the Python headers the build falls back to pure Python and says
so (`egressbox doctor` shows which one is installed).
"""

from __future__ import annotations

import contextlib
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

# The per-connection path: parsers, decisions, dialling, relay, server.
COMPILED = [
    "src/egressbox/protocols/http1.py",
    "src/egressbox/protocols/socks5.py",
    "src/egressbox/protocols/tls.py",  # the first bytes of every tunnel (the TLS name check)
    "src/egressbox/core/hosts.py",
    "src/egressbox/core/addresses.py",
    "src/egressbox/audit/record.py",  # one record per decision, before the reply
    "src/egressbox/core/rules.py",
    "src/egressbox/core/decide.py",
    "src/egressbox/proxy/check.py",
    "src/egressbox/net/deadlines.py",  # every connection arms three or four timeouts
    "src/egressbox/net/eventloop.py",  # two transports a tunnel enter its table
    "src/egressbox/net/dial.py",
    "src/egressbox/net/relay.py",
    "src/egressbox/proxy/tls_check.py",  # every tunnel's first bytes
    "src/egressbox/proxy/gate.py",
    "src/egressbox/proxy/tunnel.py",
    "src/egressbox/proxy/listeners.py",
    "src/egressbox/proxy/forward.py",
    "src/egressbox/proxy/server.py",
]


class OptionalBuildExt(build_ext):
    """A failed compile leaves a working pure-Python install, with one warning."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # any compiler failure
            # All or nothing: a module's stub cannot load without the group library.
            for path in self.get_outputs():
                with contextlib.suppress(OSError):
                    os.remove(path)
            _warn(exc)


def _warn(exc: BaseException) -> None:
    sys.stderr.write(
        f"egressbox: the compiled core was not built ({exc}); installing pure Python."
        " Install gcc and the Python headers (Debian: python3-dev) and reinstall for it.\n"
    )


def ext_modules() -> list[object]:
    if os.environ.get("EGRESSBOX_COMPILE", "1") == "0":
        return []
    try:
        from mypyc.build import mypycify

        return list(mypycify(COMPILED, opt_level="3", group_name="egressbox"))
    except (ImportError, SystemExit, Exception) as exc:  # no mypyc, or it refused the code
        _warn(exc)
        return []


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
