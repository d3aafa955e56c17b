"""Prefill/decode disaggregation end to end on CPU with a real model over real gRPC on loopback: three processes
(`python -m tbjax.serve --role prefill|decode|router`). The model is the default model's first 4 layers (its own
weights as the GGUF holds them, tokenizer and layer kind: `tbjax.weights.convert(layers=4)`), so that five server
processes and the references compile small programs; the comparisons do not depend on the depth. Streamed greedy output through the router equals
colocated `tbjax.LLM` output (token ids and text), and both workers end with every KV page free. Fault: the prefill
process is killed mid-transfer (a test hook makes it hang after one KV chunk): the client gets UNAVAILABLE, the decode
worker frees its reservation within the KV timeout, and its allocator is full again."""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest

from serving.client import Client
from serving.pd_worker import PD_SERVICE, SENDER_FACTORY_ENV
from serving.testing import STALL_PREFIX_ENV

import tbjax
from tbjax.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE = ["--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--num-pages", "256"]   # as the e2e test
LAYERS = 4
PROMPTS = ["The capital of France is", "Once upon a time, in a small village, there lived an old man who"]
N_TOK = 8
KV_TIMEOUT = 4.0
# > 1 page of 16 tokens, so a transfer with 1 page per chunk is cut after its first chunk
LONG = "In the beginning of the long winter the villagers gathered wood, stored grain, mended their roofs and " \
       "told each other stories by the fire until the snow came down."


def _start(role, *args, env=None):
    err = tempfile.TemporaryFile("w+")
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--role", role, "--port", "0", "--metrics-port", "-1",
                          *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True,
                         env={**os.environ, **(env or {})})
    p.err = err
    return p


@contextlib.contextmanager
def _served(role, *args):
    """A `tbjax.serve` process for the block's duration (its address); it must exit cleanly on SIGTERM."""
    p = _start(role, *args)
    try:
        yield _address(p)
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            assert p.wait(60) == 0
        finally:
            if p.poll() is None:
                p.kill()


def _address(p):
    line = p.stdout.readline()
    m = re.search(r"on (\S+:\d+) \(gRPC tbjax.v1\)", line)
    if not m:
        p.kill()
        p.err.seek(0)
        raise AssertionError(f"no listen line: {line!r} {p.err.read()[-3000:]}")
    return m.group(1)


def _stats(target):
    with grpc.insecure_channel(target) as ch:
        rpc = ch.unary_unary(f"/{PD_SERVICE}/Stats", request_serializer=lambda b: b, response_deserializer=lambda b: b)
        return json.loads(rpc(b"{}", timeout=30))


@pytest.fixture(scope="module")
def small_model(tmp_path_factory):
    from tbjax.weights import convert
    return convert(None, str(tmp_path_factory.mktemp("pd") / f"smollm2-{LAYERS}-layers"), progress=False,
                   layers=LAYERS)


@pytest.fixture(scope="module")
def cluster(small_model):
    engine = [*ENGINE, "--model", small_model]
    pre = _start("prefill", *engine, "--kv-chunk-pages", "1",
                 env={SENDER_FACTORY_ENV: "serving.testing:stalling_sender", STALL_PREFIX_ENV: "stall-"})
    dec = _start("decode", *engine, "--kv-timeout", str(KV_TIMEOUT))
    procs = [pre, dec]
    try:
        p_addr, d_addr = _address(pre), _address(dec)
        router = _start("router", "--prefill-workers", p_addr, "--decode-workers", d_addr, "--worker-timeout", "120")
        procs.append(router)
        # the colocated reference, computed here while the workers load
        llm = tbjax.LLM(small_model, progress=False, max_num_seqs=8, max_num_batched_tokens=256, num_pages=256)
        # one prompt at a time, as they are sent: bf16 near-ties may flip with the batch's composition
        ref = [llm.generate([p], [SamplingParams.greedy(N_TOK)])[0] for p in PROMPTS]
        r_addr = _address(router)
        with Client(r_addr, timeout=300) as c:
            yield dict(pre=pre, dec=dec, router=router, p_addr=p_addr, d_addr=d_addr, client=c, ref=ref, llm=llm,
                       engine=engine)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(30)


def _all_free(target):
    s = _stats(target)
    return s["pages_free"] == s["pages_usable"] and s["reservations"] == 0 and s["held"] == 0 and not s["unfinished"]


