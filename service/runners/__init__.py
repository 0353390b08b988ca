"""Joined machines: join tokens, worker credentials, and the worker protocol's routes (issue 42)."""
