"""Stop strings are applied above the engine (tbjax.tokenizer.StopStrings), for HTTP, gRPC and tbjax.LLM alike: text
that may start a stop string is held back, so a stream never shows text that the stop string then takes back, and a
stop string spanning two steps (or two tokens of one chunk) cuts the text exactly once; only the tokens up to the one
that completed it are kept. (The engine's own stop strings re-send text in that case; see StopStrings' docstring.)"""
import pytest
from openai import OpenAI

from serving.client import Client
from serving.fake_engine import FakeEngine, FakeTokenizer, fake_served_model, reference
from serving.server import ServerThread
from tbjax.tokenizer import StopStrings


def _chars(ids):
    return "".join(chr(i) for i in ids)


def _ids(text):
    return [ord(c) for c in text]


def test_stop_strings_hold_back_and_cut_once():
    s = StopStrings(["#0"], _chars)
    assert s.feed(_ids("ab#"), "ab#") == (_ids("ab#"), "ab", False)        # '#' may start '#0': held back
    assert s.feed(_ids("0x"), "0x") == (_ids("0"), "", True)                # found: cut, the token after it dropped
    assert s.feed(_ids("y"), "y") == ([], "", True)
    s = StopStrings(["#0"], _chars)
    assert s.feed(_ids("ab#"), "ab#")[1] == "ab" and s.feed(_ids("1"), "1") == (_ids("1"), "#1", False)  # released
    s = StopStrings(["ab"], _chars)
    assert s.feed(_ids("a"), "a")[1] == "" and s.feed(_ids("c"), "c", final=True)[1] == "ac"
    s = StopStrings(["\n\n", "END"], _chars)                                   # the earliest stop wins
    assert s.feed(_ids("xEN"), "xEN")[1] == "x"
    assert s.feed(_ids("D\n\n"), "D\n\n") == (_ids("D"), "", True)
    s = StopStrings(["lo w"], _chars)
    assert s.feed(_ids("hello world"), "hello world") == (_ids("hello w"), "hel", True)   # one chunk, many tokens
    s = StopStrings([], _chars)
    assert s.feed([1, 2], "ab") == ([1, 2], "ab", False)


class _LLMFake(FakeEngine):
    def __init__(self, spec, params, tokenizer, config):
        super().__init__(step_time_s=0.0)


def test_llm_generate_applies_stop_strings_above_the_engine(monkeypatch):
    import tbjax.llm
    from tbjax.sampling import SamplingParams
    monkeypatch.setattr(tbjax.llm, "Engine", _LLMFake)
    tok = FakeTokenizer()
    llm = tbjax.llm.LLM.from_parts(None, None, tok)
    ids = [70, 71]
    want_ids = reference(ids, 60, ignore_eos=True)[0]
    want = tok.decode(want_ids)
    for stop in (want[20:22], want[5:12], want[30]):
        c = llm.generate(ids, SamplingParams.greedy(60, stop=[stop], ignore_eos=True))[0]
        cut = want.index(stop)
        assert c.text == want[:cut] and c.finish_reason == "stop"
        assert c.token_ids == want_ids[:cut + len(stop)]        # up to the token that completed the stop string
    assert llm.engine.scheduler.stats()["num_running"] == 0       # stopped requests were aborted in the engine


@pytest.fixture(scope="module")
def served():
    st = ServerThread(fake_served_model(step_time_s=0.002), metrics_port=None, http_port=0).start()
    with Client(st.address, timeout=30) as c:
        yield st, OpenAI(base_url=st.server.http_url + "/v1", api_key="-", max_retries=0), c
    st.stop()


def test_streams_never_show_text_a_stop_string_takes_back(served):
    st, oa, c = served
    tok = st.server.model.tokenizer
    want = tok.decode(reference([70, 71], 80, ignore_eos=True)[0])
    for stop in (want[20:22], want[40:47], [want[60:63], "\x01nope"]):
        stops = stop if isinstance(stop, list) else [stop]
        cut = min(want.index(s) for s in stops if s in want)
        chunks = list(oa.completions.create(model="fake", prompt=[70, 71], max_tokens=80, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
        texts = [ch.choices[0].text for ch in chunks]
        assert "".join(texts) == want[:cut] and chunks[-1].choices[0].finish_reason == "stop"
        g = list(c.generate_stream(token_ids=[70, 71], max_tokens=80, temperature=0, stop=stops, ignore_eos=True))
        assert "".join(ch.text for ch in g) == want[:cut] and g[-1].finish_reason == "stop"
        assert tok.decode([t for ch in g for t in ch.token_ids]).startswith(want[:cut])
        chat = oa.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], max_tokens=80,
                                          temperature=0, stop=stop, extra_body={"ignore_eos": True})
        full = tok.decode(reference(tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}])), 80,
                                    ignore_eos=True)[0])
        hits = [full.index(s) for s in stops if s in full]
        assert chat.choices[0].message.content == (full[:min(hits)] if hits else full)
