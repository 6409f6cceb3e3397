"""Watching a stage from outside: the live tensors it holds, a step's spans.  Nothing here is called by a stage."""
