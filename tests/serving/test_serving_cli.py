"""`python -m tbjax.serve` as a user runs it (a subprocess, here with --fake-engine so no model loads):
loopback by default, prints where it listens, serves, and on SIGTERM drains (the running request
completes) then exits 0. `python -m serving.client` streams a completion from it."""
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

from serving.client import Client
from serving.fake_engine import FakeTokenizer, reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _start(*args):
    p = subprocess.Popen([sys.executable, "-m", "tbjax.serve", "--fake-engine", "--port", "0", "--metrics-port", "0",
                          *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    m = re.search(r"on (\S+):(\d+) \(gRPC tbjax.v1\), metrics on http://(\S+):(\d+)/metrics", line)
    if not m:
        p.kill()
        raise AssertionError(f"no listen line: {line!r} {p.stderr.read()}")
    return p, m


@pytest.mark.parametrize("extra", [[], ["--engine-process"]])
def test_serve_cli_loopback_stream_and_graceful_sigterm(extra):
    p, m = _start("--fake-step-time", "0.005", *extra)
    try:
        assert m.group(1) == "127.0.0.1" and m.group(3) == "127.0.0.1"   # loopback unless told otherwise
        target = f"127.0.0.1:{m.group(2)}"
        # the client CLI streams a completion
        r = subprocess.run([sys.executable, "-m", "serving.client", "--target", target, "Hello", "--max-tokens", "12",
                            "--temperature", "0", "--tokens"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        want = reference(FakeTokenizer().encode("Hello"), 12)[0]
        assert r.stdout.splitlines()[-1] == str(want)
        assert r.stdout.startswith(FakeTokenizer().decode(want))
        assert "finish_reason=" in r.stderr
        # SIGTERM while a request runs: it completes, then the process exits 0
        with Client(target, timeout=60) as c:
            stream = c.generate_stream(token_ids=[20, 21], max_tokens=300, ignore_eos=True, temperature=0)
            chunks = [next(stream)]
            p.send_signal(signal.SIGTERM)     # 300 steps of 5 ms: still running
            chunks += list(stream)
        assert len(chunks) >= 2 and chunks[0].finish_reason is None   # it was running when the signal came
        ids = [t for ch in chunks for t in ch.token_ids]
        assert ids == reference([20, 21], 300, ignore_eos=True)[0] and chunks[-1].finish_reason == "length"
        assert p.wait(timeout=60) == 0
        err = p.stderr.read()
        assert "draining" in err and "stopped" in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_cli_second_signal_stops_at_once():
    p, m = _start("--drain-timeout", "60", "--fake-step-time", "0.02")
    try:
        target = f"127.0.0.1:{m.group(2)}"
        with Client(target, timeout=60) as c:
            stream = c.generate_stream(token_ids=[20], max_tokens=500, ignore_eos=True)
            next(stream)
            done = threading.Event()
            errors = []

            def drain():
                try:
                    list(stream)
                except Exception as e:  # noqa: BLE001 - the forced stop cancels the stream
                    errors.append(e)
                done.set()
            t = threading.Thread(target=drain)
            t.start()
            p.send_signal(signal.SIGINT)
            assert not done.wait(0.5)          # draining: the request still runs (500 steps of 20 ms)
            p.send_signal(signal.SIGINT)
            assert p.wait(timeout=30) == 0
            t.join(30)
            assert done.is_set() and errors    # cut short
        assert "again: stopping now" in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_serve_cli_rejects_bad_limits():
    r = subprocess.run([sys.executable, "-m", "tbjax.serve", "--fake-engine", "--max-concurrent-requests", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "max_concurrent_requests" in r.stderr


@pytest.mark.parametrize("args,msg", [(["--role", "colocated", "--pp", "2"], "--pp"),
                                      (["--role", "prefill", "--pp", "0"], "--pp"),
                                      (["--role", "prefill", "--pp", "2", "--fake-engine"], "--fake-engine"),
                                      (["--role", "prefill", "--engine-process"], "--engine-process")])
def test_serve_cli_rejects_bad_pp(args, msg):
    from serving.cli import main
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2


def test_serve_cli_pp_beyond_the_devices_or_layers_is_a_clear_exit():
    from serving.cli import build_parser, load_served_model
    a = build_parser().parse_args(["--role", "prefill", "--pp", "9", "--model", "synthetic"])
    with pytest.raises(SystemExit, match="needs 9 devices"):
        load_served_model(a)


def test_serve_cli_engine_flags_reach_the_engine_config():
    """--no-overlap-scheduling ends up in the served engine's EngineConfig (default: the engine decides)."""
    from serving.cli import build_parser, load_served_model
    from tbjax.engine import EngineConfig
    assert EngineConfig().overlap_scheduling is None and build_parser().parse_args([]).overlap_scheduling is None
    assert build_parser().parse_args(["--overlap-scheduling"]).overlap_scheduling is True
    m = load_served_model(build_parser().parse_args(["--model", "synthetic", "--num-pages", "8", "--max-num-seqs", "2",
                                                     "--max-num-batched-tokens", "16", "--no-overlap-scheduling"]))
    assert m.engine.config.overlap_scheduling is False and m.engine.overlap is False


def test_engine_process_model_reads_only_spec_and_tokenizer(smollm_f32):
    """--engine-process: this process builds the ServedModel from the model's spec and tokenizer alone (no weights,
    no engine) and hands the child a picklable factory; the metadata equals the fully loaded model's."""
    import pickle

    from serving.cli import build_parser, engine_process_model
    spec, _, tok = smollm_f32
    model, factory = engine_process_model(build_parser().parse_args(["--engine-process", "--max-model-len", "1024"]))
    assert model.engine is None and model.name == "SmolLM2-135M-Instruct"
    assert (model.vocab_size, model.max_context, model.eos_token_ids) == (spec.vocab_size, 1024,
                                                                            tuple(tok.eos_token_ids))
    text = "Hello, world! The capital of France is"
    assert model.tokenizer.encode(text) == tok.encode(text) and model.tokenizer.chat_template == tok.chat_template
    assert pickle.loads(pickle.dumps(factory)).args[1]["max_model_len"] == 1024


def test_serve_cli_mesh_builds_a_mesh_engine_and_bad_meshes_are_one_line():
    """--mesh dp=2 (plus layout flags) reaches the engine: two dp ranks, each with its own KV pool shard; a mesh the
    machine cannot hold or an unknown axis is refused with exit code 2 and a message naming it."""
    from serving.cli import build_parser, load_served_model, main
    a = build_parser().parse_args(["--model", "synthetic", "--num-pages", "8", "--max-num-seqs", "2",
                                   "--max-num-batched-tokens", "16", "--mesh", "dp=2", "--attn-gather", "ppermute"])
    m = load_served_model(a)
    eng = m.engine
    assert eng.num_ranks == 2 and len(eng.scheduler.ranks) == 2
    assert eng.runner.layout.attn_gather == "ppermute" and eng.runner.plan.packed
    pool = eng.runner.caches[0][0]
    assert len(pool.sharding.device_set) == 2 and pool.shape[0] == 2 * 8
    assert main(["--model", "synthetic", "--mesh", "dp=16", "--port", "0", "--metrics-port", "-1"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["--model", "synthetic", "--mesh", "xp=2"])
    assert e.value.code == 2