def test_disaggregated_stream_equals_colocated(cluster):
    c, ref = cluster["client"], cluster["ref"]
    got = [list(c.generate_stream(p, max_tokens=N_TOK, temperature=0)) for p in PROMPTS]   # one at a time
    for i, want in enumerate(ref):
        chunks = got[i]
        assert [t for ch in chunks for t in ch.token_ids] == want.token_ids, i
        assert "".join(ch.text for ch in chunks) == want.text, i
        assert chunks[-1].finish_reason == want.finish_reason
        assert len(chunks) >= 2                                  # first token from prefill, the rest streamed
    assert _all_free(cluster["p_addr"]) and _all_free(cluster["d_addr"])


def test_killed_prefill_mid_transfer_frees_the_reservation(cluster):
    c, d_addr = cluster["client"], cluster["d_addr"]
    err = {}

    def run():
        try:
            list(c.generate_stream(LONG, max_tokens=N_TOK, temperature=0, request_id="stall-1"))
        except grpc.RpcError as e:
            err["e"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.time() + 120
    while time.time() < deadline:                 # wait until the decode side holds the reservation
        s = _stats(d_addr)
        if s["open_transfers"] == 1:
            break
        time.sleep(0.05)
    assert s["open_transfers"] == 1 and s["reservations"] == 1 and s["pages_free"] < s["pages_usable"], s
    cluster["pre"].send_signal(signal.SIGKILL)
    t_kill = time.time()
    t.join(60)
    assert "e" in err and err["e"].code() == grpc.StatusCode.UNAVAILABLE, err
    while time.time() - t_kill < KV_TIMEOUT + 2 and not _all_free(d_addr):
        time.sleep(0.05)
    freed_after = time.time() - t_kill
    s = _stats(d_addr)
    assert s["pages_free"] == s["pages_usable"] and s["reservations"] == 0 and s["open_transfers"] == 0, s
    assert freed_after <= KV_TIMEOUT + 2


def test_split_role_serves_prefill_and_decode_on_disjoint_devices_in_one_process(cluster):
    """`--role split`: router + prefill worker + decode worker in one process, engines on devices 0 and N/2."""
    with _served("split", *cluster["engine"]) as addr, Client(addr, timeout=300) as c:
        for prompt, want in zip(PROMPTS, cluster["ref"]):
            chunks = list(c.generate_stream(prompt, max_tokens=N_TOK, temperature=0))
            assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
            assert "".join(ch.text for ch in chunks) == want.text


def _pipeline_reference(llm, prompt):
    """In-process: a 2-stage PipelinePrefillEngine prefills, the colocated LLM's engine decodes from its KV (bf16:
    the pipeline's attention rounds differently from the engine's prefill, so near-ties may differ from colocated)."""
    import jax
    from tbjax.prefill_pipeline import PipelinePrefillEngine
    pre = PipelinePrefillEngine(llm.spec, llm.params, llm.tokenizer, jax.devices()[:2], page_size=16,
                                chunk_tokens=256, max_model_len=llm.engine.max_model_len)
    ids = llm.tokenizer.encode(prompt)
    sp = SamplingParams.greedy(N_TOK)
    pre.add_request("r", ids, sp, prefill_only=True)
    first = pre.step()[0].new_token_ids[0]
    kv = pre.export_kv("r", on_device=True)
    dec = llm.engine
    dec.reserve_kv("r", kv.num_tokens)
    dec.write_kv_pages("r", kv.device_pages, kv.device_scales, num_pages=kv.num_pages)
    dec.add_prefilled_request("r", ids, first, sp)
    out = [first]
    while dec.has_unfinished():
        for o in dec.step():
            out += o.new_token_ids
    return out


def test_split_role_with_a_pipeline_parallel_prefill(cluster):
    """`--role split --pp 2`: the prefill worker is a 2-stage pipeline (devices 0-1, layers split by FLOPs), the
    decode engine on device 2. The stream equals the same pipeline + decode engine driven in-process, and its first
    token equals colocated (the pipeline's numerics are checked against recompute, and its warm-up,
    in test_prefill_pipeline.py; here no --warmup: the test needs two of its programs, not all)."""
    refs = [_pipeline_reference(cluster["llm"], prompt) for prompt in PROMPTS]
    with _served("split", *cluster["engine"], "--pp", "2", "--no-warmup") as addr, Client(addr, timeout=300) as c:
        for prompt, want, colo in zip(PROMPTS, refs, cluster["ref"]):
            chunks = list(c.generate_stream(prompt, max_tokens=N_TOK, temperature=0))
            got = [t for ch in chunks for t in ch.token_ids]
            assert got == want and len(got) == N_TOK
            assert got[0] == colo.token_ids[0]
