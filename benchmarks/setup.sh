#!/usr/bin/env bash
# Installs and builds what benchmarks/proxy.py needs, idempotently:
# - squid and tinyproxy from Debian (their system services are NOT started:
#   the benchmark runs its own instances on loopback ports), gcc, strace and
#   perf (linux-perf) for benchmarks/profile_tunnel.py;
# - benchmarks/build/loadgen and benchmarks/build/origin from loadgen.c and
#   origin.c (gcc -O2; benchmarks/build/ is ignored by git);
# - pproxy (an optional peer) and py-spy (profiles) from PyPI into
#   benchmarks/build/pylib, never into the project's .venv.
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
for pkg in squid tinyproxy gcc libc6-dev strace linux-perf; do
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

mkdir -p benchmarks/build
for prog in loadgen origin; do
    gcc -O2 -Wall -Wextra -pthread -o "benchmarks/build/$prog" "benchmarks/$prog.c"
done

LIB=benchmarks/build/pylib
if [ ! -d "$LIB/pproxy" ] || [ ! -x "$LIB/bin/py-spy" ]; then
    "$PYTHON" -m pip install --quiet --target "$LIB" pproxy py-spy
fi

echo "setup.sh: squid $(/usr/sbin/squid -v | head -1 | awk '{print $NF}'), tinyproxy $(tinyproxy -v | awk '{print $2}'), pproxy $(PYTHONPATH=$LIB "$PYTHON" -c 'import importlib.metadata as m; print(m.version("pproxy"))'), benchmarks/build/{loadgen,origin} built"
