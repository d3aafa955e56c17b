"""Named meshes, partition rules, DP attention-weight sharding with prefetch, expert parallelism, pipeline.

Imports only jax and numpy (the bottom layer of tbjax).
"""
