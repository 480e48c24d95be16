#!/usr/bin/env bash
# Installs everything the tests need on a fresh machine, then runs the whole suite.
# Used by newcomers (README) and by CI (.ci/run). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v mosquitto_pub >/dev/null 2>&1 || need_apt+=(mosquitto-clients)
{ command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; } || need_apt+=(mosquitto)
command -v java >/dev/null 2>&1 || need_apt+=(openjdk-17-jre-headless)
# cluster tests cut links between nodes with iptables (skipped where it cannot be used, e.g. not root)
{ command -v iptables >/dev/null 2>&1 || [ -x /usr/sbin/iptables ]; } || need_apt+=(iptables)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "installing with apt-get: ${need_apt[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
"$PY" -m pip install -q --disable-pip-version-check -e '.[test]'

export PYTHONHASHSEED="${PYTHONHASHSEED:-random}"  # placement must never depend on hash()
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
