"""Named meshes, partition rules, DP attention-weight sharding with prefetch, expert parallelism, pipeline.

Imports only jax and numpy (the bottom layer of tbjax).

  mesh.py             make_mesh(dp, ep, tp, pp), DecodeLayout (which axes split requests / experts / attention
                      weights, gather mode, fp8 wire), fit checks that name the axis and the numbers
  rules.py            regex partition rules: parameter path -> PartitionSpec (decode_rules for the decode tree)
  packed.py           one uint8 buffer per layer for a set of weights (raw or fp8 with block scales) + unpack
  prefetch.py         gather_buffer (all_gather / ppermute ring) and prefetch_scan (gather layer l+1 during layer l)
  expert_parallel.py  dispatch/combine of routed tokens (gather or all_to_all), ragged_dot grouped SwiGLU, load counts
"""
