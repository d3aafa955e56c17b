"""examples/quickstart.ipynb runs top to bottom (nbclient), so the documented API never rots."""
import json
import os
import sys

import nbformat
from nbclient import NotebookClient

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_quickstart_notebook_executes(tmp_path, monkeypatch):
    # a kernelspec that runs this interpreter (the test venv), found through JUPYTER_PATH
    spec_dir = tmp_path / "jupyter" / "kernels" / "tbjax-test"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "tbjax test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("TBJAX_COMPILE_CACHE", os.path.abspath(os.path.join(ROOT, ".jax_cache")))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    nb = nbformat.read(os.path.join(ROOT, "examples", "quickstart.ipynb"), as_version=4)
    client = NotebookClient(nb, timeout=900, startup_timeout=120, kernel_name="tbjax-test",
                            resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "Paris" in text          # the greedy continuation of "The capital of France is"
