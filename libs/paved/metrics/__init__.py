"""Metrics: the proxy (one /metrics over vLLM's multiprocess files, upstream servers and itself)
and the load gauges read from a replica's /metrics (paved.metrics.gauges)."""
