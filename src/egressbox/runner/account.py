"""`egressbox run --user NAME`: root sets the run up and the command runs as NAME.

Root creates every namespace without a user namespace, so a root-started run is fully confined
whatever the host says about unprivileged user namespaces (Ubuntu's AppArmor restriction, a
sysctl). The launcher becomes NAME (supplementary groups, gid, uid: confine/launcher.py) after
the namespaces and the constructed view are made and before Landlock and seccomp, keeping no
capability; the staged layer is applied by root and what it creates is given to NAME
(confine/staging.py Target.owner).
"""

from __future__ import annotations

import os
import pwd
from collections.abc import Mapping
from typing import NamedTuple

from egressbox.core.errors import EgressboxError


class Account(NamedTuple):
    """Who the command runs as: from the password database, never from the environment."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str
    shell: str

    @property
    def ids(self) -> tuple[int, int, tuple[int, ...]]:
        """(uid, gid, supplementary groups): what the launcher applies."""
        return self.uid, self.gid, self.groups


def lookup(name: str, *, euid: int | None = None) -> Account:
    """NAME's account, for a run started by root; refused otherwise, with why."""
    if (os.geteuid() if euid is None else euid) != 0:
        raise EgressboxError(
            f"refused: --user {name} needs egressbox started as root (sudo egressbox run "
            f"--user {name} -- CMD); started as yourself, the command already runs as you"
        )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise EgressboxError(f"refused: --user {name}: no such user") from None
    if entry.pw_uid == 0:
        raise EgressboxError(
            f"refused: --user {name} is uid 0: leave --user out to run the command as root"
        )
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir, entry.pw_shell)


# Variables that name the user: NAME's, not root's (sudo leaves SUDO_* for root's tools).
USER_VARIABLES = ("HOME", "USER", "LOGNAME")


def environment(base: Mapping[str, str], account: Account) -> dict[str, str]:
    """The environment a run for NAME starts from: NAME's HOME, USER and LOGNAME (a --grant
    HOME=... still sets the command's own); the run's decisions (credential paths, presets,
    toolchain caches) then follow NAME's home, never root's."""
    env = dict(base)
    env.update(HOME=account.home, USER=account.name, LOGNAME=account.name)
    for name in ("MAIL", "XDG_RUNTIME_DIR", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME"):
        env.pop(name, None)  # root's: NAME's defaults follow from HOME
    return env
