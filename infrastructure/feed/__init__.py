"""The scheduler's events for those who follow them: the event feed and the lists.

- :mod:`.subjects`: which sandbox, runner and pool each event concerns (the feed's
  filters), for every event class of the catalogue;
- :mod:`.reading`: pages of the notification log in order, filtered, with the cursor
  to continue from, and :func:`~.reading.follow`, an iterator that follows the log
  live (SQLite and PostgreSQL);
- :mod:`.wire`: an event as JSON (``GET /v1/events``, ``secondbox-scheduler events``);
- :mod:`.lists`: sandboxes, assignments and runners a page at a time, keyset-paginated
  on the log position of each item's creation.

docs/api.md ("Event feed", "Lists") documents them; ``secondbox_scheduler.events`` is
the embedders' import.
"""
