#!/usr/bin/env bash
# The main job: installs into .venv if needed, then runs `secondbox-scheduler simulate`
# on the embedded default store (./secondbox.db). Extra arguments go to simulate,
# e.g. scripts/simulate.sh --seed 3 --json
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/bootstrap.sh
exec .venv/bin/secondbox-scheduler simulate "$@"
