"""updates."""
