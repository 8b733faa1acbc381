"""The command line's start-up shortcuts change nothing that runs: a deferred module loads on
first use and stays one module, argparse says what it said, and `egressbox run` hands its
plan over before it has loaded what only a later step needs (no timing here: which modules
are loaded is what the shortcuts promise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from egressbox import cli

POLICY = Path(__file__).resolve().parents[2] / "policies" / "pypi.toml"


def _python(
    code: str, *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=cwd,
        env=env,
    )


def test_a_deferred_module_loads_on_first_use_and_stays_one_module() -> None:
    done = _python(
        """
        import json, sys
        from egressbox.cli import startup
        startup.defer_import("wave")  # a stdlib module nothing here imports
        import wave
        before = type(sys.modules["wave"]).__name__
        opened = wave.open  # the first use runs the module
        print(json.dumps([before, type(wave).__name__, sys.modules["wave"] is wave,
                          callable(opened), wave.Wave_read.__module__]))
        """
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == ["_LoadedOnFirstUse", "module", True, True, "wave"]


def test_a_module_already_loaded_is_left_alone() -> None:
    done = _python(
        """
        import sys, inspect
        from egressbox.cli import startup
        startup.defer_import("inspect")
        print(sys.modules["inspect"] is inspect and type(inspect).__name__ == "module")
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_argparse_messages_are_the_untranslated_text(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.build_parser("run").parse_args(["run", "--timeout"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: egressbox run" in err
    assert "error: argument --timeout: expected one argument" in err


def test_help_of_every_command_is_built_in_full(capsys: pytest.CaptureFixture[str]) -> None:
    # With a command named first only its parser is built; the top-level help lists them all.
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    for command in ("serve", "run", "check", "explain", "doctor", "connect", "audit"):
        assert f"\n    {command} " in out, out


# Modules a later step loads (the proxy, DNS, name normalization), or that nothing loads.
LATER = (
    "asyncio",
    "dns",
    "idna",
    "egressbox.proxy.server",
    "egressbox.core.rules",
    "egressbox.serve.command",
)

HANDOVER_PROBE = """
import json, sys
from egressbox.runner import zygote
seen = []
real = zygote.launch
def launch(plan, chan, fds):
    modules = sys.modules
    inspect_ran = "signature" in vars(modules["inspect"]) if "inspect" in modules else False
    seen.append([sorted(m for m in json.loads(sys.argv[2]) if m in modules), inspect_ran])
    return real(plan, chan, fds)
zygote.launch = launch
from egressbox.cli import main
code = main(["run", "--quiet", "--policy", sys.argv[1], "--", "true"])
print(json.dumps([code, seen]))
"""


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_run_hands_its_plan_over_before_the_later_steps_load(tmp_path: Path, cache: str) -> None:
    # A cold cache: the first run on a machine probes the host (and loads more modules).
    # egressbox's state beside the workspace, never inside it (run refuses that).
    env = {**os.environ, "EGRESSBOX_STATE_DIR": str(tmp_path / "state")}
    workspace = tmp_path / "ws"
    workspace.mkdir()
    for _ in range(1 if cache == "cold" else 2):
        done = _python(HANDOVER_PROBE, str(POLICY), json.dumps(LATER), cwd=workspace, env=env)
    assert done.returncode == 0, done.stderr
    code, seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert code == 0, done.stderr
    # One plan handed over, with none of the later modules loaded and inspect not run.
    assert seen == [[[], False]], done.stderr
