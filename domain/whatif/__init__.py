"""What-if replay: a recorded history's demand replayed in memory under changes."""
