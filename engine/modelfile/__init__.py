"""Model files: reading GGUF, checking what a file holds and its chat template, the bundled and
downloaded models."""
