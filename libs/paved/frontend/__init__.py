"""paved's OpenAI-compatible HTTP frontend over the engine protocol (paved.engine.protocol)."""
