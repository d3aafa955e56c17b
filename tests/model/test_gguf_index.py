"""The saved GGUF index (tbjax/weights/gguf_index.py): a second open of an unchanged file reads the index instead
of parsing, and gives exactly what `gguf.GGUFReader` gives; a changed, corrupt or disabled index is never used."""
import os
import shutil

import gguf
import numpy as np
import pytest

from tbjax.default_model import default_model_path
from tbjax.weights import WeightLoadError, gguf_index
from tbjax.weights.gguf_file import GGUFFile


@pytest.fixture
def index_dir(tmp_path, monkeypatch):
    d = tmp_path / "index"
    monkeypatch.setenv("TBJAX_GGUF_INDEX", str(d))
    return d


@pytest.fixture(scope="module")
def reference():
    """The gguf package's own reading of the default model (the reference)."""
    r = gguf.GGUFReader(default_model_path())
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    return meta, {t.name: t for t in r.tensors}


def _assert_same_as_reader(g, reference):
    meta, tensors = reference
    got = g.metadata()
    assert got.pop("_tbjax.tied_embeddings") == ("output.weight" not in tensors)
    assert got.keys() == meta.keys()
    for k in meta:
        assert got[k] == meta[k], k
    assert g.tensors.keys() == tensors.keys()
    for name, t in tensors.items():
        x = g.tensors[name]
        assert x.tensor_type == t.tensor_type and [int(v) for v in x.shape] == [int(v) for v in t.shape], name
        assert x.n_bytes == t.n_bytes and x.data_offset == t.data_offset, name
        assert x.data.dtype == t.data.dtype and x.data.shape == t.data.shape, name
        assert np.array_equal(x.data, t.data), name


def test_second_open_reads_the_index_and_equals_the_reader(index_dir, reference, monkeypatch):
    first = GGUFFile(default_model_path())
    saved = list(index_dir.iterdir())
    assert len(saved) == 1 and saved[0].suffix == ".pkl"
    _assert_same_as_reader(first, reference)

    def no_parse(*a, **k):
        raise AssertionError("parsed although the index is saved")
    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    second = GGUFFile(default_model_path())
    _assert_same_as_reader(second, reference)
    assert second.spec() == first.spec()


def test_changed_file_is_a_new_key(index_dir, tmp_path):
    p = tmp_path / "m.gguf"
    shutil.copy(default_model_path(), p)
    GGUFFile(p)
    os.utime(p, ns=(1, 1))
    GGUFFile(p)
    assert len(list(index_dir.iterdir())) == 2
    # truncated in place: the stale index is not used, the parse reports the damage
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="truncated or corrupt"):
        GGUFFile(p)


def test_corrupt_index_is_a_miss(index_dir, reference):
    GGUFFile(default_model_path())
    (f,) = index_dir.iterdir()
    f.write_bytes(b"not a pickle")
    g = GGUFFile(default_model_path())            # parses again, rewrites the index
    _assert_same_as_reader(g, reference)
    assert f.read_bytes() != b"not a pickle"


def test_index_off_and_unwritable(tmp_path, monkeypatch, reference):
    monkeypatch.setenv("TBJAX_GGUF_INDEX", "0")
    assert gguf_index.index_dir() is None
    _assert_same_as_reader(GGUFFile(default_model_path()), reference)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("TBJAX_GGUF_INDEX", str(blocker / "sub"))   # cannot be created: no error, no index
    _assert_same_as_reader(GGUFFile(default_model_path()), reference)
