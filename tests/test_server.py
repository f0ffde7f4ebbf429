"""``ensemble serve``: a real server process on 127.0.0.1, driven by real clients.

Protocol, errors, load and overhead run against tiny random-weight members
(``tiny:ALIAS`` members start in seconds; their text is gibberish but greedy decoding is
deterministic); the framework clients (``openai``, LangChain ``ChatOpenAI``, LlamaIndex
``OpenAILike``) also run against the bundled real pair (``real`` mark).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from server_utils import ServerProcess, percentile, sse_events

from ensemble_core import Ensemble
from ensemble_core.server.cli import TINY_OPTIONS, add_serve_parser, cmd_serve
from ensemble_core.server.cli import main as serve_main
from ensemble_core.testing import tiny_member

KEY = "sk-test-ensemble"
TINY = ["tiny:smollm2-135m-instruct", "tiny:gemma3-270m"]
TINY_NAME = "safe(tiny-smollm2-135m-instruct-0+tiny-gemma3-270m-0)"
ALIAS = "tiny-ensemble"
MAX_BODY = 64 * 1024
MAX_TOKENS = 16
LOAD_TOKENS = 10
HELLO = [{"role": "user", "content": "Say hello."}]
PROMPTS = ["Say hello.", "Name a color.", "What is 2 + 2?", "Tell me about dogs.", "Write a haiku.",
           "Why is the sky blue?", "List three fruits.", "Translate 'cat' into French."]


def build_direct() -> Ensemble:
    """The served ensemble, built in this process (same weights: tiny members are seeded)."""
    return Ensemble([tiny_member(a.split(":")[1], 0, **TINY_OPTIONS) for a in TINY], method="safe",
                    max_new_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def direct_build() -> Any:
    """Starts building :func:`build_direct` in a thread (it overlaps the server's startup: ~20 s of tokenizers)."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(build_direct)
    yield future
    pool.shutdown(wait=True)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, direct_build: Any) -> Any:
    log = tmp_path_factory.mktemp("server") / "tiny.log"
    srv = ServerProcess(["--members", *TINY, "--method", "safe", "--set", f"max_new_tokens={MAX_TOKENS}",
                         "--api-key", KEY, "--max-body-bytes", str(MAX_BODY), "--served-model-name", ALIAS], log)
    srv.start()
    print(f"\n[tiny server ready in {srv.startup_seconds:.1f} s at {srv.root}]")
    yield srv
    srv.stop()


@pytest.fixture
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)


