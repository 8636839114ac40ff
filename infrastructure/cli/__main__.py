"""``python -m secondbox_scheduler.infrastructure.cli``: the command line, as the console script."""

from secondbox_scheduler.infrastructure.cli import main

if __name__ == "__main__":
    main()
