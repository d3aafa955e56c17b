"""Running the GPU-HLO scripts (scripts/gpu_hlo_decode.py, scripts/gpu_hlo_overlap.py) from tests: they compile
tbjax programs for an sm_90 GPU without a GPU, through the CUDA 12 PJRT plugin (not a tbjax dependency):
    pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
The plugin directory is $TBJAX_CUDA12_PLUGIN_DIR (default /tmp/cuda12plugin); a test that needs it is skipped, saying
so, when that directory has no plugin. The scripts run in a subprocess, so the plugin never loads into the test
process."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.environ.get("TBJAX_CUDA12_PLUGIN_DIR", "/tmp/cuda12plugin")
HAVE_PLUGIN = os.path.isdir(os.path.join(PLUGIN, "jax_plugins", "xla_cuda12"))


def run_gpu_hlo_script(script: str, *args: str, timeout: float = 600):
    """``python scripts/<script> *args`` on CPU with the plugin on its path: the JSON on its last stdout line. Skips
    the calling test without the plugin; fails it, with the script's stderr, when the script fails."""
    if not HAVE_PLUGIN:
        pytest.skip(f"jax-cuda12-plugin not found in {PLUGIN} (set TBJAX_CUDA12_PLUGIN_DIR; install with "
                    "pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 "
                    "jax-cuda12-pjrt==0.11.2)")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([PLUGIN, ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *args],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
