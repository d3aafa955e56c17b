"""Engine API of prefill/decode disaggregation on a tiny random model: a prefill engine (prefill_only + export_kv)
hands KV to a second engine (reserve_kv + write_kv_pages + add_prefilled_request) that decodes on.

The reference is greedy decoding by whole-sequence recompute (tests/engine_helpers.py): prefill-engine first token
+ decode-engine tokens must equal it; fp8 pools (where recompute differs by quantization) must equal the same
engine run colocated. Page bookkeeping: pages of a prefill-only request are freed by export; a reservation that
never completes is freed by release/abort; both engines end with every page free.
"""
import jax
import numpy as np
import pytest

from engine_helpers import byte_tokenizer
from tbjax.engine import Engine, EngineConfig
from tbjax.engine.engine import KVReservationError
from tbjax.sampling import SamplingParams

RNG = np.random.default_rng(11)
PROMPTS = [[int(t) for t in RNG.integers(0, 256, n)] for n in (1, 4, 9, 23, 40)]
N_OUT = 8


def _engine(model, device=None, **kw):
    spec, params = model
    cfg = dict(num_pages=48, page_size=4, max_num_seqs=8, max_num_batched_tokens=64, max_prefill_chunk=16)
    cfg.update(kw)
    if device is None:
        return Engine(spec, params, byte_tokenizer(), EngineConfig(**cfg))
    with jax.default_device(device):
        return Engine(spec, jax.device_put(params, device), byte_tokenizer(), EngineConfig(**cfg))


def _drain(engine, outs=None):
    outs = {} if outs is None else outs
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        assert steps < 500
    return outs


def _all_free(engine):
    for free, usable in engine.scheduler.clear_prefix_caches():
        assert free == usable, (free, usable)


