"""A GGUF file's parsed header (metadata + tensor table), saved in the user cache so the next load skips the parse.

`gguf.GGUFReader` walks every metadata field element by element; for a tokenizer of ~49k tokens and ~49k merges
that is about 2 s of the default model's ~5 s load, paid again at every start. The index holds exactly what
`GGUFFile` uses from the reader: the metadata values (`ReaderField.contents()`) and, per tensor, its type, dims,
byte count and data offset, from which the tensor bytes are mapped again (`numpy.memmap`, as the reader does).

Key: the file's real path, size and mtime (ns), the `gguf` package version and this format's version; a file that
changes in place is a new key. Where: ``$TBJAX_GGUF_INDEX`` (a directory; ``0`` turns the index off), else
``$XDG_CACHE_HOME/tbjax/gguf-index``. A missing, stale or unreadable index is a miss, never an error: the file is
then parsed as usual and the index rewritten (atomically: a temporary file renamed into place).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import tempfile
from typing import NamedTuple

import numpy as np

_FORMAT = 1


class TensorEntry(NamedTuple):
    """One tensor of the table, with the same attribute names as `gguf.ReaderTensor` (those `GGUFFile` reads)."""
    name: str
    tensor_type: object          # gguf.GGMLQuantizationType
    shape: np.ndarray            # ggml order (innermost first), as the reader gives it
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray             # a read-only view of the file's bytes


def index_dir() -> str | None:
    env = os.environ.get("TBJAX_GGUF_INDEX", "").strip()
    if env == "0":
        return None
    if env:
        return env
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "tbjax", "gguf-index")


def _key(path: str) -> str | None:
    try:
        import gguf
        version = getattr(gguf, "__version__", None)
        if version is None:
            from importlib.metadata import version as _v
            version = _v("gguf")
        st = os.stat(path)
    except Exception:
        return None
    raw = f"{_FORMAT}|{version}|{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


def _data_view(mm: np.ndarray, t: dict) -> np.ndarray:
    start = t["data_offset"]
    nbytes = int(np.prod(t["data_shape"])) * np.dtype(t["data_dtype"]).itemsize
    return mm[start:start + nbytes].view(t["data_dtype"]).reshape(t["data_shape"])


def load(path: str) -> tuple[dict, list[TensorEntry]] | None:
    """(metadata, tensors) from the saved index, or None (no index, stale, unreadable, or indexing off)."""
    d, key = index_dir(), _key(path)
    if d is None or key is None:
        return None
    f = os.path.join(d, key + ".pkl")
    try:
        with open(f, "rb") as fh:
            saved = pickle.load(fh)
        if saved.get("format") != _FORMAT or saved.get("size") != os.path.getsize(path):
            return None
        import gguf
        mm = np.memmap(path, mode="r")
        tensors = []
        for t in saved["tensors"]:
            if t["data_offset"] + t["n_bytes"] > mm.shape[0]:
                return None
            tensors.append(TensorEntry(t["name"], gguf.GGMLQuantizationType(t["tensor_type"]),
                                       np.asarray(t["shape"], np.uint64), t["n_elements"], t["n_bytes"],
                                       t["data_offset"], _data_view(mm, t)))
        return saved["metadata"], tensors
    except Exception:
        return None


def save(path: str, metadata: dict, tensors) -> str | None:
    """Write the index for `path` (tensors: the reader's ReaderTensor list). Returns the file written, or None when
    indexing is off or the cache directory is not writable (the index is an optimisation, never required)."""
    d, key = index_dir(), _key(path)
    if d is None or key is None:
        return None
    table = [{"name": t.name, "tensor_type": int(t.tensor_type), "shape": [int(x) for x in t.shape],
              "n_elements": int(t.n_elements), "n_bytes": int(t.n_bytes), "data_offset": int(t.data_offset),
              "data_dtype": t.data.dtype.str, "data_shape": [int(x) for x in t.data.shape]} for t in tensors]
    blob = {"format": _FORMAT, "size": os.path.getsize(path), "metadata": metadata, "tensors": table}
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                pickle.dump(blob, fh, protocol=pickle.HIGHEST_PROTOCOL)
            final = os.path.join(d, key + ".pkl")
            os.replace(tmp, final)
            return final
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception:
        return None
