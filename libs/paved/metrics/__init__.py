"""The metrics proxy: one /metrics over vLLM's multiprocess files, upstream servers and itself."""
