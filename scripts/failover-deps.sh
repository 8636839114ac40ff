#!/usr/bin/env bash
# What `secondbox-scheduler verify --profile failover` needs beyond the project: a local
# etcd (Debian's etcd-server, installed with apt-get when missing and when run as root)
# and Patroni, installed with pip into a venv of its own, .venv-failover (Patroni's
# dependencies stay out of the project's environment; the run finds it there or on
# PATH, or through SECONDBOX_PATRONI). Safe to run again: each step only when missing.
# `verify --profile failover --promote manual` needs neither (PostgreSQL binaries only).
# Prints where each one is.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# Patroni runs as the postgres user (PostgreSQL refuses root): its venv's Python must be
# one that user may run (the system's, not one under root's home)
python=${PATRONI_PYTHON:-/usr/bin/python3}
[ -x "$python" ] || python=python3
if ! command -v etcd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq etcd-server >/dev/null
  else
    echo "etcd is missing: install Debian's etcd-server (apt-get install etcd-server)" >&2
    exit 1
  fi
fi
if [ ! -x .venv-failover/bin/patroni ] || ! .venv-failover/bin/patroni --version >/dev/null 2>&1 \
   || { [ "$(id -u)" = 0 ] && ! runuser -u postgres -- .venv-failover/bin/patroni --version \
        >/dev/null 2>&1; }; then
  rm -rf .venv-failover
  "$python" -m venv .venv-failover
  .venv-failover/bin/python -m pip install --quiet --disable-pip-version-check \
    "patroni[etcd3,psycopg3]>=4,<5"
fi
echo "etcd    $(command -v etcd)"
echo "patroni $(pwd)/.venv-failover/bin/patroni"
