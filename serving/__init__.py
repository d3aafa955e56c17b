"""gRPC front end, router, prefill and decode workers, KV transfer, metrics, client, load tool.

The top layer: imports tbjax, never the other way round.
"""