def _disaggregated(pre, dec, prompts, params, stacked=False):
    """Prefill everything on ``pre``, move the KV, decode on ``dec``; returns first token + decoded tokens.
    ``stacked``: export on the device in the transfer layout [X, L, G, 2K, H] (padding rows included) and write
    that layout, as a same-host transfer does."""
    for i, p in enumerate(prompts):
        pre.add_request(i, p, params, prefill_only=True)
    first = _drain(pre)
    assert all(len(first[i]) == 1 for i in range(len(prompts)))       # one token each, then held
    assert pre.scheduler.num_held == len(prompts)
    free_before = dec.scheduler.ranks[0].allocator.num_free
    for i, p in enumerate(prompts):
        kv = pre.export_kv(i, on_device=stacked)
        assert kv.first_token == first[i][0] and kv.prompt_token_ids == p
        assert kv.num_pages == -(-len(p) // pre.config.page_size)
        assert dec.scheduler.ranks[0].allocator.num_free == free_before    # nothing reserved before the transfer
        ids = dec.reserve_kv(i, kv.num_tokens)
        assert len(ids) == kv.num_pages
        h = max(1, kv.num_pages // 2)
        if stacked:
            pg, sc = kv.device_pages, kv.device_scales
            assert isinstance(pg, jax.Array) and pg.shape[0] >= kv.num_pages and pg.shape[0] & (pg.shape[0] - 1) == 0
            assert pg.shape[1] == len(pre.runner.caches) and (sc is None) == (not pre.kv_config.is_fp8)
            # first part: the whole padded array with num_pages (padding rows ignored); second part: host rows
            dec.write_kv_pages(i, pg, sc, num_pages=h)
            if h < kv.num_pages:
                hp, hs = kv.stacked(), kv.stacked_scales()
                dec.write_kv_pages(i, hp[h:], None if hs is None else hs[h:], first_page=h)
            dec.add_prefilled_request(i, p, kv.first_token, params)
            free_before = dec.scheduler.ranks[0].allocator.num_free
            continue
        # write in two parts, as chunks of a transfer arrive
        dec.write_kv_pages(i, [p_[:h] for p_ in kv.pages], None if kv.scales is None else [s[:h] for s in kv.scales])
        if h < kv.num_pages:
            dec.write_kv_pages(i, [p_[h:] for p_ in kv.pages],
                               None if kv.scales is None else [s[h:] for s in kv.scales], first_page=h)
        dec.add_prefilled_request(i, p, kv.first_token, params)
        free_before = dec.scheduler.ranks[0].allocator.num_free
    assert pre.scheduler.num_held == 0
    _all_free(pre)                                 # export freed every page of the prefill side
    rest = _drain(dec)
    _all_free(dec)
    return {i: first[i] + rest.get(i, []) for i in range(len(prompts))}


@pytest.mark.parametrize("kw", [dict(page_size=4), dict(page_size=16, enable_prefix_caching=False)])
def test_disaggregated_equals_reference(model, expected, kw):
    pre, dec = _engine(model, **kw), _engine(model, **kw)
    got = _disaggregated(pre, dec, PROMPTS, SamplingParams.greedy(N_OUT, ignore_eos=True))
    for i, want in enumerate(expected):
        assert got[i] == want, i


@pytest.mark.parametrize("stacked", [False, True])
def test_disaggregated_fp8_equals_colocated_fp8(model, stacked):
    params = SamplingParams.greedy(N_OUT, ignore_eos=True)
    colo = _engine(model, kv_dtype="float8_e4m3fn")
    for i, p in enumerate(PROMPTS):
        colo.add_request(i, p, params)
    want = _drain(colo)
    got = _disaggregated(_engine(model, kv_dtype="float8_e4m3fn"), _engine(model, kv_dtype="float8_e4m3fn"),
                         PROMPTS, params, stacked=stacked)
    assert got == want


def test_stacked_export_equals_reference(model, expected):
    pre, dec = _engine(model), _engine(model)
    got = _disaggregated(pre, dec, PROMPTS, SamplingParams.greedy(N_OUT, ignore_eos=True), stacked=True)
    for i, want in enumerate(expected):
        assert got[i] == want, i


def test_separate_device_sets(model, expected):
    """Prefill engine on the first half of the devices, decode engine on the second half: same output."""
    devs = jax.devices()
    assert len(devs) >= 2
    half = len(devs) // 2
    pre, dec = _engine(model, device=devs[0]), _engine(model, device=devs[half])
    got = _disaggregated(pre, dec, PROMPTS[:3], SamplingParams.greedy(N_OUT, ignore_eos=True))
    for i in range(3):
        assert got[i] == expected[i], i
    assert pre.runner.caches[0][0].devices() == {devs[0]}
    assert dec.runner.caches[0][0].devices() == {devs[half]}
    assert set(devs[:half]).isdisjoint({devs[half]})


def test_reservations_are_freed_and_checked(model):
    dec = _engine(model, num_pages=9, page_size=4, max_num_seqs=3, max_num_batched_tokens=16)   # 8 usable pages
    ids = dec.reserve_kv("a", 17)          # 5 pages
    assert len(ids) == 5 and 0 not in ids and dec.scheduler.ranks[0].allocator.num_free == 3
    with pytest.raises(KVReservationError, match="pages wanted"):
        dec.reserve_kv("b", 13)            # 4 pages > 3 free
    with pytest.raises(KVReservationError, match="already exists"):
        dec.reserve_kv("a", 4)
    with pytest.raises(ValueError, match="n_tokens"):
        dec.reserve_kv("c", 0)
    dec.scheduler.check()
    with pytest.raises(KVReservationError, match="no open KV reservation"):
        dec.write_kv_pages("zzz", [np.zeros((1, 4, 4, 16), np.float32)] * 2)
    with pytest.raises(ValueError, match="do not fit"):
        dec.write_kv_pages("a", [np.zeros((6, 4, 4, 16), np.float32)] * 2)
    with pytest.raises(ValueError, match="shape"):
        dec.write_kv_pages("a", [np.zeros((2, 4, 4, 8), np.float32)] * 2)
    with pytest.raises(KVReservationError, match="fills"):      # 5 pages reserved, a 3-token prompt fills 1
        dec.add_prefilled_request("a", [1, 2, 3], 5, SamplingParams.greedy(4))
    assert dec.release_reservation("a") and not dec.release_reservation("a")
    dec.reserve_kv("d", 8)
    assert dec.abort("d")                  # abort frees a reservation too
    _all_free(dec)
    for k in range(3):
        dec.reserve_kv(k, 1)
    with pytest.raises(KVReservationError, match="slots"):
        dec.reserve_kv("x", 1)
    for k in range(3):
        dec.release_reservation(k)
    _all_free(dec)


def test_prefill_only_pages_held_until_export_or_abort(model):
    pre = _engine(model)
    params = SamplingParams.greedy(N_OUT, ignore_eos=True)
    pre.add_request("a", PROMPTS[3], params, prefill_only=True)
    pre.add_request("b", PROMPTS[4], params, prefill_only=True)
    with pytest.raises(KeyError, match="still running"):
        pre.export_kv("a")
    outs = _drain(pre)
    assert len(outs["a"]) == 1 and not pre.has_unfinished()
    used = pre.scheduler.ranks[0].allocator.num_used
    assert used >= -(-len(PROMPTS[3]) // 4) + -(-len(PROMPTS[4]) // 4)
    with pytest.raises(ValueError, match="already in use"):
        pre.add_request("a", [1, 2], params)
    pre.export_kv("a")
    with pytest.raises(KeyError, match="already exported"):
        pre.export_kv("a")
    assert pre.abort("b")                  # a held request is freed by abort
    _all_free(pre)
    pre.add_request("c", PROMPTS[2], params, prefill_only=True)
    pre.step()
    assert pre.abort("c")                  # aborted while running: freed, never held
    assert pre.scheduler.num_held == 0
    _all_free(pre)


def test_first_token_that_ends_the_request(model, expected):
    """If the prefill side's token already finishes the request (a stop token here), the decode engine reports it
    finished on its next step and frees the reservation."""
    dec = _engine(model)
    p = PROMPTS[2]
    first = expected[2][0]
    dec.reserve_kv("s", len(p))
    dec.add_prefilled_request("s", p, first, SamplingParams.greedy(N_OUT, stop_token_ids=[first]))
    assert dec.has_unfinished()
    outs = dec.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in outs] == [("s", True, "stop", [])]
    assert not dec.has_unfinished()
    _all_free(dec)