def post(server: ServerProcess, path: str, body: Any = None, key: str | None = KEY, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(kw.pop("headers", {}))
    if isinstance(body, (dict, list)):
        kw["json"] = body
    elif body is not None:
        kw["content"] = body
        headers.setdefault("Content-Type", "application/json")
    return httpx.post(server.base_url + path, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def chat(messages: Any = HELLO, **fields: Any) -> dict[str, Any]:
    return {"model": TINY_NAME, "messages": messages, **fields}


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code, body
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# ----------------------------------------------------------------------------- startup and models
def test_startup_models_health_and_auth(server: ServerProcess, client: openai.OpenAI) -> None:
    for answer in server.loading_answers:  # seen while loading (the socket is bound before the members load)
        assert answer["status"] == 503 and answer["error"]["code"] == "model_loading"
    health = server.health()
    assert health["status"] == "ok" and health["model"] == TINY_NAME and health["models"] == [TINY_NAME, ALIAS]
    assert set(health["requests"]) >= {"started", "active", "completed", "cancelled", "disconnects"}
    assert [m.id for m in client.models.list().data] == [TINY_NAME, ALIAS]
    assert client.models.retrieve(ALIAS).id == ALIAS
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    # /health needs no key; /v1 does
    assert_error(httpx.get(server.base_url + "/models"), 401, "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0).chat.completions.create(
            model=TINY_NAME, messages=HELLO)
    assert_error(post(server, "/chat/completions", chat(), key=None), 401, "invalid_api_key")


def test_loading_state_in_process() -> None:
    """503 in OpenAI's shape while ``load`` runs, and after it failed (the command then exits)."""
    import threading

    from fastapi.testclient import TestClient

    from ensemble_core.errors import ModelLoadError
    from ensemble_core.server import create_app

    release = threading.Event()

    def load() -> Ensemble:
        release.wait(30)
        raise ModelLoadError("weights not found (test)")

    app = create_app(load=load)
    with TestClient(app) as tc:
        assert_error(tc.get("/health"), 503, "model_loading")
        assert_error(tc.get("/v1/models"), 503, "model_loading")
        assert_error(tc.post("/v1/chat/completions", json=chat()), 503, "model_loading")
        release.set()
        assert app.state.loading.done.wait(10)
        err = assert_error(tc.get("/health"), 503, "model_load_failed")
        assert "weights not found" in err["message"]


def test_cli_wiring_and_early_option_errors(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("fastapi", "uvicorn", "ensemble_core.server.app"):  # `ensemble --help` must not need the serve extra
        monkeypatch.setitem(sys.modules, module, None)
    parser = argparse.ArgumentParser(prog="ensemble")
    add_serve_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "--members", "a", "b", "--port", "0", "--set", "lookahead=3"])
    assert args.func is cmd_serve and args.members == ["a", "b"] and args.host == "127.0.0.1"
    monkeypatch.undo()
    assert serve_main(["--members", *TINY, "--set", "lookahed=3"]) == 2  # fails before binding or loading
    assert "lookahed" in capsys.readouterr().err


# ----------------------------------------------------------------------------- chat and completions
def test_chat_non_streaming_and_streaming_agree(server: ServerProcess, client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_tokens=MAX_TOKENS, temperature=0,
                                           presence_penalty=0, logprobs=False, user="u1", n=1)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-") and whole.model == TINY_NAME
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason == "length"
    assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    info = whole.model_extra["ensemble"]
    assert info["method"] == "safe" and info["name"] == TINY_NAME and len(info["members"]) == 2
    assert info["stats"]["method"] == "safe" and 0 <= info["stats"]["e_t"] <= 1 and info["seconds"] > 0

    chunks = list(client.chat.completions.create(model=ALIAS, messages=HELLO, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id and c.model == ALIAS for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content  # greedy: streamed and whole answers agree
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "length" and finish[0].model_extra["ensemble"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])

    # raw event stream: data lines only, [DONE] last, no usage chunk without include_usage
    with httpx.stream("POST", server.base_url + "/chat/completions", json=chat(stream=True, max_tokens=4),
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["delta"] == {} and events[-2]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in e for e in events[:-1])


async def test_async_client_and_method_options(server: ServerProcess) -> None:
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    whole, streamed = await asyncio.gather(
        client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_completion_tokens=8,
                                       extra_body={"ensemble": {"lookahead": 2}}),
        client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_completion_tokens=8, stream=True,
                                       extra_body={"ensemble": {"lookahead": 2}}))
    text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
    assert whole.choices[0].message.content == text and text
    assert whole.model_extra["ensemble"]["stats"]["rounds"] >= 4  # 8 tokens, at most 2 drafted per round
    with pytest.raises(openai.BadRequestError) as err:
        await client.chat.completions.create(model=TINY_NAME, messages=HELLO, extra_body={"ensemble": {"bogus": 1}})
    assert err.value.body["param"] == "ensemble.bogus"
    stop = text.split()[1]
    stopped = await client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_tokens=8, stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    await client.close()


def test_completions_are_one_user_message(client: openai.OpenAI) -> None:
    prompt = "Tell me about dogs."
    completion = client.completions.create(model=TINY_NAME, prompt=prompt, max_tokens=MAX_TOKENS)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    as_chat = client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=MAX_TOKENS)
    assert completion.choices[0].text == as_chat.choices[0].message.content
    assert completion.usage.prompt_tokens == as_chat.usage.prompt_tokens
    # the same prompt again: the members' prefix caches held all of it but its last token (OpenAI's field)
    assert as_chat.usage.prompt_tokens_details.cached_tokens == as_chat.usage.prompt_tokens - 1
    chunks = list(client.completions.create(model=TINY_NAME, prompt=[prompt], max_tokens=MAX_TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == completion.usage.total_tokens
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY_NAME, prompt=["a", "b"])
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=TINY_NAME, prompt="a", echo=True)


