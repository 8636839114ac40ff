"""``create_sandbox``: concurrent creations of one process decided and committed
together (:mod:`.batcher`, :mod:`.batch`)."""
