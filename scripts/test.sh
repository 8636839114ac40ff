#!/usr/bin/env bash
# The whole test suite: ruff, mypy --strict, and pytest on SQLite and PostgreSQL.
#
# PostgreSQL: POSTGRES_HOST/PORT/USER/PASSWORD/DBNAME name a server if set; otherwise a
# server answering on 127.0.0.1:5432 is used; otherwise the tests start a throwaway
# cluster from local PostgreSQL binaries, or fail saying what to install.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
unset SECONDBOX_DATABASE_URL
if [ -z "${POSTGRES_HOST:-}" ] && command -v pg_isready >/dev/null \
   && pg_isready -q -h 127.0.0.1 -p 5432 -U postgres; then
  export POSTGRES_HOST=127.0.0.1 POSTGRES_PORT=5432 POSTGRES_USER=postgres
  export POSTGRES_DBNAME=${POSTGRES_DBNAME:-postgres}
fi
echo "== ruff"
.venv/bin/ruff check .
.venv/bin/ruff format --check .
echo "== mypy --strict"
.venv/bin/mypy
echo "== pytest"
# one worker per core (PYTEST_WORKERS=0: in this process); the slowest tests listed
exec .venv/bin/pytest -n "${PYTEST_WORKERS:-auto}" --durations=20 "$@"
