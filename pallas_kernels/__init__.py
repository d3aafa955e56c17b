"""Kernels: each with a pure-jnp reference that defines it, Mosaic GPU and Mosaic TPU versions, and a dispatcher.

Imports only jax and numpy (the bottom layer of tbjax).
"""
