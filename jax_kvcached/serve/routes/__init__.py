"""The server's routes, one module per concern; each exposes ``routes(ctx)``."""
