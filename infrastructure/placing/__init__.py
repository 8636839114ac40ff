"""The schedule path's service side: the batcher (``batcher``), the batch that decides
and commits (``batch``) through a narrow port (``port``), and the runner locks
(``runner_locks``)."""
