"""Prefill/decode workers over real loopback gRPC with fp8 KV pools (tiny random model, CPU): the per-page scales
travel with the pages, so tokens decoded after the transfer equal the same engine config run colocated. Both data
planes: the same-host shared-memory region and bytes in the gRPC stream. Afterwards both workers have every page
free, no reservation or region open. Also float32 pools through shared memory against the recompute reference."""
import json

import grpc
import pytest

from engine_helpers import byte_tokenizer, reference_greedy, tiny_model
from serving.model import ServedModel
from serving.pd_worker import PD_SERVICE
from serving.server import ServerThread
from tbjax.engine import Engine, EngineConfig
from tbjax.sampling import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((5, 13, 30))]
N_OUT = 6
CFG = dict(num_pages=48, page_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_prefill_chunk=16)


def _engine(kv_dtype):
    spec, params = tiny_model()
    return Engine(spec, params, byte_tokenizer(), EngineConfig(kv_dtype=kv_dtype, **CFG))


def _served(engine):
    spec = engine.spec
    return ServedModel(name="tiny", arch=spec.arch, tokenizer=engine.tokenizer, vocab_size=spec.vocab_size,
                       max_context=engine.max_model_len, eos_token_ids=(), make_params=SamplingParams, engine=engine)


def _rpc(ch, name, kind):
    f = ch.unary_stream if kind == "stream" else ch.unary_unary
    return f(f"/{PD_SERVICE}/{name}", request_serializer=lambda b: b, response_deserializer=lambda b: b)


def _colocated(kv_dtype):
    eng = _engine(kv_dtype)
    params = SamplingParams.greedy(N_OUT, ignore_eos=True)
    out = {}
    for i, p in enumerate(PROMPTS):
        eng.add_request(i, p, params)
        while eng.has_unfinished():
            for o in eng.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[i] for i in range(len(PROMPTS))]


def _disaggregated(kv_dtype, shm_bytes):
    pre = ServerThread(_served(_engine(kv_dtype)), role="prefill", metrics_port=None, kv_chunk_pages=2,
                       kv_shm_bytes=shm_bytes).start()
    dec = ServerThread(_served(_engine(kv_dtype)), role="decode", metrics_port=None, kv_shm_bytes=shm_bytes).start()
    try:
        got, transfers = [], []
        params = dict(max_tokens=N_OUT, temperature=0.0, ignore_eos=True)
        with grpc.insecure_channel(pre.address) as pc, grpc.insecure_channel(dec.address) as dc:
            for i, p in enumerate(PROMPTS):
                msgs = [json.loads(m) for m in _rpc(pc, "Prefill", "stream")(json.dumps(
                    {"id": f"r{i}", "prompt_token_ids": p, "params": params, "decode": dec.address}).encode(),
                    timeout=120)]
                first, done = msgs[0]["first"], msgs[-1]["done"]
                transfers.append(done)
                toks = list(first["token_ids"])
                for m in _rpc(dc, "Decode", "stream")(json.dumps(
                        {"id": f"r{i}", "prompt_token_ids": p, "first_token": toks[0], "params": params}).encode(),
                        timeout=120):
                    toks += json.loads(m)["token_ids"]
                got.append(toks)
            stats = [json.loads(_rpc(c, "Stats", "unary")(b"{}", timeout=30)) for c in (pc, dc)]
    finally:
        pre.stop(1)
        dec.stop(1)
    for s in stats:
        assert s["pages_free"] == s["pages_usable"] and s["reservations"] == 0 and s["held"] == 0
    assert stats[1]["open_transfers"] == 0 and stats[1]["shm_regions"] == 0 and stats[1]["landed"] == 0
    return got, transfers


@pytest.mark.parametrize("shm_bytes", [0, 1 << 20], ids=["grpc-bytes", "shm"])
def test_fp8_disaggregated_equals_colocated(shm_bytes):
    want = _colocated("float8_e4m3fn")
    got, transfers = _disaggregated("float8_e4m3fn", shm_bytes)
    assert all(t["transferred"] and t["shm"] == bool(shm_bytes) for t in transfers)
    assert got == want


def test_fp8_without_scales_would_differ():
    """The check above can fail: the same fp8 pages with unit scales give other tokens (so scales matter)."""
    import numpy as np

    pre, dec = _engine("float8_e4m3fn"), _engine("float8_e4m3fn")
    params = SamplingParams.greedy(N_OUT, ignore_eos=True)
    p = PROMPTS[2]
    pre.add_request(0, p, params, prefill_only=True)
    first = []
    while pre.has_unfinished():
        for o in pre.step():
            first += o.new_token_ids
    kv = pre.export_kv(0)
    assert not all(np.allclose(s, 1.0) for s in kv.scales)
    dec.reserve_kv(0, kv.num_tokens)
    dec.write_kv_pages(0, kv.pages, [np.ones_like(s) for s in kv.scales])
    dec.add_prefilled_request(0, p, first[0], params)
    out = list(first)
    while dec.has_unfinished():
        for o in dec.step():
            out += o.new_token_ids
    assert out != _colocated("float8_e4m3fn")[2]


def test_float32_disaggregated_through_shm_equals_reference():
    spec, params = tiny_model()
    want = [reference_greedy(spec, params, p, N_OUT) for p in PROMPTS]
    got, transfers = _disaggregated("float32", 1 << 20)
    assert all(t["shm"] and t["wire_bytes"] == 0 for t in transfers)
    assert got == want
