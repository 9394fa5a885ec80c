"""`paved`: the platform's command line (`paved keys ...`, `paved tenants ...`).

The CLI is a client only: it talks HTTP to a running gateway's admin API and imports none of
the gateway's code, so it runs anywhere with the package and network reach to the gateway.
"""
