#!/usr/bin/env bash
# Installs what benchmarks/proxy.py compares egressbox with, idempotently:
# squid, tinyproxy and wrk from Debian (their system services are NOT started:
# the benchmark runs its own instances on loopback ports), pproxy from PyPI
# into the project's virtual environment, and py-spy for profiling.
#
#   benchmarks/setup.sh            # as root, or a user with sudo, after scripts/setup
#
# CI does not run the benchmarks, so none of this is part of scripts/setup.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PYTHON" ]; then
    echo "setup.sh: $PYTHON not found; run scripts/setup first (or set PYTHON)" >&2
    exit 1
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

missing=()
for pkg in squid tinyproxy wrk; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done
if [ "${#missing[@]}" -gt 0 ]; then
    # policy-rc.d exit 101: the packages' maintainer scripts must not start
    # squid/tinyproxy as system services (they would hold ports 3128/8888).
    created_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
        $SUDO chmod 755 /usr/sbin/policy-rc.d
        created_policy=1
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
    if [ -n "$created_policy" ]; then
        $SUDO rm -f /usr/sbin/policy-rc.d
    fi
fi

need_pip=""
"$PYTHON" -c "import pproxy" 2>/dev/null || need_pip=1
[ -x "$(dirname "$PYTHON")/py-spy" ] || need_pip=1
if [ -n "$need_pip" ]; then
    "$PYTHON" -m pip install --quiet pproxy py-spy
fi

echo "setup.sh: squid $(/usr/sbin/squid -v | head -1 | awk '{print $NF}'), tinyproxy $(tinyproxy -v | awk '{print $2}'), wrk $(wrk -v 2>&1 | head -1 | awk '{print $2}'), pproxy $("$PYTHON" -c 'import importlib.metadata as m; print(m.version("pproxy"))')"
