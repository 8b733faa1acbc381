"""Exit codes of every egressbox command, in one place the library and the CLI share.

The contract (docs/commands.md, "Exit codes and refusals"), stable from one release to the
next: 0 ok; 1 runtime error; 2 usage or bad policy; 3 a server that could not start; for
`run`, the command's own code (128+N when signal N ended it), or one of the codes below when
egressbox itself ended the run or refused to start it (one code per cause; the command's own
code can be any of them too, so the refusal line on stderr and RunRefusedError.cause say which).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_START = 3
# A grant that would let the command rewrite egressbox's own files (its state directory
# inside a writable root, a symbolic link inside one on the way to the policy or audit log).
EXIT_UNSAFE_GRANT = 120
# The proxy's listeners could not be bound inside the command's network namespace.
EXIT_PROXY_BIND = 121
# The working directory or the workspace cannot be used as asked: outside every root (it would
# not exist for the command), a directory the command gets privately (/tmp, /var/tmp, /run
# themselves, /dev/shm), or / or the home directory itself without --write-root saying so.
EXIT_CWD_UNAVAILABLE = 122
# The command was found but could not be executed (exec format error, no execute permission);
# shells say 126 here, which egressbox keeps for confinement.
EXIT_CANNOT_EXECUTE = 123
EXIT_TIMEOUT = 124  # as coreutils timeout
# The command left host-trusted paths changed or made (.git/config, a new .git/commondir or
# sub/.git, a hook, the policy): put back or moved aside after the run (runner/verify.py).
EXIT_TAMPERED = 125
# The confinement the profile requires is unavailable (a mechanism, or any network boundary):
# the command never ran (Harn's contract).
EXIT_CANNOT_CONFINE = 126
# The command was not found (on PATH, or the path named), as shells say.
EXIT_NOT_FOUND = 127

# Why `run` refused to start the command or could not run it (RunRefusedError.cause, the
# refusal record's `cause`), and the exit code of each: one cause, one code.
CAUSE_CODES: dict[str, int] = {
    "confinement_unavailable": EXIT_CANNOT_CONFINE,
    "network_boundary_unavailable": EXIT_CANNOT_CONFINE,
    "cwd_unavailable": EXIT_CWD_UNAVAILABLE,
    "private_directory": EXIT_CWD_UNAVAILABLE,
    "workspace_too_wide": EXIT_CWD_UNAVAILABLE,
    "unsafe_grant": EXIT_UNSAFE_GRANT,
    "proxy_bind": EXIT_PROXY_BIND,
    "cannot_execute": EXIT_CANNOT_EXECUTE,
    "not_found": EXIT_NOT_FOUND,
}
