"""The prefetch really overlaps: compile the decode-mesh forward for an 8-GPU (sm_90) target without a GPU and check,
in the optimized HLO of the layer loop body, that the next layer's attention-weight gather starts before the
current layer's attention compute (its score matmul) and is done after it; and that DP sharding costs at most two
layers of extra temporary memory while removing (1 - 1/N) of every layer's attention weights from the arguments.

CPU-compiled HLO has no async collectives, so this needs the CUDA 12 PJRT plugin (not a tbjax dependency):
    pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 jax-cuda12-pjrt==0.11.2
The plugin directory is $TBJAX_CUDA12_PLUGIN_DIR (default /tmp/cuda12plugin); the GPU test is skipped, saying so,
only when that directory has no plugin. The work happens in scripts/gpu_hlo_overlap.py (a subprocess, so that the
plugin never loads into the test process)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gpu_hlo_overlap as gho  # noqa: E402

PLUGIN = os.environ.get("TBJAX_CUDA12_PLUGIN_DIR", "/tmp/cuda12plugin")
HAVE_PLUGIN = os.path.isdir(os.path.join(PLUGIN, "jax_plugins", "xla_cuda12"))

SYNTH = """HloModule m

%body (p: (s32[], u8[2048])) -> (s32[], u8[2048]) {
  %a = u8[256]{0} parameter(0)
  %ags = ((u8[256]{0}), u8[2048]{0}) all-gather-start(%a), dimensions={0}
  %s = f32[4,6,6]{2,1,0} fusion(%q, %k), kind=kCustom, calls=%gemm_fusion_dot.1_computation
  %agd = u8[2048]{0} all-gather-done(%ags)
  %ags2 = ((u8[256]{0}), u8[2048]{0}) all-gather-start(%a), dimensions={0}
  %agd2 = u8[2048]{0} all-gather-done(%ags2)
  ROOT %t = (s32[], u8[2048]) tuple(%i, %agd)
}

ENTRY %main (x: u8[256]) -> u8[2048] {
  %w = (s32[], u8[2048]) while(%init), condition=%cond, body=%body
}
"""


def test_analyse_finds_overlap_and_its_absence():
    res = gho.analyse(SYNTH, shard_bytes=256, n_heads=4, t_local=6)["while_bodies"]
    assert [b["name"] for b in res] == ["body"]
    cols = res[0]["buffer_collectives"]
    assert [c["score_dots_between"] for c in cols] == [1, 0]       # first gather brackets the score dot, second not
    assert gho.analyse(SYNTH, shard_bytes=256, n_heads=4, t_local=7)["while_bodies"][0]["score_dots"] == 0


@pytest.fixture(scope="module")
def gpu_results():
    if not HAVE_PLUGIN:
        pytest.skip(f"jax-cuda12-plugin not found in {PLUGIN} (set TBJAX_CUDA12_PLUGIN_DIR; install with "
                    "pip install --no-deps --target /tmp/cuda12plugin jax-cuda12-plugin==0.11.2 "
                    "jax-cuda12-pjrt==0.11.2)")
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([PLUGIN, ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gpu_hlo_overlap.py"), "--variants",
                          "all_gather:gather,ppermute:gather,replicated:gather", "--layers", "5"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return {r["gather"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}


def _loop_body(r):
    bodies = [b for b in r["while_bodies"] if b["score_dots"]]
    assert len(bodies) == 1, r["while_bodies"]
    return bodies[0]


def test_all_gather_prefetch_brackets_attention_on_gpu(gpu_results):
    body = _loop_body(gpu_results["all_gather"])
    ag = [c for c in body["buffer_collectives"] if c["kind"] == "all-gather"]
    assert ag and all(c["start"] < c["done"] for c in ag), body
    assert any(c["score_dots_between"] >= 1 for c in ag), f"gather does not overlap attention: {body}"
    assert body["sync_buffer_all_gathers"] == 0


def test_ppermute_prefetch_brackets_attention_on_gpu(gpu_results):
    body = _loop_body(gpu_results["ppermute"])
    cp = [c for c in body["buffer_collectives"] if c["kind"] == "collective-permute"]
    assert any(c["score_dots_between"] >= 1 for c in cp), f"ring does not overlap attention: {body}"


def test_dp_sharding_memory_on_gpu(gpu_results):
    sh, rep = gpu_results["all_gather"], gpu_results["replicated"]
    n_layers = 5
    # arguments: every layer's packed buffer shrinks from a whole layer to one shard
    assert rep["argument_bytes"] - sh["argument_bytes"] == n_layers * (rep["layer_bytes"] - sh["shard_bytes"])
    assert sh["layer_bytes"] == 8 * sh["shard_bytes"]
    # peak temporaries of the step: at most two gathered layers more than with replicated weights
    assert sh["temp_bytes"] <= rep["temp_bytes"] + 2 * sh["layer_bytes"], (sh["temp_bytes"], rep["temp_bytes"])
