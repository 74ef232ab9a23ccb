"""miniapp's inference engine: GGUF loading, the torch runtime, the llama.cpp runtime, sessions.

Nothing in here imports `miniapp.app`; interfaces consume the typed events from `events`.
"""
