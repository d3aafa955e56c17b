"""Models assembled from a ModelSpec: layer kinds, parameter trees, the forward pass."""
from tbjax.model.params import init_params, param_shapes
from tbjax.model.transformer import forward_dense, forward_hidden, layer_plan, lm_logits

__all__ = ["init_params", "param_shapes", "forward_dense", "forward_hidden", "layer_plan", "lm_logits"]
