"""`miniapp serve`: an OpenAI-compatible HTTP API over the shared model host, on the
batching engine (run.py starts it, api.py is the HTTP layer, service.py talks to the engine)."""
