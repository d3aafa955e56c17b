"""Everything above the engine works unchanged on a decode mesh: a tiny Qwen3-MoE checkpoint served over gRPC by an
engine on a dp=2 x ep=2 mesh (4 fake CPU devices; requests, KV pages, attention-weight shards and experts split)
streams the tokens that whole-sequence recompute gives, for several concurrent greedy requests, and frees every
page afterwards."""
import os

import jax.numpy as jnp
import pytest

from engine_helpers import byte_tokenizer, reference_greedy
from serving.client import Client
from serving.limits import Limits
from serving.model import ServedModel
from serving.server import ServerThread
from serving.testing import kv_pages_all_free, run_in_threads
from tbjax.llm import LLM
from tbjax.weights.hf_names_moe import load_hf

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "hf_moe", "qwen3_moe")


def test_grpc_on_a_mesh_engine_streams_recompute_tokens():
    spec, params, _ = load_hf(DATA, dtype=jnp.float32)
    spec = spec.replace(eos_token_ids=())
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], [7], [2, 7, 1, 8, 2, 8]]
    want = [reference_greedy(spec, params, p, 6) for p in prompts]
    llm = LLM.from_parts(spec, params, byte_tokenizer(), mesh="dp=2,ep=2", num_pages=32, page_size=4,
                         max_num_seqs=8, max_num_batched_tokens=32)
    assert llm.engine.num_ranks == 4
    st = ServerThread(ServedModel.from_llm(llm, name="qwen3-moe-tiny"), limits=Limits(), metrics_port=None).start()
    try:
        got = {}
        with Client(st.address, timeout=120) as c:
            def run(i):
                got[i] = [t for ch in c.generate_stream(token_ids=prompts[i], max_tokens=6, temperature=0.0,
                                                        ignore_eos=True) for t in ch.token_ids]
            run_in_threads(run, len(prompts), timeout_s=120)
        assert [got[i] for i in range(len(prompts))] == want
        free = st.server.engine_loop.call(kv_pages_all_free).result(60)
        assert free["all_free"] and len(free["ranks"]) == 4, free
    finally:
        st.stop()
