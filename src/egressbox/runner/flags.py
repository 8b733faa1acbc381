"""`egressbox run`'s flags, declared once: each with the library keyword it sets and the policy
key it mirrors.

The command line builds its `run` parser from RUN_FLAGS (cli/run_start.py) and turns the parsed
flags into options_for()'s keywords through the same table (cli/run.py); options_for() is the
one constructor of RunOptions, for `egressbox.run(...)` and the command line alike. A test
(tests/cli/test_run_options.py) holds the table, options_for()'s keywords and RunOptions'
fields one to one, with the intended differences named there.

Nothing is imported here: the table is read while the command line parses its arguments,
before the zygote forks (runner/zygote.py), and costs no import on that path.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple


class Flag(NamedTuple):
    """One argument of `egressbox run`."""

    # Its spellings: egressbox's own first, then the aliases (Harn's names).
    names: tuple[str, ...]
    # The options_for() keyword (egressbox.run's) it sets; "" for the command line's own flags
    # (what to print, where to write, a policy file instead of a Policy).
    keyword: str
    # argparse's add_argument keywords; "type" names a converter of the command line
    # ("seconds", "int"). Empty when `shared` adds the flag.
    argparse: Mapping[str, Any] = MappingProxyType({})
    # The policy key it mirrors, as "[table] key": the flag wins over it or adds to it.
    policy_key: str = ""
    # Added by the command line's helper of this name, which `serve` uses too.
    shared: str = ""
    # A mutually exclusive group of the parser.
    group: str = ""


def _f(
    names: tuple[str, ...],
    keyword: str,
    policy_key: str = "",
    *,
    group: str = "",
    **argparse: Any,
) -> Flag:
    return Flag(names, keyword, MappingProxyType(argparse), policy_key, group=group)


def _shared(helper: str, *flags: tuple[str, str]) -> tuple[Flag, ...]:
    return tuple(Flag((name,), keyword, shared=helper) for name, keyword in flags)


_ROOTS_DEFAULT = (
    "default: the project root above the current directory, the nearest holding .git or "
    "egressbox.toml, else the current directory"
)

# In the order `egressbox run --help` lists them.
RUN_FLAGS: tuple[Flag, ...] = (
    _f(
        ("--policy",),
        "",
        metavar="FILE",
        help="policy file (TOML); default: the project root's egressbox.toml once you have run "
        "with it as --policy; without either and without EGRESSBOX_ALLOW, every destination "
        "is denied",
    ),
    _f(
        ("--profile",),
        "profile",
        "[process] profile",
        default=None,
        choices=["unrestricted", "worktree", "os_hardened", "workspace_paths"],
        help="how strictly to confine (default worktree; the stricter of this and [process] "
        "profile of --policy wins; os_hardened refuses to run without every mechanism; "
        "workspace_paths is a deprecated name of worktree)",
    ),
    _f(
        ("--no-sandbox",),
        "",
        action="store_true",
        help="Harn's name for --profile unrestricted: no filesystem rules (said on stderr); "
        "the network boundary stays; refused with a root flag, as in Harn",
    ),
    _f(
        ("--allow-process-network",),
        "",
        action="store_true",
        help="Harn's flag, accepted: the command always reaches the network through the "
        "proxy only, under the policy (nothing more opens)",
    ),
    _f(
        ("--read-root", "--read-only-root"),
        "read_roots",
        "[filesystem] read_roots",
        action="append",
        default=[],
        metavar="PATH",
        help="a directory the command may read (repeatable; added to [filesystem] read_roots)",
    ),
    _f(
        ("--write-root",),
        "write_roots",
        "[filesystem] write_roots",
        action="append",
        default=[],
        metavar="PATH",
        help="a directory the command may write (repeatable; added to [filesystem] write_roots; "
        f"{_ROOTS_DEFAULT})",
    ),
    _f(
        ("--process-read-root", "--sandbox-read-root"),
        "process_read_roots",
        "[filesystem] process_read_roots",
        action="append",
        default=[],
        metavar="PATH",
        help="a directory the command's tools may read, e.g. a cache (repeatable; added to "
        "[filesystem] process_read_roots); not a workspace",
    ),
    _f(
        ("--process-write-root", "--sandbox-write-root"),
        "process_write_roots",
        "[filesystem] process_write_roots",
        action="append",
        default=[],
        metavar="PATH",
        help="a directory the command's tools may write, e.g. ~/.cache/pip (repeatable; added "
        "to [filesystem] process_write_roots); not a workspace: never the default directory, "
        "TMPDIR or a cache location",
    ),
    _f(
        ("--env",),
        "env",
        "[env] policy",
        dest="env_policy",
        default=None,
        choices=["inherited", "isolated", "granted"],
        help="which environment variables pass to the command (default: [env] policy of "
        "--policy, else inherited)",
    ),
    _f(
        ("--grant",),
        "grants",
        "[env] grant",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="pass this variable (or set it) in the command's environment, also one that "
        "--env inherited holds back as a credential (repeatable)",
    ),
    _f(
        ("--env-remove",),
        "env_remove",
        action="append",
        default=[],
        metavar="NAME",
        help="leave this variable of yours out of the command's environment (repeatable)",
    ),
    _f(
        ("--grant-file",),
        "grant_files",
        action="append",
        default=[],
        metavar="PATH",
        help="pass this file as it is, credentials included (repeatable): a configuration "
        "file the presets grant is otherwise a clean copy, and a credential file absent",
    ),
    _f(
        ("--allow-loopback", "--allow-process-loopback"),
        "allow_loopback",
        "[process] allow_tcp_loopback",
        action="store_true",
        help="let the command run and reach its own TCP servers on its private lo ([process] "
        "allow_tcp_loopback)",
    ),
    _f(
        ("--unix-socket-root", "--sandbox-unix-socket-root"),
        "unix_socket_roots",
        "[filesystem] unix_socket_roots",
        action="append",
        default=[],
        metavar="PATH",
        help="let the command connect to the unix sockets under PATH and bind its own there "
        "(its other files stay read-only; repeatable; added to [filesystem] "
        "unix_socket_roots); a socket under any other root cannot be connected to",
    ),
    _f(
        ("--writable-trusted",),
        "writable_trusted",
        "[filesystem] writable_trusted",
        action="append",
        default=[],
        metavar="PATH",
        help="let the command write PATH although the host trusts it (.git/hooks, "
        ".git/config, .envrc, shell start-up and editor task files are read-only by "
        "default; repeatable; added to [filesystem] writable_trusted)",
    ),
    _f(
        ("--read-only-workspace",),
        "read_only_workspace",
        "[filesystem] workspace",
        action="store_true",
        help="the workspace may be read, nothing in it written (TMPDIR and tool caches live "
        'outside it for the run); [filesystem] workspace = "read-only" says the same',
    ),
    _f(
        ("--toolchain-cache",),
        "toolchain_cache",
        "[filesystem] toolchain_cache",
        choices=["scratch", "real"],
        default=None,
        help="where Go, Cargo, npm, pnpm, Yarn, pip, uv, Gradle and Maven keep their caches: "
        "the run's scratch space (default), or their real ones under your home, read+write "
        "(shared with the command, which could poison them); [filesystem] toolchain_cache",
    ),
    _f(
        ("--allow-direct-network",),
        "allow_direct_network",
        action="store_true",
        help="run even where neither a network namespace nor Landlock TCP rules can hold "
        "the command to the proxy (its network is then unconfined)",
    ),
    _f(
        ("--no-capture",),
        "capture",
        action="store_true",
        help="do not capture: by default every TCP connection the command makes reaches the "
        "proxy, proxy variables or not, and its DNS is answered inside its namespace (where "
        "the host allows it: egressbox doctor, row capture); without it only the proxy "
        "variables lead anywhere",
    ),
    _f(
        ("--user",),
        "user",
        metavar="NAME",
        help="started as root (sudo): set the run up with root's rights, so every namespace "
        "works whatever the host allows users, and run CMD as NAME (its uid, gid, groups and "
        "HOME); the files it writes are NAME's",
    ),
    _f(
        ("--pass-fd",),
        "pass_fds",
        action="append",
        type="int",
        default=[],
        metavar="N",
        help="keep descriptor N open in the command (repeatable)",
    ),
    _f(
        ("--timeout",),
        "timeout",
        "[process] timeout",
        type="seconds",
        default=None,
        metavar="SECONDS",
        help="stop the command after SECONDS (SIGTERM, SIGKILL 5 s later); the exit code is "
        "then 124 (default: [process] timeout of --policy, else none)",
    ),
    _f(("--audit-log",), "", metavar="FILE", help="append audit records to FILE"),
    _f(
        ("--workspace",),
        "workspace",
        choices=["staged", "direct"],
        default=None,
        help="staged (default): the command's writes to its write roots land in a layer that "
        "is applied when it exits, except host-trusted files (git config and hooks, in a new "
        "repository too, a replaced .git, shell start-up files, .envrc, .vscode, .idea, "
        "egressbox's own), which are held back and named; direct: it writes the host's "
        "files live",
    ),
    _f(
        ("--review",),
        "review",
        action="store_true",
        help="keep the whole staged layer: apply nothing, then look with egressbox changes, "
        "and egressbox apply or egressbox discard",
    ),
    _f(
        ("--report-only",),
        "",
        action="store_true",
        help="report mode: names outside the allow list pass, audited as would_deny",
    ),
    _f(
        ("--report",),
        "",
        action="store_true",
        help="print what each confinement mechanism enforced, on stderr",
    ),
    _f(
        ("--quiet", "-q"),
        "announce",
        action="store_true",
        help="no per-connection lines, not even refusals",
    ),
    _f(
        ("--verbose", "-v"),
        "log_allowed",
        action="store_true",
        help="a line per allowed connection too (by default only refusals: the audit log has all)",
    ),
    _f(
        ("--ask",),
        "on_miss",
        group="asking",
        action="store_true",
        help="when the command asks for a destination no allow entry admits, ask at this "
        "terminal (deny, once, session) instead of refusing; stdin must be a terminal",
    ),
    _f(
        ("--ask-command",),
        "on_miss",
        group="asking",
        metavar="CMD",
        help="ask CMD instead of the terminal (the protocol of serve --ask-command)",
    ),
    *_shared("ask_common", ("--ask-timeout", "ask_timeout"), ("--save-approved", "")),
    *_shared("upstream", ("--upstream", ""), ("--upstream-target", "")),
    *_shared("nameserver", ("--nameserver", "nameservers")),
    _f(("cmd",), "cmd", nargs="...", metavar="-- CMD [ARGS...]"),
)


def dest(flag: Flag) -> str:
    """The attribute argparse stores the flag under."""
    if "dest" in flag.argparse:
        return str(flag.argparse["dest"])
    return flag.names[0].lstrip("-").replace("-", "_")
