"""Tokens in and out of a model: the tokenizer, sampling settings, constraints and samplers,
the token streams a generation returns and their events."""
