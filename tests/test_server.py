"""The OpenAI-compatible server, through the official `openai` client and raw HTTP, on the real target."""

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdecode.drafters.base import Drafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine.continuous import ContinuousEngine, EngineConfig
from specdecode.engine.decode import SpeculativeDecoder
from specdecode.errors import SpecDecodeError
from specdecode.evaluation.serving_bench import VllmServer, percentile, run_level_apart, summarize
from specdecode.sampling import SamplingParams
from specdecode.serving.app import BackgroundServer, create_app
from specdecode.serving.protocol import SUPPORTED, ApiError, parse_request
from specdecode.serving.schema import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
)

MODEL = "smollm2-135m"
MAX_BATCH, MAX_LEN = 3, 256


@pytest.fixture(scope="module")
def server(smollm2):
    engine = ContinuousEngine(
        smollm2, NgramDrafter(), EngineConfig(max_batch=MAX_BATCH, max_len=MAX_LEN, draft_length=4)
    )
    with BackgroundServer(create_app(engine, MODEL)) as running:
        running.engine = engine
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _raw(server, method: str, path: str, body: str | None = None) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def _normal_greedy_text(target, prompt_ids: list[int], max_tokens: int) -> str:
    return (
        SpeculativeDecoder(target, Drafter()).generate(prompt_ids, SamplingParams(), max_new_tokens=max_tokens)[0].text
    )


def test_completions_and_chat_non_streaming(client, smollm2, server):
    prompt = "The three primary colors are red, blue and"
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, seed=1)
    choice = response.choices[0]
    assert response.usage.prompt_tokens == len(smollm2.tokenizer.encode(prompt))
    assert response.usage.completion_tokens == 16 or choice.finish_reason == "stop"
    spec = response.model_extra["spec_decode"]
    assert spec["drafter"] == "ngram" and spec["choices"][0]["rounds"] == len(spec["choices"][0]["accepted_lengths"])
    assert sum(spec["choices"][0]["accepted_lengths"]) >= response.usage.completion_tokens
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=12, temperature=0, n=2
    )
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens > 0
    assert choice.text == _normal_greedy_text(smollm2, smollm2.tokenizer.encode(prompt), 16)


def test_streaming_chat_and_completions(client):
    messages = [{"role": "user", "content": "Count from one to five."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].model_extra["spec_decode"]["new_tokens"] == full.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens and not chunks[-1].choices
    completion_chunks = list(
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, stream=True)
    )
    assert completion_chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_concurrent_clients_get_their_own_results(client):
    prompts = ["The sun is", "Python is a", "My favourite food is", "Water boils at", "The cat sat on"]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=10, temperature=0).choices[0].text for p in prompts
    ]
    together: dict[int, str] = {}

    def ask(i: int) -> None:
        together[i] = (
            client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0).choices[0].text
        )

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [together[i] for i in range(len(prompts))] == alone


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ("{not json", 400, None),
        (json.dumps([1, 2]), 400, None),
        (json.dumps({"model": "gpt-4", "prompt": "hi"}), 404, "model"),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi " * (MAX_LEN + 10)}), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": MAX_LEN}), 400, "max_tokens"),
        (json.dumps({"model": MODEL, "prompt": "hi", "logprobs": 2}), 400, "logprobs"),
        (json.dumps({"model": MODEL, "prompt": "hi", "temperature": -1}), 400, "temperature"),
        (json.dumps({"model": MODEL, "prompt": "hi", "top_p": 0}), 400, "top_p"),
        (json.dumps({"model": MODEL, "prompt": "hi", "n": 0}), 400, "n"),
        (json.dumps({"model": MODEL, "prompt": "hi", "stop": 5}), 400, "stop"),
        (json.dumps({"model": MODEL, "prompt": ""}), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": ["hi", ""]}), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": ["hi"] * 65}), 400, "prompt"),
        (json.dumps({"model": MODEL, "prompt": "hi", "echo": True}), 400, "echo"),
        (json.dumps({"model": MODEL, "prompt": "hi", "best_of": 2}), 400, "best_of"),
        (json.dumps({"model": MODEL, "prompt": "hi", "presence_penalty": False}), 400, "presence_penalty"),
        (json.dumps({"model": MODEL, "prompt": "hi", "top_k": -2}), 400, "top_k"),
    ],
)
def test_bad_completion_requests_get_openai_errors(server, body, status, param):
    code, text = _raw(server, "POST", "/v1/completions", body)
    error = json.loads(text)["error"]
    assert code == status and error["param"] == param and error["message"]


