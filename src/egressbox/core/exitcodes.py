"""Exit codes of every egressbox command, in one place the library and the CLI share.

The contract (README, "Exit codes"): 0 ok; 1 runtime error; 2 usage or bad policy; 3 a server
that could not start; for `run`, the command's own code (128+N when signal N ended it), 124
when --timeout expired, 125 when the command changed or made host-trusted files (egressbox put
them back or moved them aside after the run, and said so on stderr), 126 when the confinement
the profile requires is unavailable (the command never ran), 127 when the command was not found.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_START = 3
EXIT_TIMEOUT = 124  # as coreutils timeout
# The command left host-trusted paths changed or made (.git/config, a new .git/commondir or
# sub/.git, a hook, the policy): put back or moved aside after the run (runner/verify.py).
EXIT_TAMPERED = 125
EXIT_CANNOT_CONFINE = 126
EXIT_NOT_FOUND = 127
