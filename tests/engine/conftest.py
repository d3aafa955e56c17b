"""Fixtures shared by the engine tests: the tiny random model (tests/engine_helpers.py) and, for a test module that
defines PROMPTS and N_OUT, the greedy whole-sequence-recompute reference of each prompt."""
import pytest

from engine_helpers import reference_greedy, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def expected(model, request):
    spec, params = model
    return [reference_greedy(spec, params, p, request.module.N_OUT) for p in request.module.PROMPTS]