def test_bad_chat_requests_and_routes(server, client):
    code, text = _raw(server, "POST", "/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "x"}]}))
    assert code == 400 and json.loads(text)["error"]["param"] == "messages"
    code, text = _raw(server, "GET", "/v1/nothing")
    assert code == 404 and "error" in json.loads(text)
    with pytest.raises(openai.BadRequestError, match="'tools' is supported only at its neutral value"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
    assert client.completions.create(model=MODEL, prompt="Still", max_tokens=2).usage.completion_tokens >= 1
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert _raw(server, "GET", "/health")[0] == 200


def test_a_list_of_prompts_gets_n_choices_each(client, smollm2):
    """OpenAI's and vLLM's batch of prompts: choice p * n + j answers prompt p (at T = 0 each as normal decoding
    answers it alone), and usage counts every prompt's tokens once."""
    prompts = ["The sun is", "Water boils at"]
    ids = [smollm2.tokenizer.encode(p) for p in prompts]
    response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2, temperature=0)
    alone = [_normal_greedy_text(smollm2, p, 6) for p in ids]
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == [alone[0]] * 2 + [alone[1]] * 2
    assert response.usage.prompt_tokens == sum(len(p) for p in ids)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in sorted(as_ids.choices, key=lambda c: c.index)] == alone


def test_what_client_libraries_send_by_default_is_served(client):
    """Parameters the server does not implement pass at their neutral values (several client libraries send
    `presence_penalty: 0` and the like by default) and are refused at any other; a content of text parts is read
    as its texts joined by newlines, a developer message as a system message; top_k is honored (top-1 sampling is
    greedy decoding, whatever the seed)."""

    def chat(messages: list[dict], **extra) -> str:
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, **extra)
        return response.choices[0].message.content

    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour.\nOne word."}]
    greedy = chat(plain, temperature=0)
    neutral = dict(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False, tools=[])
    assert chat(plain, temperature=0, response_format={"type": "text"}, tool_choice="none", **neutral) == greedy
    system, user = ([{"type": "text", "text": line} for line in m["content"].split("\n")] for m in plain)
    parts = [{"role": "developer", "content": system}, {"role": "user", "content": user}]
    assert chat(parts, temperature=0) == greedy
    assert chat(plain, temperature=1, seed=7, extra_body={"top_k": 1}) == greedy  # as vLLM's clients send it
    with pytest.raises(openai.BadRequestError, match="frequency_penalty") as refused:
        chat(plain, frequency_penalty=0.5)
    assert refused.value.body["param"] == "frequency_penalty"
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for message in ({"role": "user", "content": [image]}, {"role": ["user"], "content": "hi"}):
        with pytest.raises(openai.BadRequestError, match="text parts") as refused:
            chat([message])
        assert refused.value.body["param"] == "messages"


