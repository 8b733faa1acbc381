"""The units under deploy/ hold together: the systemd units pass `systemd-analyze verify`, the
Kubernetes manifests parse as YAML and have the shape the README promises, and every command
line in them is one `egressbox serve` accepts, with a policy `egressbox check` accepts."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from egressbox.cli import build_parser
from egressbox.cli.serve import serve_options
from egressbox.core.policy import load_policy
from egressbox.serve.command import usage_problem

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
SYSTEMD = DEPLOY / "systemd"
POD_LABELS = {"app.kubernetes.io/name": "egressbox"}
API_VERSIONS = {
    "Namespace": "v1",
    "ConfigMap": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "PodDisruptionBudget": "policy/v1",
    "NetworkPolicy": "networking.k8s.io/v1",
    "Kustomization": "kustomize.config.k8s.io/v1beta1",
}


def serve_args(argv: list[str]) -> argparse.Namespace:
    """`egressbox serve ARGV` as the command line parses it (SystemExit on a bad flag)."""
    return build_parser("serve").parse_args(["serve", *argv])


def checked_options(argv: list[str]) -> argparse.Namespace:
    args = serve_args(argv)
    assert usage_problem(serve_options(args)) == ""
    return args


def admin_port(args: argparse.Namespace) -> int:
    assert args.admin is not None
    return int(args.admin.rsplit(":", 1)[1])


# -- systemd -------------------------------------------------------------------------------


def unit_lines(path: Path) -> Iterator[tuple[str, str, str]]:
    """(section, key, value) of a unit file, continuation lines joined."""
    section, pending = "", ""
    for raw in path.read_text().splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        yield section, key.strip(), value.strip()


def unit_values(path: Path, key: str) -> list[str]:
    return [value for _, k, value in unit_lines(path) if k == key]


def test_systemd_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian's systemd package)")
    egressbox = Path(sys.executable).with_name("egressbox")
    if not egressbox.exists():
        pytest.skip("the egressbox command is not installed beside this Python")
    # verify wants ExecStart's program to exist: point it at this install's command.
    service = (SYSTEMD / "egressbox.service").read_text()
    (tmp_path / "egressbox.service").write_text(
        service.replace("/usr/local/bin/egressbox", str(egressbox))
    )
    shutil.copy(SYSTEMD / "egressbox.socket", tmp_path / "egressbox.socket")
    done = subprocess.run(
        [analyze, "verify", "--man=no", "egressbox.service", "egressbox.socket"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Unknown keys and bad values are warnings with exit 0: no output at all is the bar.
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done


def test_the_service_is_hardened_notifies_and_reloads_by_sighup() -> None:
    service = SYSTEMD / "egressbox.service"
    values = {key: value for _, key, value in unit_lines(service)}
    assert values["Type"] == "notify"
    assert values["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert values["DynamicUser"] == "yes"
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "PrivateDevices",
        "RestrictSUIDSGID",
        "MemoryDenyWriteExecute",
        "LockPersonality",
    ):
        assert values[key] == "yes", key
    assert values["ProtectSystem"] == "strict"
    assert values["CapabilityBoundingSet"] == ""
    assert values["RestrictAddressFamilies"] == "AF_INET AF_INET6 AF_UNIX"
    assert "@system-service" in unit_values(service, "SystemCallFilter")
    argv = shlex.split(values["ExecStart"])
    assert argv[:2] == ["/usr/local/bin/egressbox", "serve"]
    args = checked_options(argv[2:])
    assert args.policy.startswith("/etc/egressbox/")  # ConfigurationDirectory=egressbox
    assert args.audit_log.startswith("/var/log/egressbox/")  # LogsDirectory=egressbox


def test_the_socket_unit_passes_the_ports_the_service_names() -> None:
    socket_unit = SYSTEMD / "egressbox.socket"
    streams = unit_values(socket_unit, "ListenStream")
    args = serve_args(shlex.split(unit_values(SYSTEMD / "egressbox.service", "ExecStart")[0])[2:])
    # Unnamed sockets are taken in order: http, then socks5 (systemd.py).
    assert streams == [f"{args.listen}:{args.http_port}", f"{args.listen}:{args.socks_port}"]
    assert unit_values(socket_unit, "FileDescriptorName") == []
    assert unit_values(socket_unit, "Service") == ["egressbox.service"]


# -- the container image ---------------------------------------------------------------------


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Containerfile, continuation lines joined."""
    found: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        found.append((word.upper(), rest.strip()))
    return found


