"""Run a command where no namespace can be made, the way a container's seccomp profile does it.

    python tests/no_namespaces.py [--refuse SYSCALL]... CMD [ARGS...]

Loads a seccomp filter that answers EPERM to unshare, setns, mount and clone with any
CLONE_NEW* flag (Docker's default profile refuses these to an unprivileged container), and
clone3 with ENOSYS (its flags are out of a filter's sight, so C libraries fall back to clone),
then execs CMD: the filter stays on it and everything it starts. `--refuse SYSCALL` answers
EPERM to one more call (a profile that also refuses pidfd_getfd, say).
"""

from __future__ import annotations

import errno
import os
import sys

import pyseccomp

# Every CLONE_NEW* flag (<linux/sched.h>): NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID,
# NEWNET; CLONE_NEWTIME (0x80) is refused too.
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000
CLONE_NEW_ANY |= 0x20000000 | 0x40000000 | 0x00000080


def load_filter(extra: tuple[str, ...] = ()) -> None:
    refuse = pyseccomp.ERRNO(errno.EPERM)
    rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in ("unshare", "setns", "mount", "fsopen", "open_tree", "move_mount", *extra):
        rules.add_rule(refuse, name)
    # clone's flags are argument 0 on x86-64; refuse it unless no CLONE_NEW* bit is set.
    for bit in _bits(CLONE_NEW_ANY):
        rules.add_rule(refuse, "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, bit, bit))
    rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
    rules.load()


def _bits(mask: int) -> list[int]:
    return [1 << i for i in range(32) if mask & (1 << i)]


def main(argv: list[str]) -> int:
    extra: list[str] = []
    while len(argv) > 1 and argv[0] == "--refuse":
        extra.append(argv[1])
        argv = argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    load_filter(tuple(extra))
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
