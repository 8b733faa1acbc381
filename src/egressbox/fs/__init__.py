"""Host files opened from held directories, never by a path a child could redirect."""
