"""platforms."""
