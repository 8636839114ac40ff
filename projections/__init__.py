"""Read models rebuilt from the scheduler's events."""
