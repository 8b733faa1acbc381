"""The examples that end each command's `--help` (argparse epilogs, shown as written).

Every line after `examples:` is a command a user can paste; tests/cli/test_help_examples.py
parses each with the real parser, so a renamed flag breaks the test, not the user. `audit`,
`changes`, `apply` and `discard` keep theirs in their own modules (src/egressbox/cli/)."""

from __future__ import annotations

EXAMPLES: dict[str, tuple[str, ...]] = {
    "egressbox": (
        "egressbox check policies/pypi.toml",
        "egressbox explain --policy policies/pypi.toml evil.example",
        "egressbox run --policy policies/pypi.toml -- pip download requests",
    ),
    "serve": (
        "egressbox serve --policy policies/pypi.toml --http-port 3128 --socks-port 1080",
        "egressbox serve --policy policy.toml --audit-log audit.jsonl --workers auto"
        " --admin 127.0.0.1:9464 --watch-policy",
        "egressbox serve --policy policy.toml --upstream http://proxy.corp.example:3128",
    ),
    "run": (
        "egressbox run --policy policies/pypi.toml -- pip download requests",
        "egressbox run --policy agent.toml --grant ANTHROPIC_API_KEY --review -- claude",
        "egressbox run --policy policies/deny-all.toml --report-only --audit-log learn.jsonl"
        " -- make test",
    ),
    "check": (
        "egressbox check policies/pypi.toml policies/npm.toml",
        "egressbox check --quiet egressbox.toml",
    ),
    "explain": (
        "egressbox explain --policy policies/pypi.toml pypi.org",
        "egressbox explain --policy policy.toml --json '[2001:db8::1]:5432'",
        "egressbox explain --policy policy.toml --nameserver 127.0.0.53 example.org:80",
    ),
    "doctor": (
        "egressbox doctor",
        "egressbox doctor --json",
        "egressbox doctor --upstream http://proxy.corp.example:3128",
    ),
    "connect": (
        "ssh -o ProxyCommand='egressbox connect %h %p' git@github.com",
        "egressbox connect --proxy socks5://127.0.0.1:1080 example.org 443",
    ),
}


def epilog(prog: object) -> str | None:
    """The epilog for a parser named `prog` ("egressbox" or "egressbox COMMAND")."""
    name = str(prog).rsplit(" ", 1)[-1] if prog else ""
    lines = EXAMPLES.get(name)
    return "examples:\n" + "".join(f"  {line}\n" for line in lines) if lines else None
