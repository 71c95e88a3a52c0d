"""`pagedkv serve`: the OpenAI-compatible HTTP server, one more client of the daemon and runner."""
