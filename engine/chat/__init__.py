"""Conversations and their generation: turns, the context they fill, stop sequences and the
events an interface reads."""
