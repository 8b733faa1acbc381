"""`egressbox doctor`'s profile table: sized to its contents and to the terminal."""

from __future__ import annotations

import pytest

from egressbox.cli.doctor import _profiles_table

ALL = [
    "capabilities",
    "landlock_fs",
    "landlock_net",
    "landlock_scope",
    "mount_namespace",
    "network_namespace",
    "pid_namespace",
    "seccomp",
]
REFUSAL = (
    "refused: profile os_hardened requires mount_namespace, which is unavailable here;"
    " to admit it: allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1)"
)
# name: (enforced, missing, refuses)
ROWS = {
    "unrestricted": (["landlock_net", "seccomp"], [], []),
    "workspace_paths": (ALL, [], []),
    "os_hardened": (
        ["capabilities", "seccomp"],
        ["landlock_fs", "mount_namespace", "network_namespace", "pid_namespace"],
        [REFUSAL],
    ),
}
PROFILES: dict[str, dict[str, object]] = {
    name: {"enforced": enforced, "missing": missing, "refuses": refuses}
    for name, (enforced, missing, refuses) in ROWS.items()
}


@pytest.mark.parametrize("width", [60, 80, 100, 200])
def test_profile_table_fits_the_width(width: int) -> None:
    table = _profiles_table(PROFILES, width)
    lines = table.splitlines()
    assert all(len(line) <= width for line in lines), table
    words = table.replace(",", " ").split()
    for enforced, missing, _ in ROWS.values():
        for item in enforced + missing:
            assert item in words, (item, table)  # wrapped between names, never inside one
    assert REFUSAL in " ".join(table.split()), table
    # Each row starts on a line of its own, and MISSING is one column.
    column = lines[0].index("MISSING")
    for name, (_, missing, _) in ROWS.items():
        (first,) = [line for line in lines if line.startswith(name + " ")]
        assert first[column:].startswith((missing or ["-"])[0]), (name, table)


def test_profile_table_is_one_line_a_profile_when_it_fits() -> None:
    lines = _profiles_table(PROFILES, 300).splitlines()
    assert lines[2].split() == ["workspace_paths", *[f"{m}," for m in ALL[:-1]], ALL[-1], "-"]
