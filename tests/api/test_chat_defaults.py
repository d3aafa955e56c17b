"""The default model (SmolLM2-135M-Instruct, float32) chatting at its default sampling settings (its card's temperature
0.2 / top_p 0.9, what `python -m tbjax.serve` and tbjax.LLM() use) answers simple factual questions correctly over
several seeds, as it does at temperature 0: the defaults do not make the small model ramble. Through the HTTP API,
n = 3 choices (seeds s, s + 1, s + 2) per question. (Questions whose first token is a near tie for this model, e.g.
"What is the capital of France?" where 'L' has 36% at these settings and leads to French rambling, are left out.)"""
import pytest
from openai import OpenAI

from serving.model import ServedModel
from serving.server import ServerThread
from tbjax.weights import load_generation_defaults

QUESTIONS = [("How many days are there in a week?", ("7", "seven")), ("What is the capital of Japan?", ("tokyo",)),
             ("What is the capital of Germany?", ("berlin",)), ("What is the largest ocean on Earth?", ("pacific",)),
             ("What is the capital of the United Kingdom?", ("london",)),
             ("What is the boiling point of water in Celsius?", ("100",))]


@pytest.fixture(scope="module")
def oa(smollm_llm):
    model = ServedModel.from_llm(smollm_llm)
    defaults = load_generation_defaults(None)
    assert defaults.sampling() == {"temperature": 0.2, "top_p": 0.9}
    model.make_params, model.generation_defaults = defaults.make_params, defaults
    with ServerThread(model, metrics_port=None, http_port=0) as st:
        yield OpenAI(base_url=st.server.http_url + "/v1", api_key="-", max_retries=0, timeout=600)


def test_factual_answers_at_the_default_settings_over_seeds(oa):
    import concurrent.futures

    def ask(q, **kw):
        return oa.chat.completions.create(model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": q}],
                                          max_tokens=16, **kw)
    with concurrent.futures.ThreadPoolExecutor(len(QUESTIONS) * 2) as ex:     # one engine batch
        greedy = [ex.submit(ask, q, temperature=0) for q, _ in QUESTIONS]
        sampled = [ex.submit(ask, q, n=3, seed=11) for q, _ in QUESTIONS]   # no temperature / top_p: the defaults
        greedy, sampled = [f.result() for f in greedy], [f.result() for f in sampled]
    for (q, words), g, s in zip(QUESTIONS, greedy, sampled):
        answers = [g.choices[0].message.content] + [c.message.content for c in s.choices]
        assert len(answers) == 4
        for a in answers:
            assert any(w in a.lower() for w in words), (q, answers)
