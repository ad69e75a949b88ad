"""`kvstrata serve`: an OpenAI-compatible HTTP server over the cached engine."""
