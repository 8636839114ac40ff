#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its test extra into it, only
# when the project's dependencies changed: a stamp in .venv holds the hash of
# pyproject.toml (and the Python version) of the last install. The install is editable,
# so a change of the code needs none. Sourced by the other scripts; safe to run again.
# SECONDBOX_REINSTALL=1 installs whatever the stamp says.
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
stamp=.venv/.secondbox-installed
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1) $(.venv/bin/python -V 2>&1)"
if [ "${SECONDBOX_REINSTALL:-}" != 1 ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$wanted" ] \
   && [ -x .venv/bin/secondbox-scheduler ]; then
  exit 0
fi
rm -f "$stamp"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]" \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
echo "$wanted" > "$stamp"
