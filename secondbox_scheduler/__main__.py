"""``python -m secondbox_scheduler``: the command line (the ``[cli]`` extra)."""

from secondbox_scheduler.infrastructure.command_line import main

if __name__ == "__main__":
    main()
