"""`hyspec serve` on the batched GPU graphs (hyspec.gpu.batch_loop.BatchRunner), run here
through the Triton interpreter (engine.batch_graphs = True) on a tiny checkpoint with a
tokenizer: concurrent requests on the graph path (one with a penalty, one with logprobs read
from its verify rows) and on the engine core (a draft above the decoder's k_max keeps a
request there: constrained, with logprobs) equal the offline Engine's outputs and its
teacher-forced log-probabilities, the metrics and the request log are
filled for graph-path requests, a full server answers 429, and clients that disconnect are
cancelled and free their lanes; a two-turn chat on the graph path resumes its second turn
from the first turn's lane state in the prefix store."""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import re
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("triton_interpreter")

from hyspec.engine import Engine  # noqa: E402
from hyspec.sampling import SamplingParams  # noqa: E402
from hyspec.server.app import ServerConfig, create_app  # noqa: E402
from hyspec.server.thread import ServerThread  # noqa: E402

MODEL = "tiny"


def metric(server, name, labels=""):
    body = httpx.get(server.url + "/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} ([0-9.e+-]+)$", body, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from hyspec.tiny import make_tiny

    # vocab_size >= 300: make_tiny writes a tokenizer.json
    return make_tiny("qwen3_5", tmp_path_factory.mktemp("serve_graphs"), seed=3, layers=4, hidden=32,
                     vocab_size=512, std=0.2)


def test_server_on_the_batched_graphs(checkpoint, caplog):
    eng = Engine.load(checkpoint)
    eng.batch_graphs = True
    ref = Engine.load(checkpoint)  # the engine core, offline
    app = create_app(eng, ServerConfig(served_model_name=MODEL, draft=1, max_batch=3, max_queue=0, warm_up=True))
    worker = app.state.hyspec.worker
    # the warm-up (on by default on a GPU; asked for here): greedy only, a sampled lane takes
    # ~20 s in the Triton interpreter (the GPU runs greedy and sampled)
    worker.warm_up_params = [None]
    n_store = len(eng.store)
    with ServerThread(app) as s:
        assert worker.graph_path and httpx.get(s.url + "/health").json()["batch_graphs"] is True
        t_end = time.monotonic() + 120
        while httpx.get(s.url + "/health").json()["warm_up"] is None and time.monotonic() < t_end:
            time.sleep(0.1)
        # it ran its rounds, left no lane taken and nothing in the prefix store; the requests
        # below (compared with the offline engine) get a fresh runner
        assert httpx.get(s.url + "/health").json()["warm_up"]["ok"] is True and worker.warm_rounds >= 1
        assert len(eng.store) == n_store and worker._runner is None
        assert not bool(worker._graph_dec.live.any())
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        # at once: greedy speculative with logprobs and seeded plain with a penalty and a logit
        # bias (streamed) on the graph path, and a constrained request with logprobs drafting 4 (> the graph
        # decoder's k_max 3) on the engine core
        regex = "[a-z_ ]{1,12}"
        cases = [dict(prompt="def add(a, b):", temperature=0.0, seed=0, draft=1, stream=False, logprobs=2),
                 dict(prompt="class Stack:", temperature=0.9, seed=7, draft=0, stream=True, presence_penalty=0.5,
                      logit_bias={"13": 2.5, "20": -100.0}),
                 dict(prompt="import os", temperature=0.9, seed=3, draft=4, stream=False, logprobs=1, regex=regex)]

        ids = {}  # prompt -> response id
        lps = {}  # prompt -> the response's logprobs

        def go(c):
            kw = dict(model=MODEL, prompt=c["prompt"], max_tokens=3, temperature=c["temperature"], seed=c["seed"],
                      presence_penalty=c.get("presence_penalty", 0.0), logprobs=c.get("logprobs"),
                      logit_bias=c.get("logit_bias"),
                      extra_body={"draft": c["draft"], "ignore_eos": True, "return_token_ids": True,
                                  **({"guided_regex": c["regex"]} if "regex" in c else {})})
            if c["stream"]:
                return "".join(ch.choices[0].text for ch in client.completions.create(**kw, stream=True)
                               if ch.choices)
            r = client.completions.create(**kw)
            ids[c["prompt"]] = r.id
            lps[c["prompt"]] = r.choices[0].logprobs
            return r.choices[0].token_ids

        before = metric(s, "hyspec_spec_drafts_total")
        with caplog.at_level(logging.INFO, logger="hyspec.server"), cf.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(go, cases))
        for c, g in zip(cases, got):
            params = SamplingParams(temperature=c["temperature"], seed=c["seed"],
                                    presence_penalty=c.get("presence_penalty", 0.0), logit_bias=c.get("logit_bias", ()))
            cons = ref.constraint("regex", c["regex"]) if "regex" in c else None
            want = ref.generate(c["prompt"], max_new_tokens=3, params=params, draft=c["draft"], ignore_eos=True,
                                constraint=cons).tokens
            assert g == (ref.tokenizer.decode(want, skip_special_tokens=True) if c["stream"] else want), c
            if c.get("logprobs"):  # each token's log-probability and top list: the reference's scoring
                prompt = ref.encode(c["prompt"])
                sc = ref.score(prompt + want, top_logprobs=c["logprobs"])
                got_lp = lps[c["prompt"]]
                assert got_lp.token_logprobs == pytest.approx(sc["logprobs"][len(prompt) - 1:], abs=1e-4), c
                assert len(got_lp.top_logprobs) == 3  # (a top dict may merge ids that print alike)
                assert all(1 <= len(t) <= c["logprobs"] + 1 for t in got_lp.top_logprobs)  # (+ the chosen one)
                for tok, lp, t in zip(got_lp.tokens, got_lp.token_logprobs, got_lp.top_logprobs):
                    assert t[tok] == lp, (tok, lp, t)
        assert worker._runner.round > 0 and worker._sched.rounds > 0  # both paths ran
        # the engine thread's time split moves with both paths (GET /metrics)
        for part in ("warm_up", "core", "graphs", "graph_prefill", "graph_rounds", "graph_store"):
            assert metric(s, "hyspec_engine_seconds", f'{{part="{part}"}}') > 0, part
        # the graph path's speculative request fills the metrics and its log line
        assert metric(s, "hyspec_spec_drafts_total") > before
        line = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith(ids[cases[0]["prompt"]])]
        assert len(line) == 1 and re.search(r" out=3 accept_len=[0-9.]+ latency=[0-9.]+s finish=length$", line[0])

        # three streams fill the server (max_batch 3, no queue; all three on the lanes, one
        # with logprobs): a fourth request gets 429 at once; the clients disconnect and their
        # sequences are cancelled, lanes freed
        body = {"model": MODEL, "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True, "draft": 0}
        streams = [httpx.stream("POST", s.url + "/v1/completions", timeout=60, json={**body, "prompt": p, **extra})
                   for p, extra in (("x = ", {}), ("y = ", {}), ("z = ", {"logprobs": 1}))]
        lines = [st.__enter__().iter_lines() for st in streams]  # kept: a dropped iterator closes its stream
        for it in lines:
            first = next(line for line in it if line.startswith("data:"))
            assert json.loads(first[5:])["choices"][0]["text"] is not None
        t_end = time.monotonic() + 30  # (the first token goes out just before its lane is taken)
        while len(worker._runner.active) < 3 and time.monotonic() < t_end:
            time.sleep(0.01)
        assert len(worker._runner.active) == 3
        t = time.perf_counter()
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "w", "max_tokens": 2})
        assert r.status_code == 429 and time.perf_counter() - t < 2.0
        for st in streams:
            st.__exit__(None, None, None)
        t_end = time.monotonic() + 30
        while metric(s, "hyspec_requests_running") and time.monotonic() < t_end:
            time.sleep(0.05)
        assert metric(s, "hyspec_requests_running") == 0
        assert metric(s, "hyspec_requests_total", '{finish_reason="cancelled"}') == 3
        assert not worker._runner.active and not worker._graph_dec.live.any()


