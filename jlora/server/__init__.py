"""`jlora serve`: an OpenAI-compatible HTTP server over the engine (see app.py)."""
