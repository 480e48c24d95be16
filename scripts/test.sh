#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, then runs the whole suite.
# Used by newcomers (README) and by CI (.ci/run). Extra arguments go to pytest.
#
# Python: the interpreter of an active virtual environment, else $PYTHON (default python3). A
# system Python that refuses pip (PEP 668: Debian 12, Ubuntu 24.04) gets a virtual environment in
# .venv (created once, reused after), which the tests then run in. Python 3.11 or later.
# Without arguments (the whole suite) `ruff check .` and `mypy moorline` run first; a finding fails.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
if [ -n "${VIRTUAL_ENV:-}" ] && [ -z "${PYTHON:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY="$VIRTUAL_ENV/bin/python"
fi
if ! command -v "$PY" >/dev/null 2>&1; then
  echo "scripts/test.sh: no $PY found: install Python 3.11 or later (Debian/Ubuntu: apt-get install python3 python3-venv)" >&2
  exit 1
fi
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)'; then
  echo "scripts/test.sh: moorline needs Python 3.11 or later; $PY is $("$PY" -V 2>&1)." \
       "Set PYTHON=/path/to/python3.11 (or newer), or activate a virtual environment made with one." >&2
  exit 1
fi
# "venv": already in a virtual environment; "managed": a system Python that refuses pip (PEP 668);
# "plain": a Python pip may install into (a container's own Python, pyenv, ...).
mode="$("$PY" - <<'EOF'
import os, sys, sysconfig
if sys.prefix != sys.base_prefix:
    print("venv")
elif os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")):
    print("managed")
else:
    print("plain")
EOF
)"

need_apt=()
command -v mosquitto_pub >/dev/null 2>&1 || need_apt+=(mosquitto-clients)
{ command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; } || need_apt+=(mosquitto)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
# cluster tests cut links between nodes with iptables (skipped where it cannot be used, e.g. not root)
{ command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ]; } || need_apt+=(iptables)
# the clock-bound test runs one node with its wall clock set ahead (LD_PRELOAD libfaketime)
ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1 || need_apt+=(libfaketime)
# the web console's test (tests/console) drives a headless Chromium over the DevTools protocol
{ command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; } || need_apt+=(chromium)
if [ "$mode" = managed ] && [ ! -x .venv/bin/python ] && ! "$PY" -c 'import ensurepip' >/dev/null 2>&1; then
  # Debian's python3 makes virtual environments only with python3-venv (python3.X-venv) installed
  need_apt+=("python$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')-venv")
fi
if [ "$mode" = plain ] && ! "$PY" -m pip --version >/dev/null 2>&1; then
  need_apt+=(python3-pip)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing with apt-get: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if [ "$mode" = managed ]; then
  if [ ! -x .venv/bin/python ]; then
    echo "$PY refuses pip installs (PEP 668): creating a virtual environment in .venv"
    "$PY" -m venv .venv
  else
    echo "using the virtual environment in .venv"
  fi
  PY="$PWD/.venv/bin/python"
  export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"  # the tests find its commands (moorline, ...)
fi
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

export PYTHONHASHSEED="${PYTHONHASHSEED:-random}"  # placement must never depend on hash()
if [ $# -eq 0 ]; then  # the whole suite (CI): the linters first, cheap, and a finding fails
  echo "ruff check ."
  "$PY" -m ruff check .
  echo "mypy moorline"
  "$PY" -m mypy moorline
fi
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