def test_chat_turns_resume_from_the_prefix_store_on_the_graph_path(checkpoint):
    """A two-turn chat on the graph path (the plain template: turn 2's prompt is turn 1's
    prompt + the reply + a new message): turn 1's lane leaves its end state in the prefix
    store, turn 2's lane loads it and prefills only the pending token and the new message
    (usage.prompt_tokens_details.cached_tokens), and its output equals the offline Engine's
    for the whole prompt from scratch. Greedy and seeded sampling, with and without draft;
    no sequence runs on the engine core."""
    eng = Engine.load(checkpoint)
    eng.batch_graphs = True
    ref = Engine.load(checkpoint)
    app = create_app(eng, ServerConfig(served_model_name=MODEL, draft=1, max_batch=2, max_queue=4))
    worker = app.state.hyspec.worker
    cases = [(0, 0.0, "rejection"), (1, 0.0, "rejection"), (0, 0.9, "rejection"), (1, 0.9, "coupled")]
    with ServerThread(app) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        for i, (draft, temp, mode) in enumerate(cases):
            params = SamplingParams(temperature=temp, seed=11, mode=mode)
            kw = dict(model=MODEL, max_tokens=3, temperature=temp, seed=11,
                      extra_body={"draft": draft, "ignore_eos": True, "sampling_mode": mode, "return_token_ids": True})
            # a first message whose reply, decoded and re-encoded after it, keeps its token
            # boundaries (what makes a hit possible; the tiny model's replies are random bytes)
            for j in range(40):
                first = [{"role": "user", "content": f"def f{j}(a, b):"}]
                p1 = ref.encode(first[0]["content"])
                gen1 = ref.generate(p1, max_new_tokens=3, params=params, draft=draft, ignore_eos=True).tokens
                second = first + [{"role": "assistant", "content": ref.tokenizer.decode(gen1, skip_special_tokens=True)},
                                  {"role": "user", "content": "\n    return a"}]
                p2 = ref.encode("".join(m["content"] for m in second))
                if p2[: len(p1) + len(gen1)] == p1 + gen1 and not eng.store.extends(p1):
                    break
            else:
                pytest.fail("no first message keeps its reply's token boundaries")
            r1 = client.chat.completions.create(messages=first, **kw)
            assert r1.choices[0].token_ids == gen1 and r1.usage.prompt_tokens_details.cached_tokens == 0
            assert r1.choices[0].message.content == second[1]["content"]
            hits = eng.store.hits
            r2 = client.chat.completions.create(messages=second, **kw)
            assert eng.store.hits == hits + 1, (i, eng.store.stats())
            assert r2.usage.prompt_tokens_details.cached_tokens == len(p1) + len(gen1) - 1, i
            want = ref.generate(p2, max_new_tokens=3, params=params, draft=draft, ignore_eos=True).tokens
            assert r2.choices[0].token_ids == want, i
        assert worker._runner.states_kept == 2 * len(cases) and worker._sched.rounds == 0