def test_metrics_parse_as_prometheus_text(server, client):
    """prometheus_client's own parser reads /metrics; the speculative-decoding counters use vLLM's names."""
    client.completions.create(model=MODEL, prompt="Metrics", max_tokens=4)
    code, text = _raw(server, "GET", "/metrics")
    assert code == 200
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    names = {name for name, _ in samples}
    for name in (
        "specdecode:mean_accepted_length",
        "specdecode:num_requests_waiting",
        "specdecode:generation_tokens_total",
        "specdecode:prefix_cache_hits_total",
        "specdecode:spec_decode_num_drafts_total",
        "specdecode:spec_decode_num_draft_tokens_total",
        "specdecode:spec_decode_num_accepted_tokens_total",
        "specdecode:time_to_first_token_seconds_count",
        "specdecode:inter_token_latency_seconds_count",
        "specdecode:verify_batch_requests_count",
    ):
        assert name in names, name
    assert samples[("specdecode:requests_total", (("status", "finished"),))] >= 1
    assert samples[("specdecode:mean_accepted_length", ())] >= 1
    per_position = sum(
        v for (n, _), v in samples.items() if n == "specdecode:spec_decode_num_accepted_tokens_per_pos_total"
    )
    assert per_position == samples[("specdecode:spec_decode_num_accepted_tokens_total", ())]
    buckets = [v for (n, _), v in samples.items() if n == "specdecode:verify_batch_tokens_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == samples[("specdecode:verify_batch_tokens_count", ())]


def test_client_disconnect_mid_stream_frees_the_slot(server):
    engine = server.engine
    before = dict(engine.metrics.requests)
    body = json.dumps({"model": MODEL, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 200, "stream": True, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")
    conn.sock.close()  # the client goes away mid-stream
    conn.close()
    deadline = time.monotonic() + 60
    while not (engine.idle and engine.batched.free_slots == MAX_BATCH):
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.05)
    after = engine.metrics.requests
    assert (after["cancelled"], after["finished"]) == (before["cancelled"] + 1, before["finished"]), after


def test_sigterm_drains_running_requests():
    """`specdecode serve` in a subprocess: SIGTERM with 4 streams in flight lets all 4 finish, then the process
    exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "specdecode.cli",
        "serve",
        "--target",
        MODEL,
        "--drafter",
        "none",
        "--max-batch",
        "4",
        "--max-len",
        "128",
        "--port",
        "0",
    ]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = None
        for line in process.stderr:
            found = re.search(r"running on http://127\.0\.0\.1:(\d+)", line, re.IGNORECASE)
            if found:
                port = int(found.group(1))
                break
        assert port, "the server did not report its port"
        responses = []
        for i in range(4):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
            body = {"model": MODEL, "prompt": f"Count to {i + 5}:", "max_tokens": 24, "stream": True, "temperature": 0}
            conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
            responses.append(conn.getresponse())
        for response in responses:
            assert response.readline().startswith(b"data: ")  # every request is running
        process.send_signal(signal.SIGTERM)
        for response in responses:
            rest = response.read().decode()
            assert rest.rstrip().endswith("data: [DONE]")
            finals = [json.loads(x[6:]) for x in rest.splitlines() if x.startswith("data: {")]
            assert finals[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.stderr.close()


def test_load_summary_percentiles():
    assert percentile([], 50) is None and percentile([1.0, 3.0], 50) == 2.0 and percentile([5.0], 99) == 5.0
    from specdecode.evaluation.serving_bench import RequestTiming

    timings = [RequestTiming(start=0.0, end=1.0, chunks=[0.2, 0.5, 1.0], tokens=5, mean_accepted_length=1.5)]
    level = summarize(timings, wall_s=1.0, clients=1)
    assert level["output_tokens_per_s"] == 5.0 and level["ttft_ms_p50"] == 200.0 and level["itl_ms_p50"] == 400.0
    assert level["tpot_ms_mean"] == 200.0 and level["mean_accepted_length"] == 1.5


def test_serving_plot_is_written(tmp_path):
    from specdecode.evaluation.serving_bench import plot_serving

    level = {"output_tokens_per_s": 10.0, "tpot_ms_mean": 50.0}
    runs = [{"configuration": c, "concurrency": n, **level} for c in ("none", "dspark-prefix") for n in (1, 4)]
    plot_serving(runs, tmp_path / "serving.png")
    assert (tmp_path / "serving.png").read_bytes()[:4] == b"\x89PNG"


def test_serving_medians_take_each_sweeps_own_ratio():
    """Repeated sweeps fold into one row per configuration and level: numbers that moved are medians (x normal
    the median of each sweep's ratio, not a ratio of medians), numbers that did not move keep their type."""
    from specdecode.evaluation.serving_bench import median_rows

    sweeps = [(100.0, 90.0, 0.9), (50.0, 60.0, 1.2), (80.0, 100.0, 1.25)]  # normal, drafter tok/s; its ratio
    runs = []
    for i, (normal, drafted, ratio) in enumerate(sweeps):
        level = {"concurrency": 4, "repeat": i, "requests": 12}
        runs.append({"configuration": "none", **level, "output_tokens_per_s": normal, "relative_to_normal": 1.0})
        runs.append({"configuration": "dspark", **level, "output_tokens_per_s": drafted, "relative_to_normal": ratio})
    rows = {r["configuration"]: r for r in median_rows(runs)}
    assert rows["dspark"]["output_tokens_per_s"] == 90.0 and rows["dspark"]["relative_to_normal"] == 1.2
    assert rows["none"]["output_tokens_per_s"] == 80.0 and rows["none"]["relative_to_normal"] == 1.0
    assert rows["dspark"]["sweeps"] == 3 and rows["dspark"]["requests"] == 12 and "repeat" not in rows["dspark"]
    # one sweep of two levels at the same number of clients (other prompts): two sweeps of that load
    levels = [dict(run, repeat=0, level=run["repeat"]) for run in runs[:4]]
    rows = {r["configuration"]: r for r in median_rows(levels)}
    assert rows["dspark"]["sweeps"] == 2 and rows["dspark"]["relative_to_normal"] == 1.05
    assert "level" not in rows["dspark"]


def test_openapi_documents_both_endpoints_and_responses_match_it(server):
    """/openapi.json (what /docs renders) has both completion endpoints with their request schemas; the models
    name exactly the parameters the validator accepts, and real responses validate against them."""
    code, text = _raw(server, "GET", "/openapi.json")
    assert code == 200
    document = json.loads(text)
    schemas = document["components"]["schemas"]
    for path, request, kind in (
        ("/v1/completions", CompletionRequest, "completions"),
        ("/v1/chat/completions", ChatCompletionRequest, "chat"),
    ):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{request.__name__}"}
        assert set(schemas[request.__name__]["properties"]) == SUPPORTED[kind]
    assert _raw(server, "GET", "/docs")[0] == 200
    body = json.dumps({"model": MODEL, "prompt": "Hello", "max_tokens": 4, "n": 2})
    CompletionResponse.model_validate_json(_raw(server, "POST", "/v1/completions", body)[1])
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    ChatCompletionResponse.model_validate_json(_raw(server, "POST", "/v1/chat/completions", body)[1])


def test_a_vllm_server_that_cannot_start_says_why(tmp_path):
    """The serving bench's vLLM peer: a server that exits at start-up is reported with its own last words
    (here: this venv has no vLLM), not only its command line. It serves in the dtype it is given (the bench
    passes the target's, so both servers compute in the same precision)."""
    server = VllmServer(sys.executable, str(tmp_path), "m", 1024, "none", dtype="bfloat16")
    assert server.command[server.command.index("--dtype") + 1] == "bfloat16"
    with pytest.raises(SpecDecodeError, match="No module named 'vllm'"):
        server.start()


def test_serving_levels_send_fresh_prompts_or_their_drafters_forget():
    """Each level sends the next prompts in file order; a level that wraps around to prompts an earlier level sent
    is flagged, and the bench then clears the drafters' index of earlier answers (else suffix decoding copies them:
    accepted lengths of 8-10 at T = 0)."""
    from specdecode.evaluation.serving_bench import level_prompt_ids

    plans = [level_prompt_ids(k, 24, 80) for k in range(4)]
    assert [ids[0] for ids, _ in plans] == [0, 24, 48, 72] and plans[3][0][8:] == list(range(16))
    assert [repeats for _, repeats in plans] == [False, False, False, True]
    sent = [set(ids) for ids, _ in plans]
    for k, (_, repeats) in enumerate(plans):
        assert repeats == any(sent[k] & sent[j] for j in range(k))
    assert not level_prompt_ids(3, 20, 80)[1] and level_prompt_ids(4, 20, 80)[1]


def test_served_model_names_are_answered_and_listed(smollm2):
    """`--served-model-name`: requests naming an alias (the HF id a client was set up with) are served, /v1/models
    lists every name, and an unknown one is a 404 that names them all."""
    from fastapi.testclient import TestClient

    alias = "HuggingFaceTB/SmolLM2-135M-Instruct"
    names = (MODEL, alias)
    body = {"model": alias, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert parse_request(body, True, smollm2, names, MAX_LEN).max_tokens == 2
    with pytest.raises(ApiError, match=f"serves '{MODEL}', '{alias}'") as unknown:
        parse_request({**body, "model": "gpt-4"}, True, smollm2, names, MAX_LEN)
    assert unknown.value.status == 404
    engine = ContinuousEngine(smollm2, Drafter(), EngineConfig(max_batch=1, max_len=MAX_LEN, draft_length=0))
    listed = TestClient(create_app(engine, MODEL, (alias,))).get("/v1/models").json()  # no lifespan: no engine loop
    assert [m["id"] for m in listed["data"]] == [MODEL, alias]


def test_the_bench_load_runs_in_a_process_of_its_own(server):
    """The serving bench's clients run apart from the server's process (in it they shared its GIL): a level comes
    back with its requests and the other processes' cores, and a load that cannot reach the server is one error."""
    level = run_level_apart(server.url, MODEL, ["Say hi.", "Count to three."], 2, 3, 4, 60)
    assert level["requests"] == 3 and level["new_tokens"] >= 3 and level["foreign_load_cores"] >= 0
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        nobody = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(SpecDecodeError, match="load generator failed"):
        run_level_apart(nobody, MODEL, ["Hi"], 1, 1, 4, 60)