def test_the_container_image_is_slim_unprivileged_and_checks_healthz() -> None:
    steps = instructions(DEPLOY / "Containerfile")
    known = {"FROM", "RUN", "WORKDIR", "COPY", "ENV", "USER", "EXPOSE", "STOPSIGNAL"}
    known |= {"HEALTHCHECK", "ENTRYPOINT", "CMD"}
    assert {word for word, _ in steps} <= known
    bases = [rest.split()[0] for word, rest in steps if word == "FROM"]
    assert bases and all(re.fullmatch(r"debian:\d+-slim", base) for base in bases)
    final = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    users = [rest for word, rest in steps[final:] if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    entry = json.loads(next(rest for word, rest in steps if word == "ENTRYPOINT"))
    cmd = json.loads(next(rest for word, rest in steps if word == "CMD"))
    assert entry[1:] == ["serve"]
    args = checked_options(cmd)
    health = next(rest for word, rest in steps if word == "HEALTHCHECK")
    assert f"http://127.0.0.1:{admin_port(args)}/healthz" in health
    exposed = {int(p) for word, rest in steps if word == "EXPOSE" for p in rest.split()}
    assert {args.http_port, args.socks_port, admin_port(args)} <= exposed
    # A read-only root: no bytecode written at run time.
    env = {item for word, rest in steps if word == "ENV" for item in rest.split()}
    assert "PYTHONDONTWRITEBYTECODE=1" in env


# -- Kubernetes ------------------------------------------------------------------------------


def manifests() -> dict[str, list[dict[str, Any]]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML comes with the test extra")
    found: dict[str, list[dict[str, Any]]] = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert isinstance(doc, dict), path
            assert doc.get("apiVersion") == API_VERSIONS.get(doc.get("kind", "")), path
            if doc["kind"] != "Kustomization":
                assert doc["metadata"]["name"], path
                assert doc["metadata"].get("namespace", "egressbox") == "egressbox", path
            found.setdefault(doc["kind"], []).append({**doc, "_file": path.name})
    return found


def one(found: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, Any]:
    assert len(found.get(kind, [])) == 1, kind
    return found[kind][0]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    wanted = selector.get("matchLabels", selector)
    return all(labels.get(k) == v for k, v in wanted.items())


def test_the_kustomization_lists_every_manifest() -> None:
    found = manifests()
    listed = one(found, "Kustomization")["resources"]
    files = sorted(p.name for p in KUBERNETES.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == files


def test_the_deployment_runs_three_hardened_replicas_with_probes(tmp_path: Path) -> None:
    found = manifests()
    deployment = one(found, "Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    pod = spec["template"]
    assert matches(spec["selector"], pod["metadata"]["labels"])
    assert pod["metadata"]["labels"] == POD_LABELS
    pod_spec = pod["spec"]
    assert pod_spec["securityContext"]["runAsNonRoot"] is True
    (container,) = pod_spec["containers"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    args = checked_options(container["args"])
    assert args.watch_policy and args.drain_delay > 0
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": args.http_port, "socks5": args.socks_port, "admin": admin_port(args)}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(admin_port(args))
    # The policy comes from the ConfigMap, mounted where --policy reads it.
    config = one(found, "ConfigMap")
    (volume,) = pod_spec["volumes"]
    assert volume["configMap"]["name"] == config["metadata"]["name"]
    (mount,) = container["volumeMounts"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    policy_path = Path(args.policy)
    assert str(policy_path.parent) == mount["mountPath"]
    assert policy_path.name in config["data"]
    copy = tmp_path / policy_path.name
    copy.write_text(config["data"][policy_path.name])
    policy = load_policy(str(copy))
    # The drain fits in the grace period: --drain-delay, then [limits] drain_timeout.
    grace = pod_spec["terminationGracePeriodSeconds"]
    assert args.drain_delay + policy.limits.drain_timeout < grace


def test_the_service_and_the_budget_select_the_pods() -> None:
    found = manifests()
    deployment = one(found, "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    names = {p["name"] for p in container["ports"]}
    service = one(found, "Service")
    assert matches(service["spec"]["selector"], POD_LABELS)
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "socks5"} <= names
    budget = one(found, "PodDisruptionBudget")
    assert matches(budget["spec"]["selector"], POD_LABELS)
    assert 0 < budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]


def test_network_policies_let_only_egressbox_reach_the_outside() -> None:
    policies = {p["metadata"]["name"]: p["spec"] for p in manifests()["NetworkPolicy"]}
    everyone = [p for p in policies.values() if p["podSelector"] == {}]
    (default,) = everyone
    assert default["policyTypes"] == ["Egress"]
    # Every pod's egress: to egressbox's pods (proxy ports) or the cluster DNS, nothing else.
    for rule in default["egress"]:
        for peer in rule["to"]:
            assert "ipBlock" not in peer
            if "namespaceSelector" not in peer:
                assert matches(peer["podSelector"], POD_LABELS)
    # egressbox's own pods may reach the outside (but not the metadata address).
    own = [
        p
        for p in policies.values()
        if p["podSelector"]
        and matches(p["podSelector"], POD_LABELS)
        and "Egress" in p["policyTypes"]
    ]
    (outside,) = own
    blocks = [peer["ipBlock"] for rule in outside["egress"] for peer in rule["to"]]
    assert {b["cidr"] for b in blocks} == {"0.0.0.0/0", "::/0"}
    assert all(b["except"] for b in blocks)
