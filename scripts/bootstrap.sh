#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extra into it.
# Sourced by the other scripts; safe to run again.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "secondbox-scheduler needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
