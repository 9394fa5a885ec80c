"""Engines: what the frontends serve requests with."""
