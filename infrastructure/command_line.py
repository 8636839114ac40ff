"""The console script ``secondbox-scheduler``: the command line, once its extra is there.

``pip install secondbox-scheduler`` installs the library and this script; the command
line itself needs the ``[cli]`` extra (typer, rich). Without it the script says so in one
line and exits with the usage code, 2, instead of a traceback (docs/spec.md (section
8.4)). This module imports nothing optional before it has checked.
"""

from __future__ import annotations

import sys

from secondbox_scheduler.infrastructure.exit_codes import EXIT_USAGE
from secondbox_scheduler.infrastructure.extras import MissingExtraError, missing_module


def main() -> None:
    """``secondbox-scheduler``: :func:`secondbox_scheduler.infrastructure.cli.main`."""
    module = missing_module("cli")
    if module is not None:
        error = MissingExtraError("cli", module, "the secondbox-scheduler command line")
        sys.stderr.write(f"error: {error}\n")
        sys.exit(EXIT_USAGE)
    from secondbox_scheduler.infrastructure.cli import main as run

    run()


if __name__ == "__main__":
    main()
