"""OpenAI-compatible HTTP server over the AsyncEngine: protocol models, app, metrics."""
