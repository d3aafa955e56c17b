"""Shared by the benchmark scripts: compile time read directly from JAX's own duration events."""
import jax

_EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
           "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
           "/jax/core/compile/backend_compile_duration": "backend"}


def compile_timer() -> dict:
    """A dict {trace, lower, backend} of seconds that JAX keeps adding to as it compiles (or loads from cache)."""
    acc = {"trace": 0.0, "lower": 0.0, "backend": 0.0}

    def _listen(event, duration, **_):
        if event in _EVENTS:
            acc[_EVENTS[event]] += duration
    jax.monitoring.register_event_duration_secs_listener(_listen)
    return acc