# ----------------------------------------------------------------------------- tools and response_format
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def check_tool_calls(choice: Any) -> None:
    """A complete forced call is OpenAI's shape; tiny members may also run out of tokens first."""
    assert choice.finish_reason in ("tool_calls", "length"), choice
    if choice.finish_reason == "tool_calls":
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        assert isinstance(json.loads(call.function.arguments), dict)


def test_tools_and_response_format(server: ServerProcess, client: openai.OpenAI) -> None:
    """Refused naming the field while the core lacks them; passed to the core (which checks them) once it has them."""
    neutral = client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_tokens=2, tool_choice="none",
                                             tools=[], response_format={"type": "text"})
    assert neutral.choices[0].message.content is not None
    features = server.health()["features"]
    if "tools" not in features:
        assert_error(post(server, "/chat/completions", chat(tools=WEATHER)), 400, "unsupported_parameter", "tools")
    else:
        assert_error(post(server, "/chat/completions", chat(tools=WEATHER, tool_choice={
            "type": "function", "function": {"name": "nope"}})), 400, "invalid_value", "tool_choice")
        forced = client.chat.completions.create(model=TINY_NAME, messages=HELLO, tools=WEATHER, tool_choice="required",
                                                max_tokens=24)
        check_tool_calls(forced.choices[0])
        chunks = list(client.chat.completions.create(model=TINY_NAME, messages=HELLO, tools=WEATHER, max_tokens=24,
                                                     tool_choice="required", stream=True))
        assert chunks[-1].choices[0].finish_reason == forced.choices[0].finish_reason
    if "response_format" not in features:
        assert_error(post(server, "/chat/completions", chat(response_format={"type": "json_object"})), 400,
                     "unsupported_parameter", "response_format")
    else:
        reply = client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_tokens=8,
                                               response_format={"type": "json_object"})
        assert reply.choices[0].message.content.lstrip().startswith("{")


# ----------------------------------------------------------------------------- errors
LONG_PROMPT = "word " * 4200  # more tokens than the tiny members' 4096-token window, within the body limit

BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "x", "messages": [', 400, "invalid_json", None),
    ("not an object", b"[1, 2]", 400, "invalid_type", None),
    ("missing messages", {"model": TINY_NAME}, 400, "missing_required_parameter", "messages"),
    ("string max_tokens", chat(max_tokens="10"), 400, "invalid_type", "max_tokens"),
    ("bool max_tokens", chat(max_tokens=True), 400, "invalid_type", "max_tokens"),
    ("string temperature", chat(temperature="0.5"), 400, "invalid_type", "temperature"),
    ("unknown field", chat(temprature=0.5), 400, "unknown_parameter", "temprature"),
    ("unknown stream option", chat(stream=True, stream_options={"bogus": 1}), 400, "unknown_parameter",
     "stream_options.bogus"),
    ("stream_options without stream", chat(stream_options={"include_usage": True}), 400, "invalid_value", "stream_options"),
    ("n=2", chat(n=2), 400, "unsupported_value", "n"),
    ("presence_penalty", chat(presence_penalty=0.5), 400, "unsupported_parameter", "presence_penalty"),
    ("logprobs", chat(logprobs=True), 400, "unsupported_parameter", "logprobs"),
    ("logit_bias", chat(logit_bias={"42": 5}), 400, "unsupported_parameter", "logit_bias"),
    ("tools inside the extension", chat(ensemble={"tools": []}), 400, "invalid_value", "ensemble.tools"),
    ("max_tokens conflict", chat(max_tokens=4, max_completion_tokens=5), 400, "invalid_value", "max_completion_tokens"),
    ("max_tokens=0", chat(max_tokens=0), 400, "invalid_value", "max_tokens"),
    ("negative temperature", chat(temperature=-1), 400, "invalid_value", "temperature"),
    ("top_p out of range", chat(top_p=1.5), 400, "invalid_value", "top_p"),
    ("empty stop", chat(stop=[""]), 400, "invalid_value", "stop"),
    ("top-level option in extension", chat(ensemble={"temperature": 0.5}), 400, "invalid_value", "ensemble.temperature"),
    ("bad role", chat([{"role": "robot", "content": "hi"}]), 400, "invalid_value", "messages"),
    ("image content", chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "unsupported_content", "messages"),
    ("empty messages", chat([]), 400, "invalid_value", "messages"),
    ("context overflow (prompt)", chat([{"role": "user", "content": LONG_PROMPT}]), 400, "context_length_exceeded", None),
    ("context overflow (max_tokens)", chat(max_tokens=100_000), 400, "context_length_exceeded", None),
    ("context overflow (stream)", chat(stream=True, max_tokens=100_000), 400, "context_length_exceeded", None),
    ("unknown model", chat(model="gpt-4o"), 404, "model_not_found", "model"),
    ("seed beyond 64 bits", chat(seed=2**64), 400, "invalid_value", "seed"),
    ("tool without a name", chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400, "invalid_value",
     "tools"),
    ("tool schema the validator rejects", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "banana"}}}}}]), 400,
     "invalid_value", "tools"),
    ("tool parameters not an object", chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "string"}}}]), 400, "invalid_value", "tools"),
    ("two tools of one name", chat(tools=WEATHER + WEATHER), 400, "invalid_value", "tools"),
    ("tool_choice naming no function", chat(tools=WEATHER, tool_choice={"type": "function"}), 400, "invalid_value",
     "tool_choice"),
    ("allowed_tools naming an unknown tool", chat(tools=WEATHER, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "nope"}}]}}), 400, "invalid_value",
     "tool_choice"),
    ("response_format schema the validator rejects", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "banana"}}}), 400, "invalid_value", "response_format"),
]


