"""paved: a paved-path LLM serving platform. The logic of every service lives here."""

__version__ = "0.1.0"
