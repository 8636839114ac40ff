"""What the group-commit batchers share: the leader/follower queue (``leader_queue``)."""