@pytest.mark.parametrize(("body", "status", "code", "param"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(server: ServerProcess, body: Any, status: int, code: str, param: str | None) -> None:
    assert_error(post(server, "/chat/completions", body), status, code, param)


def test_an_option_refused_as_its_run_starts_counts_as_rejected(server: ServerProcess) -> None:
    """A 400 is the client's mistake: /health counted an option the run checks as it starts (``drafter=7``) as
    ``failed``, the counter for the server's own failures."""
    before = server.health()["requests"]
    assert_error(post(server, "/chat/completions", chat(ensemble={"drafter": 7})), 400)
    after = server.health()["requests"]
    assert (after["rejected"], after["failed"]) == (before["rejected"] + 1, before["failed"])


def test_errors_raise_the_openai_exception_classes(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=TINY_NAME, messages=HELLO, n=2)
    assert bad.value.param == "n"
    rejected = server.health()["requests"]["rejected"]
    with pytest.raises(openai.BadRequestError) as overflow:
        client.chat.completions.create(model=TINY_NAME, messages=HELLO, max_tokens=100_000, stream=True)
    assert overflow.value.code == "context_length_exceeded"
    message = overflow.value.body["message"]  # OpenAI's words, in the request's names
    assert "maximum context length is 4096 tokens" in message and "100000 in the completion: max_tokens" in message
    assert server.health()["requests"]["rejected"] == rejected + 1  # refused by the core, counted as such
    with pytest.raises(openai.APIStatusError) as too_large:
        client.chat.completions.create(model=TINY_NAME, messages=[{"role": "user", "content": "x" * (MAX_BODY + 1)}])
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument"):
        client.chat.completions.create(model=TINY_NAME, messages=HELLO, extra_body={"frobnicate": True})


def test_body_limits_routes_and_survival(server: ServerProcess) -> None:
    big = json.dumps(chat([{"role": "user", "content": "x" * (2 * MAX_BODY)}])).encode()
    assert_error(post(server, "/chat/completions", big), 413, "request_too_large")  # Content-Length checked first

    def chunked() -> Any:  # no Content-Length: the size is counted while reading
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    assert_error(post(server, "/chat/completions", chunked()), 413, "request_too_large")
    assert_error(httpx.get(server.base_url + "/nothing-here"), 404, "not_found")
    assert_error(httpx.get(server.base_url + "/chat/completions"), 405, "method_not_allowed")
    # after all of that the server still answers
    assert post(server, "/chat/completions", chat(max_tokens=2)).status_code == 200
    assert server.health()["status"] == "ok" and server.proc.poll() is None


def test_non_streaming_client_disconnect_cancels(server: ServerProcess) -> None:
    before = server.health()["requests"]
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/chat/completions", chat(max_tokens=3000), timeout=httpx.Timeout(60, read=1.5))
    after = wait_for_counts(server, before, disconnects=1, cancelled=1)
    assert after["active"] == 0


def wait_for_counts(server: ServerProcess, before: dict[str, int], limit: float = 30.0, **deltas: int) -> dict[str, int]:
    deadline = time.monotonic() + limit
    while True:
        now = server.health()["requests"]
        if all(now[k] - before[k] >= v for k, v in deltas.items()) or time.monotonic() > deadline:
            got = {k: now[k] - before[k] for k in deltas}
            assert got == deltas, (got, now)
            return now
        time.sleep(0.1)


# ----------------------------------------------------------------------------- load
async def stream_one(http: httpx.AsyncClient, prompt: str, max_tokens: int, leave_after: int | None = None) -> dict[str, Any]:
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"prompt": prompt, "text": "", "first": None, "finish": None, "usage": None, "done": False}
    async with http.stream("POST", "/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        contents = 0
        async for line in r.aiter_lines():
            if not line:
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            assert "error" not in event, event
            if event["choices"]:
                choice = event["choices"][0]
                if choice["delta"].get("content"):
                    out["first"] = out["first"] or time.perf_counter() - t0
                    out["text"] += choice["delta"]["content"]
                    contents += 1
                    if leave_after is not None and contents >= leave_after:
                        break  # leaving the block closes the connection mid-stream
                out["finish"] = choice["finish_reason"] or out["finish"]
            else:
                out["usage"] = event["usage"]
    out["seconds"] = time.perf_counter() - t0
    return out


def test_load_32_concurrent_streams_with_5_disconnects(server: ServerProcess) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    reference = {}
    for prompt in PROMPTS:  # one request at a time first
        r = post(server, "/chat/completions", chat([{"role": "user", "content": prompt}], max_tokens=LOAD_TOKENS))
        reference[prompt] = r.json()["choices"][0]["message"]["content"]
        assert reference[prompt] and "\ufffd" not in reference[prompt], (prompt, reference[prompt])
    before = server.health()["requests"]

    async def burst() -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=server.base_url, headers=headers, limits=limits, timeout=120) as http:
            t0 = time.perf_counter()
            stays = [stream_one(http, PROMPTS[i % len(PROMPTS)], LOAD_TOKENS) for i in range(32)]
            leaves = [stream_one(http, PROMPTS[i], 3000, leave_after=2) for i in range(5)]
            results = await asyncio.wait_for(asyncio.gather(*stays, *leaves), timeout=240)
            return list(results[:32]), list(results[32:]), time.perf_counter() - t0

    stayed, left, wall = asyncio.run(burst())
    for s in stayed:
        assert s["done"] and s["finish"] == "length" and s["usage"]["completion_tokens"] > 0
        assert s["text"] == reference[s["prompt"]] and "\ufffd" not in s["text"], s
    assert all(not s["done"] and s["text"] for s in left)
    after = wait_for_counts(server, before, disconnects=5, cancelled=5, completed=32, started=37)
    assert after["active"] == 0 and after["failed"] == before["failed"] and after["timed_out"] == before["timed_out"]
    batching = server.health()["batching"]  # the streams shared passes: some held several requests' rows
    assert batching["batched_calls"] > 0 and batching["max_rows"] > 1 and batching["rows"] > batching["model_calls"]
    latencies = [s["seconds"] for s in stayed]
    firsts = [s["first"] for s in stayed]
    tokens = sum(s["usage"]["completion_tokens"] for s in stayed)
    print(f"\n[load] 32 streams (+5 disconnecting) concurrently in {wall:.2f} s: {32 / wall:.1f} req/s, "
          f"{tokens / wall:.0f} completion tok/s; latency p50 {percentile(latencies, 50):.2f} s, "
          f"p95 {percentile(latencies, 95):.2f} s; first text p50 {percentile(firsts, 50):.2f} s, "
          f"p95 {percentile(firsts, 95):.2f} s; errors 0; cancelled {after['cancelled'] - before['cancelled']}")
    # the server answers afterwards
    assert post(server, "/chat/completions", chat(max_tokens=4)).status_code == 200


# ----------------------------------------------------------------------------- overhead
def test_overhead_vs_the_core(server: ServerProcess, client: openai.OpenAI, direct_build: Any) -> None:
    """Measured, not asserted: one request at a time through HTTP vs the same generation in-process."""
    reps = 6
    prompt = [{"role": "user", "content": "Write a haiku."}]
    ensemble = direct_build.result(timeout=300)
    direct_text = ensemble.generate(prompt).text  # warm-up
    served_text = client.chat.completions.create(model=TINY_NAME, messages=prompt).choices[0].message.content
    assert served_text == direct_text  # the same weights give the same greedy text through the server
    direct, served, inside = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        ensemble.generate(prompt)
        direct.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        r = client.chat.completions.create(model=TINY_NAME, messages=prompt)
        served.append(time.perf_counter() - t0)
        inside.append(r.model_extra["ensemble"]["seconds"])
    d, s, i = statistics.median(direct), statistics.median(served), statistics.median(inside)
    print(f"\n[overhead] {reps} reps, {MAX_TOKENS} tokens: core in-process median {d * 1000:.1f} ms; through the "
          f"server {s * 1000:.1f} ms ({(s - d) / d:+.1%}); core time inside the server {i * 1000:.1f} ms, so HTTP + "
          f"JSON + thread hand-off = {(s - i) * 1000:.1f} ms ({(s - i) / s:.1%} of a request)")


def test_timeout_whole_and_streamed_in_process(direct_build: Any) -> None:
    """``--timeout``: 504 for a whole answer; a stream already under way ends with an error event."""
    from fastapi.testclient import TestClient

    from ensemble_core.server import create_app

    app = create_app(ensemble=direct_build.result(timeout=300), timeout=1.0)
    with TestClient(app) as tc:
        r = tc.post("/v1/chat/completions", json=chat(max_tokens=3000))
        assert_error(r, 504, "timeout")
        assert r.headers["x-should-retry"] == "false"  # openai's client would otherwise retry it
        with tc.stream("POST", "/v1/chat/completions", json=chat(max_tokens=3000, stream=True)) as r:
            if r.status_code == 200:  # the first text came within the second
                events = sse_events(r.iter_lines())
                assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout", events[-2:]
            else:
                r.read()
                assert_error(r, 504, "timeout")
        assert app.state.loading.engine.snapshot()["timed_out"] == 2


def test_calls_in_any_format_and_invalid_calls_in_process() -> None:
    """Auto mode through the server (a scripted member): a fenced call is ``tool_calls``; a call that breaks
    the tool's schema (free decoding: ``ensemble.lazy_tool_grammar=false``; under the lazy grammar a started
    call always matches) has no ``tool_calls``, finishes ``stop``, keeps its text, and its error is in
    ``ensemble.invalid_tool_calls``; streamed, its pieces end in text no JSON reader accepts."""
    from fastapi.testclient import TestClient
    from test_llamaindex_agent import ScriptedLM

    from ensemble_core import Member
    from ensemble_core.server import create_app

    fenced = '```json\n{"name": "multiply", "arguments": {"a": 6, "b": 7}}\n```'
    hot = '{"name": "multiply", "arguments": {"x": "hot"}}'
    script = iter([fenced, hot, fenced, hot, hot])
    base = tiny_member("smollm2-135m-instruct", seed=1)
    member = Member(ScriptedLM(base.model, base.tokenizer, lambda prompt: next(script)), base.tokenizer, name="scripted",
                    prefix_cache=0)  # ScriptedLM tells requests apart by an empty cache
    tools = [{"type": "function", "function": {"name": "multiply", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    with TestClient(create_app(ensemble=Ensemble([member], method="single", max_new_tokens=64))) as tc:
        body = {"messages": HELLO, "tools": tools, "ensemble": {"lazy_tool_grammar": False}}
        called, broken = (tc.post("/v1/chat/completions", json=body).json()["choices"][0] for _ in range(2))
        assert called["finish_reason"] == "tool_calls" and called["message"]["content"] is None
        assert json.loads(called["message"]["tool_calls"][0]["function"]["arguments"]) == {"a": 6, "b": 7}
        whole = tc.post("/v1/chat/completions", json=body).json()  # the fenced call again: no extension errors
        assert "invalid_tool_calls" not in whole["ensemble"] and "parse_error" not in whole["ensemble"]
        r = tc.post("/v1/chat/completions", json=body)
        choice, info = r.json()["choices"][0], r.json()["ensemble"]
        assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
        assert choice["message"]["content"] == hot and info["invalid_tool_calls"][0]["name"] == "multiply"
        assert "'a' is a required property" in info["invalid_tool_calls"][0]["error"]
        with tc.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r.iter_lines())
        chunks = [e for e in events if e != "[DONE]"]
        pieces = [p for c in chunks if c["choices"] for p in c["choices"][0]["delta"].get("tool_calls", [])]
        assert pieces[0]["function"]["name"] == "multiply"
        with pytest.raises(json.JSONDecodeError):
            json.loads("".join(p["function"]["arguments"] for p in pieces))
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert "required" in chunks[-1]["ensemble"]["invalid_tool_calls"][0]["error"]
    assert broken["finish_reason"] == "stop" and broken["message"]["content"] == hot


def test_a_stop_signal_answers_the_running_generations_with_what_they_have(tmp_path: Path) -> None:
    """SIGTERM while a stream and a whole request decode: each ends with its text so far and finish_reason
    "cancelled" (the docs' promise). Before, nothing cancelled them: uvicorn's graceful shutdown waited 5 s,
    then answered the whole request a plain-text 500 (which OpenAI's client retries) and cut the stream."""
    import signal
    import threading

    srv = ServerProcess(["--members", "tiny:smollm2-135m-instruct", "--method", "single", "--set",
                         "max_new_tokens=3000"], tmp_path / "stop.log").start()
    try:
        client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=60)
        long = [{"role": "user", "content": "Tell me a long story."}]
        chunks: list[Any] = []
        whole: list[Any] = []
        errors: list[BaseException] = []

        def stream() -> None:
            try:
                chunks.extend(client.chat.completions.create(model=None, messages=long, stream=True))  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001 - reported by the asserts below
                errors.append(e)

        def ask() -> None:
            try:
                whole.append(client.chat.completions.create(model=None, messages=long))  # type: ignore[arg-type]
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=stream), threading.Thread(target=ask)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while (len(chunks) < 3 or srv.health()["requests"]["active"] < 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(chunks) >= 3 and not errors, errors
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert whole[0].choices[0].finish_reason == "cancelled" and whole[0].choices[0].message.content
        ends = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert ends == ["cancelled"] and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert srv.proc.wait(30) == -signal.SIGTERM  # uvicorn re-raises the signal once it has stopped
        assert "Stopping: 2 generation(s) cancelled" in srv.log_text()
    finally:
        srv.stop()


def test_server_log_has_no_crash(server: ServerProcess) -> None:
    """After every test above (bad input, disconnects, load) the log shows no traceback and the process runs."""
    log = server.log_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert server.proc.poll() is None and server.health()["requests"]["failed"] == 0


# ----------------------------------------------------------------------------- real pair
PAIR = ["smollm2-135m-instruct", "gemma3-270m"]
PAIR_NAME = "safe(smollm2-135m-instruct+gemma3-270m)"


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    log = tmp_path_factory.mktemp("server") / "real.log"
    srv = ServerProcess(["--members", *PAIR, "--method", "safe", "--api-key", KEY, "--set", "max_new_tokens=24"], log)
    srv.start(timeout=300)
    print(f"\n[real server ready in {srv.startup_seconds:.1f} s]")
    yield srv
    srv.stop()


@pytest.mark.real
def test_real_openai_and_langchain_chain(real_server: ServerProcess) -> None:
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_openai import ChatOpenAI

    client = openai.OpenAI(base_url=real_server.base_url, api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model=PAIR_NAME, messages=[
        {"role": "system", "content": "Answer in one short sentence."},
        {"role": "user", "content": "What is the capital of France?"}], max_tokens=16)
    assert "Paris" in answer.choices[0].message.content, answer
    assert answer.model_extra["ensemble"]["members"] == PAIR

    llm = ChatOpenAI(base_url=real_server.base_url, api_key=KEY, model=PAIR_NAME, max_tokens=16, temperature=0,
                     max_retries=0)
    prompt = ChatPromptTemplate.from_messages([("system", "Answer in one short sentence."), ("human", "{question}")])
    question = {"question": "What is the capital of France?"}
    message = (prompt | llm).invoke(question)
    assert message.content == answer.choices[0].message.content  # the same request, greedy
    assert message.usage_metadata["output_tokens"] == answer.usage.completion_tokens
    assert message.response_metadata["finish_reason"] in ("stop", "length")
    chain = prompt | llm | StrOutputParser()
    assert "".join(chain.stream(question)) == message.content
    if "tools" in real_server.health()["features"]:  # LangChain's tool binding through the server
        caller = ChatOpenAI(base_url=real_server.base_url, api_key=KEY, model=PAIR_NAME, max_tokens=48, max_retries=0)
        called = caller.bind_tools(WEATHER, tool_choice="get_weather").invoke("What is the weather in Paris?")
        assert called.tool_calls and called.tool_calls[0]["name"] == "get_weather", called
        assert "city" in called.tool_calls[0]["args"]


@pytest.mark.real
def test_real_llamaindex_openai_like_query_engine(real_server: ServerProcess) -> None:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.llms import ChatMessage
    from llama_index.embeddings.ensemble import LocalSentenceEmbedding
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=PAIR_NAME, api_base=real_server.base_url, api_key=KEY, is_chat_model=True,
                     context_window=2048, max_tokens=24, temperature=0, max_retries=0)
    docs = [Document(text="The Varnholm lighthouse was kept by Ingrid Solberg until it was automated in 1987."),
            Document(text="Bread is baked from flour, water, salt and yeast.")]
    index = VectorStoreIndex.from_documents(docs, embed_model=LocalSentenceEmbedding())
    response = index.as_query_engine(llm=llm, similarity_top_k=1).query("Who kept the Varnholm lighthouse?")
    assert str(response).strip()
    assert "Varnholm" in response.source_nodes[0].node.get_content()
    deltas = [r.delta for r in llm.stream_chat([ChatMessage(role="user", content="Name a color.")])]
    assert "".join(d or "" for d in deltas).strip()


def test_docs_exist() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    for needed in ("ensemble serve", "ChatOpenAI", "OpenAILike", "context_length_exceeded", '"ensemble"', "tiny:"):
        assert needed in text, needed
