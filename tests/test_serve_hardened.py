"""``kvq serve`` under load and bad requests (issue #54): OpenAI's error shape, one served model, context and token
limits, an API key, SIGTERM drain; and the parts of mlx-lm's server that kvq's subclasses rely on.

A new user found the faults with the official ``openai`` client: ``"model": "nosuch"`` made mlx-lm's server unload
the served model and answer 404 with a connection error; errors were ``{"error": "<string>"}``, which that client
shows as ``Error code: 400`` alone; ``"messages": "hello"`` answered ``'str' object has no attribute 'get'``.

The server tests start one ``kvq serve`` on 127.0.0.1 with a tiny random llama (2 layers, byte-level tokenizer,
128 positions: seconds to start on a 2-core CPU) and talk to it with ``http.client``; every request has a timeout
and the load has a fixed size, so the module ends by itself (about 25 s there, the two servers and the load's three
runs included).
"""

from __future__ import annotations

import http.client
import inspect
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
from mlx_lm import server

from kvq.cli.serve_api import (RequestError, ServePolicy, checked_request, config_context_length,
                               context_length_error)
from kvq.cli.serve_handler import (CHAT_PATHS, MLX_LM_RELIES_ON, MLX_LM_VERSIONS, TEXT_PATHS, ClientWatch, Refusal,
                                   MEMORY_PATH, MEMORY_PROBE, check_mlx_lm_version,
                                   client_gone, handler_class)
from kvq.cli.serve_run import listens_beyond_loopback, serve_http

KEY = "test-key"
CONTEXT = 128
CAP = 48
CLIENTS = 16
#: kvq serve's options for the server under test (a cache that compresses within a short prompt)
OPTIONS = ["--method", "turboquant", "--bits", "4", "--sinks", "4", "--window", "8", "--flush", "8",
           "--api-key", KEY, "--max-tokens-cap", str(CAP), "--drain-seconds", "20"]
USER = {"role": "user", "content": "the hello world"}


# -- what kvq serve relies on in mlx-lm ----------------------------------------------------------------------------

def test_installed_mlx_lm_is_a_supported_one():
    import mlx_lm

    check_mlx_lm_version(mlx_lm.__version__)
    assert mlx_lm.__version__.startswith(MLX_LM_VERSIONS)


def test_another_mlx_lm_is_refused_by_name(monkeypatch):
    monkeypatch.delenv("KVQ_SERVE_ANY_MLX_LM", raising=False)
    with pytest.raises(ValueError, match=r"mlx-lm 0\.32\.x's server and mlx-lm 0\.99\.0 is installed"):
        check_mlx_lm_version("0.99.0")


@pytest.mark.parametrize("name", sorted(MLX_LM_RELIES_ON))
def test_mlx_lm_server_has_what_the_subclasses_override_or_call(name):
    """Each method kvq overrides or calls exists in ``mlx_lm.server`` with the parameter names kvq expects: an
    mlx-lm that changes one fails here, not in a user's server."""
    obj = server
    for part in name.split("."):
        obj = getattr(obj, part)
    assert tuple(inspect.signature(obj).parameters) == MLX_LM_RELIES_ON[name], name


def test_mlx_lm_main_builds_its_server_through_the_names_kvq_replaces():
    """kvq serve swaps ``ModelProvider``, ``run`` and ``scan_cache_dir`` in ``mlx_lm.server`` for the length of
    ``server.main()``: main must still look them up there, and ``GenerationArguments`` must carry ``max_tokens``
    (cut to the room left in the context)."""
    assert {"ModelProvider", "run"} <= set(server.main.__code__.co_names)
    assert callable(server.scan_cache_dir)
    assert "max_tokens" in server.GenerationArguments.__dataclass_fields__
    assert issubclass(server.APIHandler, server.BaseHTTPRequestHandler)


def test_mlx_lm_do_post_reads_what_kvq_checks():
    """kvq checks a body and hands mlx-lm's ``do_POST`` the checked one: that method must still route kvq's paths
    and read the fields kvq rewrites (``model`` to ``default_model``, ``stream_options`` completed)."""
    source = inspect.getsource(server.APIHandler.do_POST)
    for literal in (*CHAT_PATHS, *TEXT_PATHS, '"model", "default_model"', '"max_completion_tokens"',
                    '"stream_options"', '"draft_model", "default_model"', '"adapters"'):
        assert literal in source, literal


# -- request checks (no server) ------------------------------------------------------------------------------------

POLICY = ServePolicy(model_id="tiny", names=frozenset({"tiny", "/models/tiny"}), max_tokens_cap=CAP, vocab_size=300)
BAD = [  # (body, status, param, code, words of the message)
    ({"messages": "hello"}, 400, "messages", None, "non-empty list"),
    ({"messages": []}, 400, "messages", None, "non-empty list"),
    ({}, 400, "messages", None, "missing"),
    ({"messages": ["hi"]}, 400, "messages[0]", None, "object with role"),
    ({"messages": [{"content": "hi"}]}, 400, "messages[0].role", None, "role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content", None, "required"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content", None, "string"),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, 400, "messages[0].content[0]", None, "type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text", None,
     "string"),
    ({"messages": [USER], "model": "nosuch"}, 404, "model", "model_not_found", "'nosuch' does not exist"),
    ({"messages": [USER], "model": 7}, 400, "model", None, "string"),
    ({"messages": [USER], "adapters": "x"}, 400, "adapters", None, "fixed"),
    ({"messages": [USER], "draft_model": "x"}, 400, "draft_model", None, "fixed"),
    ({"messages": [USER], "max_tokens": 0}, 400, "max_tokens", None, "at least 1"),
    ({"messages": [USER], "max_tokens": True}, 400, "max_tokens", None, "integer"),
    ({"messages": [USER], "max_tokens": 2.5}, 400, "max_tokens", None, "integer"),
    ({"messages": [USER], "max_completion_tokens": CAP + 1}, 400, "max_completion_tokens", None, "cap"),
    ({"messages": [USER], "temperature": "hot"}, 400, "temperature", None, "number"),
    ({"messages": [USER], "temperature": 2.5}, 400, "temperature", None, "between 0 and 2"),
    ({"messages": [USER], "top_p": -0.1}, 400, "top_p", None, "between 0 and 1"),
    ({"messages": [USER], "n": 2}, 400, "n", None, "between 1 and 1"),
    ({"messages": [USER], "stream": "yes"}, 400, "stream", None, "true or false"),
    ({"messages": [USER], "stop": 5}, 400, "stop", None, "stop must be"),
    ({"messages": [USER], "stop": [""]}, 400, "stop", None, "stop must be"),
    ({"messages": [USER], "logit_bias": {"a": 1}}, 400, "logit_bias", None, "token ids"),
    ({"messages": [USER], "logit_bias": {"300": 1}}, 400, "logit_bias", None, "outside"),
    ({"messages": [USER], "stream_options": {"include_usage": 1}}, 400, "stream_options", None, "include_usage"),
    ({"messages": [USER], "tools": {"a": 1}}, 400, "tools", None, "list"),
]


@pytest.mark.parametrize("body, status, param, code, words", BAD)
def test_a_bad_field_is_refused_naming_it(body, status, param, code, words):
    with pytest.raises(RequestError) as info:
        checked_request(body, True, POLICY)
    error = info.value.body()["error"]
    assert (info.value.status, error["param"], error["code"]) == (status, param, code)
    assert words in error["message"] and error["type"] == "invalid_request_error"


def test_a_good_request_reaches_mlx_lm_pointed_at_the_served_model():
    body = {"messages": [USER], "model": "/models/tiny", "temperature": 0, "seed": None, "xtc_probability": 0,
            "stream_options": {}}
    checked = checked_request(body, True, POLICY)
    assert checked["model"] == "default_model" and "seed" not in checked
    assert checked["xtc_probability"] == 0.0 and isinstance(checked["xtc_probability"], float)
    assert checked["stream_options"] == {"include_usage": False}
    any_model = ServePolicy(model_id="tiny", any_model=True)
    assert checked_request({"prompt": "x", "model": "gpt-4o"}, False, any_model)["model"] == "default_model"
    with pytest.raises(RequestError, match="prompt must be a non-empty string"):
        checked_request({"prompt": ["x"]}, False, POLICY)


def test_binding_beyond_loopback_is_told_apart():
    assert not listens_beyond_loopback("127.0.0.1") and not listens_beyond_loopback("localhost")
    assert listens_beyond_loopback("0.0.0.0") and listens_beyond_loopback("")


def test_a_port_in_use_is_an_error_that_stops_the_generation_thread():
    """Binding fails after the generation thread started: it is stopped (else the process would never exit) and the
    failure is a ValueError, which ``kvq`` prints as one line."""
    stopped = []
    generator = SimpleNamespace(stop_and_join=lambda: stopped.append(True))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ValueError, match="cannot listen on 127.0.0.1:"):
            serve_http("127.0.0.1", taken.getsockname()[1], generator, handler_class(POLICY), 1)
    assert stopped == [True]


def test_context_length_from_config():
    assert config_context_length({"max_position_embeddings": 8192, "n_positions": 1}) == 8192
    assert config_context_length({"text_config": {"max_position_embeddings": 4096}}) == 4096
    assert config_context_length({"hidden_size": 8}) is None


# -- the handler's answers to failures (in process, no socket) -----------------------------------------------------

def bare_handler(stream: bool):
    """A :class:`KVQHandler` for :data:`POLICY` with no socket: it writes to a ``BytesIO`` and has sent nothing."""
    handler = object.__new__(handler_class(POLICY))
    handler.stream, handler.wfile, handler.path, handler.command = stream, io.BytesIO(), "/v1/completions", "POST"
    handler.request_version, handler.requestline, handler.client_address = "HTTP/1.1", "POST /v1/completions", ("-", 0)
    handler.headers, handler.log_request = {}, lambda *args: None
    handler.response_generator = SimpleNamespace(cli_args=SimpleNamespace(allowed_origins=["*"]))
    return handler


def written(handler) -> tuple[int | None, list]:
    """The HTTP status and the JSON values (a body, or each ``data:`` event) that ``handler`` wrote."""
    head, _, rest = handler.wfile.getvalue().decode().partition("\r\n\r\n")
    lines = [line[len("data: "):] for line in rest.splitlines() if line.startswith("data: ")] or [rest]
    return int(head.split()[1]) if head.startswith("HTTP/") else None, [json.loads(v) for v in lines if v]


@pytest.mark.parametrize("stream", [True, False])
def test_a_failure_mid_answer_is_a_server_error_in_openais_shape(stream, monkeypatch):
    """A generation that fails after the answer began: an SSE error event closing a stream (the ``openai`` client
    raises ``APIError`` with its message), or a 500 in place of the 200 not yet sent."""
    def fails_midway(self, request, stop_words):
        if self.stream:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'data: {"choices": []}\n\n')
        else:
            self.send_response(200)  # mlx-lm's status line waits in the header buffer until the answer is ready
        raise RuntimeError("the cache broke")

    monkeypatch.setattr(server.APIHandler, "handle_completion", fails_midway)
    handler = bare_handler(stream)
    handler.handle_completion(None, [])
    status, values = written(handler)
    error = {"error": {"message": "generation failed: the cache broke", "type": "server_error", "param": None,
                       "code": None}}
    assert values[-1] == error
    assert status == (200 if stream else 500)


def test_client_watch_stops_an_answer_when_the_client_has_gone():
    """:class:`ClientWatch` passes tokens on while the client is there (also one that sent more bytes), and raises
    ``ConnectionResetError`` at its next check once the client closed: mlx-lm's ``handle_completion`` then stops that
    generation (``ctx.stop()``) though nothing was written to the client yet."""
    ours, theirs = socket.socketpair()
    generator = SimpleNamespace(generate=lambda *args: ("ctx", iter(range(10))), cli_args="passed through")
    watch = ClientWatch(generator, ours, every=4)
    ctx, responses = watch.generate(None, None)
    assert watch.cli_args == "passed through" and [next(responses) for _ in range(4)] == [0, 1, 2, 3]
    theirs.sendall(b"x")
    assert not client_gone(ours) and next(responses) == 4
    ours.recv(1)
    theirs.close()
    assert client_gone(ours)
    with pytest.raises(ConnectionResetError):
        list(responses)  # the check at the 9th token
    ours.close()


def test_a_refusal_and_a_client_gone_answer_no_500(monkeypatch):
    """A :class:`Refusal` from the generator (a prompt over the context) is answered with its status; a client that
    went away is logged, and nothing is written."""
    def refused(self, request, stop_words):
        raise Refusal(context_length_error(300, CONTEXT, "prompt"))

    monkeypatch.setattr(server.APIHandler, "handle_completion", refused)
    handler = bare_handler(False)
    handler.handle_completion(None, [])
    status, values = written(handler)
    assert status == 400 and values[0]["error"]["code"] == "context_length_exceeded"

    def gone(self, request, stop_words):
        raise BrokenPipeError

    monkeypatch.setattr(server.APIHandler, "handle_completion", gone)
    handler = bare_handler(True)
    handler.handle_completion(None, [])
    assert handler.wfile.getvalue() == b""


# -- one server under load and bad requests ------------------------------------------------------------------------

def free_port() -> int:
    """A port of 127.0.0.1 free now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    """The tiny random llama of tests/test_distributed.py as an mlx-lm folder, its context cut to 128 positions."""
    from distributed_worker import save_tiny_folder
    from test_models import write_tiny_gguf

    from kvq import models

    base = tmp_path_factory.mktemp("serve")
    write_tiny_gguf(base / "tiny.gguf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVQ_CACHE_DIR", str(base / "cache"))
        tokenizer_folder = models.resolve_model(base / "tiny.gguf", progress=False)
    folder = save_tiny_folder(base / "model", tokenizer_folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": CONTEXT}))
    return folder


class Server:
    """A ``kvq serve`` process on 127.0.0.1 whose log goes to a file (a pipe could fill and stall it)."""

    def __init__(self, folder: Path, *extra: str):
        self.port, self.log = free_port(), folder.parent / f"serve-{time.monotonic_ns()}.log"
        command = [sys.executable, "-m", "kvq.cli", "serve", "--model", str(folder), "--port", str(self.port),
                   *OPTIONS, *extra]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "KVQ_CACHE_DIR": str(folder.parent / "cache"), MEMORY_PROBE: "1"}
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                            start_new_session=True)
        self.wait_ready(timeout=90)

    def text(self) -> str:
        """The server's log so far (standard output and error)."""
        return self.log.read_text()

    def wait_ready(self, timeout: float) -> None:
        """Wait until ``/health`` answers 200; fail with the log if the server exits or ``timeout`` s pass."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"kvq serve exited {self.process.returncode}:\n{self.text()[-4000:]}")
            try:
                if call(self.port, "GET", "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"kvq serve not ready in {timeout} s:\n{self.text()[-4000:]}")

    def stop(self) -> None:
        """Kill the server's process group (if it still runs)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def call(port: int, method: str, path: str, body=None, raw: bytes | None = None, key: str | None = KEY,
         timeout: float = 60) -> tuple[int, dict | bytes]:
    """One request with ``http.client``: (status, the JSON answer or its bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers=headers)
        response = conn.getresponse()
        payload = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(payload)
    except ValueError:
        return response.status, payload


def stream(port: int, path: str, body: dict, leave_after: int | None = None, timeout: float = 60,
           first: threading.Event | None = None) -> dict:
    """A streamed completion: its text, events, usage chunk and whether ``[DONE]`` came; ``leave_after``: close the
    connection after that many events (a client gone mid-stream); ``first`` is set at the first event."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, json.dumps({**body, "stream": True}).encode(),
                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    got = {"status": response.status, "text": "", "events": 0, "usage": None, "done": False, "errors": []}
    try:
        for _ in range(10_000):
            line = response.readline()
            if not line:
                break
            line = line.decode().strip()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] = True
                break
            event = json.loads(line[len("data: "):])
            if "error" in event:
                got["errors"].append(event["error"])
                continue
            got["events"] += 1
            if first is not None:
                first.set()
            got["usage"] = event.get("usage") or got["usage"]
            for choice in event["choices"]:
                got["text"] += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            if leave_after is not None and got["events"] >= leave_after:
                break
    finally:
        conn.close()
    return got


def chat(content: str, **fields) -> dict:
    """A greedy chat request of one user message, 12 tokens, ``fields`` added."""
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 12, **fields}


def is_openai_error(reply, code: str | None = None) -> bool:
    """``reply`` is ``{"error": {"message", "type", "param", "code"}}`` with a message and, if given, ``code``."""
    error = reply.get("error") if isinstance(reply, dict) else None
    return (isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}
            and bool(error["message"]) and (code is None or error["code"] == code))


@pytest.fixture(scope="module")
def served(tiny_folder):
    """The module's ``kvq serve`` (:data:`OPTIONS`) on the tiny model; ``start_seconds``: how long it took to start."""
    started = time.monotonic()
    process = Server(tiny_folder)
    process.start_seconds = time.monotonic() - started
    yield process
    process.stop()


LONG = "the hello world " * 12  # about 200 byte-level tokens: over the 128-token context
MALFORMED = [  # (path, body or raw bytes, key, status, code)
    ("/v1/chat/completions", {"messages": "hello"}, KEY, 400, None),
    ("/v1/chat/completions", {"messages": []}, KEY, 400, None),
    ("/v1/chat/completions", chat("hi", model="nosuch"), KEY, 404, "model_not_found"),
    ("/v1/chat/completions", chat("hi", max_tokens=-1), KEY, 400, None),
    ("/v1/chat/completions", chat("hi", max_tokens=CAP + 1), KEY, 400, None),
    ("/v1/chat/completions", chat("hi", temperature="x"), KEY, 400, None),
    ("/v1/chat/completions", chat("hi", stop=5), KEY, 400, None),
    ("/v1/chat/completions", b'{"messages": [', KEY, 400, None),
    ("/v1/chat/completions", b"[1, 2]", KEY, 400, None),
    ("/v1/chat/completions", chat(LONG), KEY, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 4}, KEY, 400, "context_length_exceeded"),
    ("/v1/completions", {"prompt": 42}, KEY, 400, None),
    ("/v1/chat/completions", chat("hi"), "wrong", 401, "invalid_api_key"),
    ("/v1/chat/completions", chat("hi"), None, 401, "invalid_api_key"),
    ("/v1/nothing", chat("hi"), KEY, 404, "unknown_url"),
]


def one_case(port: int, case: tuple) -> tuple:
    """Run one case of the load: what came back, in a form the test compares."""
    kind, payload = case
    if kind == "chat":
        status, reply = call(port, "POST", "/v1/chat/completions", payload)
        assert status == 200, reply
        usage = reply["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > usage["prompt_tokens"]
        return kind, payload["messages"][0]["content"], reply["choices"][0]["message"]["content"] or ""
    if kind == "text":
        status, reply = call(port, "POST", "/v1/completions", payload)
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
        return kind, payload["prompt"], reply["choices"][0]["text"]
    if kind == "stream":
        got = stream(port, "/v1/chat/completions", {**payload, "stream_options": {"include_usage": True}})
        assert got["status"] == 200 and got["done"] and not got["errors"], got
        assert got["usage"]["completion_tokens"] >= 1, got
        return "chat", payload["messages"][0]["content"], got["text"]
    if kind == "leave":
        got = stream(port, "/v1/chat/completions", payload, leave_after=2)
        assert got["status"] == 200, got
        return kind, None, None
    path, body, key, status, code = payload
    raw = body if isinstance(body, bytes) else None
    got_status, reply = call(port, "POST", path, None if raw else body, raw=raw, key=key)
    assert got_status == status and is_openai_error(reply, code), (payload, got_status, reply)
    return kind, path, status


def load_cases(model: str, copies: int) -> list[tuple]:
    """``copies`` times 48 requests: identical chats (plain, streamed, and one naming the served ``model``),
    different text completions, clients that leave mid-stream, and every malformed request of :data:`MALFORMED`,
    interleaved."""
    same = chat("the the hello")
    cases = [("chat", same)] * 8 + [("stream", same)] * 6
    cases += [("text", {"prompt": f"hello {i} world", "max_tokens": 8 + i % 5, "temperature": 0}) for i in range(10)]
    cases += [("leave", chat("the world", max_tokens=CAP))] * 5
    cases += [("bad", case) for case in MALFORMED]
    cases += [("chat", chat(f"different {i}")) for i in range(3)]
    cases.append(("chat", chat("the the hello", model=model)))
    cases *= copies
    return [cases[(7 * i) % len(cases)] for i in range(len(cases))]  # 7 is prime to 48 * 2^k: a permutation


def memory_probe(port: int) -> dict:
    """``GET /kvq/memory``: the server's MLX active memory after it cleared its prompt cache, and what that cache
    held (entries and bytes)."""
    status, reply = call(port, "GET", MEMORY_PATH)
    assert status == 200 and reply["active_memory"] > 0, reply
    return reply


def settle_and_measure(port: int) -> dict:
    """:func:`memory_probe` after one short greedy chat answered alone (the same each time), so that what mlx-lm's
    generation thread still references from its last step (the finished rows' caches, in its loop's variables) is
    that chat's and not whichever rows of a load happened to finish last."""
    status, reply = call(port, "POST", "/v1/chat/completions", chat("settle", max_tokens=2))
    assert status == 200, reply
    return memory_probe(port)


def run_load(server: Server, model: str, clients: int = CLIENTS, copies: int = 2, runs: int = 3) -> dict:
    """The load of :func:`load_cases` (``copies`` x 48 requests from ``clients`` threads) ``runs`` times against
    ``server``, each run checked as it ends (:func:`one_case`; identical chats identical); the server's active
    memory after clearing its prompt cache is read before the first run and after each. Returns the figures:
    ``clients``, ``requests`` (per run), ``seconds`` and ``active_memory`` (lists), the statuses in the server's log
    (``status_200``, ``status_4xx``, ``status_5xx``), ``clients_gone``, ``identical_answers`` (distinct answers to
    the identical chat, over every run: 1) and ``tracebacks`` (in the log)."""
    cases = load_cases(model, copies)
    figures = {"clients": clients, "requests": len(cases), "runs": runs, "seconds": [],
               "active_memory": [settle_and_measure(server.port)["active_memory"]], "prompt_cache_entry_bytes": []}
    answers = {}
    for _ in range(runs):
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=clients) as pool:
            results = list(pool.map(lambda case: one_case(server.port, case), cases, timeout=600))
        figures["seconds"].append(round(time.monotonic() - started, 2))
        for kind, prompt, text in results:
            if kind == "chat":
                answers.setdefault(prompt, set()).add(text)
        probe = settle_and_measure(server.port)
        figures["active_memory"].append(probe["active_memory"])
        figures["prompt_cache_entry_bytes"].append(probe["prompt_cache_bytes"] // max(probe["prompt_cache_cleared"], 1))
    log = server.text()
    statuses = [int(s) for s in re.findall(r'"(?:GET|POST) \S+ HTTP/1\.\d" (\d{3}) ', log)]
    return {**figures, "status_200": statuses.count(200), "status_4xx": sum(400 <= s < 500 for s in statuses),
            "status_5xx": sum(s >= 500 for s in statuses), "clients_gone": log.count("went away"),
            "identical_answers": len(answers["the the hello"]), "tracebacks": log.count("Traceback"),
            "model_loads": log.count("kvq serve: kvq caches of ")}


def describe(figures: dict) -> str:
    """One line of :func:`run_load`'s figures."""
    mib = [f"{m / 2**20:.2f}" for m in figures["active_memory"]]
    return (f"load: {figures['clients']} clients, {figures['runs']} runs of {figures['requests']} requests in "
            f"{', '.join(f'{s:.1f}' for s in figures['seconds'])} s; answered 200: {figures['status_200']}, 4xx: "
            f"{figures['status_4xx']}, 5xx: {figures['status_5xx']}; clients gone mid-stream: "
            f"{figures['clients_gone']}; distinct answers to the identical chat: {figures['identical_answers']}; "
            f"active MiB after clearing the prompt cache, before and after each run: {', '.join(mib)} (a prompt-cache "
            f"entry held {max(figures['prompt_cache_entry_bytes']) / 1024:.0f} KiB at most)")


@pytest.mark.slow
def test_load_and_faults(served, tiny_folder):
    """16 clients, 96 requests at once, three times: every well-formed request answered, identical requests
    (temperature 0) identical, streamed and plain alike; every malformed one refused in OpenAI's shape with its
    status; clients that leave mid-stream cost nothing; the model is loaded once; no traceback and no 5xx in the
    server's log; the server's active memory after clearing its prompt cache does not grow from the second run to
    the third (the first may allocate what stays: compiled kernels, MLX's own state)."""
    figures = run_load(served, str(tiny_folder))
    print(f"\n{describe(figures)} (server start {served.start_seconds:.1f} s)")
    assert figures["requests"] == CLIENTS * 6
    assert figures["identical_answers"] == 1
    assert call(served.port, "GET", "/health")[0] == 200
    log = served.text()
    assert figures["tracebacks"] == 0 and figures["status_5xx"] == 0, log[-4000:]
    assert figures["model_loads"] == 1, log[-4000:]  # the model was never unloaded and reloaded
    assert figures["clients_gone"] >= 1, log[-4000:]
    assert not_growing(figures), describe(figures)


def not_growing(figures: dict) -> bool:
    """Whether the server's active memory after clearing its prompt cache grew from the second run to the third by
    less than one request's cache (the most bytes per prompt-cache entry that a probe cleared).
    :func:`settle_and_measure` has the generation thread answer the same chat last each time, so nothing of the
    load should stay: measured 6.05 MiB after every run, 9 runs of 9 (without that chat, what the thread's last
    step referenced varied by up to 0.9 MiB); a leak of every answered request's cache would add about 70 entries
    per run (3.5 MiB here)."""
    second, third = figures["active_memory"][2:4]
    return third - second < max(figures["prompt_cache_entry_bytes"])


@pytest.mark.slow
def test_models_lists_the_served_model_alone_and_needs_the_key(served, tiny_folder):
    status, reply = call(served.port, "GET", "/v1/models")
    assert status == 200 and [m["id"] for m in reply["data"]] == [str(tiny_folder)]
    assert call(served.port, "GET", f"/v1/models/{tiny_folder}")[0] == 200
    status, reply = call(served.port, "GET", "/v1/models/nosuch")
    assert status == 404 and is_openai_error(reply, "model_not_found")
    status, reply = call(served.port, "GET", "/v1/models", key=None)
    assert status == 401 and is_openai_error(reply, "invalid_api_key")


def raw_exchange(port: int, head: str) -> tuple[int, dict]:
    """Send ``head`` (request line and headers, no body) on a bare socket; the status and JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(head.encode())
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    status_line, _, rest = reply.partition(b"\r\n")
    return int(status_line.split()[1]), json.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.mark.slow
def test_a_body_without_length_or_too_long_is_refused_unread(served):
    """No Content-Length: 411; one above 32 MiB: 413, answered before a byte of the body is read."""
    auth = f"Authorization: Bearer {KEY}\r\n"
    status, reply = raw_exchange(served.port, f"POST /v1/chat/completions HTTP/1.1\r\n{auth}\r\n")
    assert status == 411 and is_openai_error(reply), reply
    status, reply = raw_exchange(served.port, f"POST /v1/completions HTTP/1.1\r\n{auth}Content-Length: {2**40}\r\n\r\n")
    assert status == 413 and is_openai_error(reply), reply


@pytest.mark.slow
def test_a_client_gone_before_its_plain_answer_frees_its_slot(served):
    """A client that sends a plain (not streamed) request and closes at once: logged in one line, no traceback, and
    the server goes on answering. (On this tiny model the answer is done before anyone notices; that the watch
    stops a generation within a few tokens is :func:`test_client_watch_stops_an_answer_when_the_client_has_gone`.)"""
    before = served.text().count("went away")
    body = json.dumps(chat("the the world", max_tokens=CAP, logit_bias={"2": -100})).encode()
    with socket.create_connection(("127.0.0.1", served.port), timeout=30) as conn:
        conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nAuthorization: Bearer {KEY}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 20
    while served.text().count("went away") == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.text().count("went away") == before + 1, served.text()[-3000:]
    assert call(served.port, "POST", "/v1/chat/completions", chat("hello"))[0] == 200


@pytest.mark.slow
def test_a_completion_stops_where_the_context_ends(served):
    """A prompt that leaves fewer tokens than ``max_tokens`` in the 128-token context stops there (``length``)."""
    status, reply = call(served.port, "POST", "/v1/completions",
                         {"prompt": "the hello world " * 7, "max_tokens": CAP, "temperature": 0,
                          "logit_bias": {"2": -100}})  # token 2 is the end of sequence
    assert status == 200, reply
    usage = reply["usage"]
    assert usage["prompt_tokens"] > CONTEXT - CAP, usage  # the context, not max_tokens, ends this completion
    assert usage["completion_tokens"] == CONTEXT - usage["prompt_tokens"], usage
    assert reply["choices"][0]["finish_reason"] == "length"


@pytest.mark.slow
def test_the_cap_is_the_default_max_tokens(served):
    """With ``--max-tokens-cap 48``, a request that names no ``max_tokens`` gets at most 48 (not mlx-lm's 512)."""
    status, reply = call(served.port, "POST", "/v1/completions",
                         {"prompt": "hello", "temperature": 0, "logit_bias": {"2": -100}})
    assert status == 200 and reply["usage"]["completion_tokens"] == CAP, reply


@pytest.mark.slow
def test_the_official_client_shows_kvqs_messages(served, tiny_folder):
    """The ``openai`` package (when installed) raises with kvq's message for a bad request, an unknown model and a
    bad key, and reads a good answer with its usage."""
    openai = pytest.importorskip("openai")

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="Error code: 400 - messages must be a non-empty list") as info:
        client.chat.completions.create(model=str(tiny_folder), messages=[])
    assert info.value.param == "messages"
    with pytest.raises(openai.NotFoundError, match="The model 'nosuch' does not exist") as info:
        client.chat.completions.create(model="nosuch", messages=[USER])
    assert info.value.code == "model_not_found"
    bad_key = openai.OpenAI(base_url=f"http://127.0.0.1:{served.port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError, match="Incorrect API key"):
        bad_key.models.list()
    reply = client.chat.completions.create(model=str(tiny_folder), messages=[USER], max_tokens=4, temperature=0)
    assert reply.model == str(tiny_folder) and reply.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model=str(tiny_folder), messages=[USER], max_tokens=4,
                                                 temperature=0, stream=True))
    assert chunks and chunks[0].model == str(tiny_folder)


@pytest.mark.slow
def test_a_draft_model_server_answers_and_refuses_alike(tiny_folder):
    """``--draft-model`` (speculative decoding, which mlx-lm serves one request at a time, not batched): it answers
    plain and streamed requests, refuses a prompt beyond the context in OpenAI's shape, and logs no traceback."""
    process = Server(tiny_folder, "--draft-model", str(tiny_folder))
    try:
        status, reply = call(process.port, "POST", "/v1/chat/completions", chat("the hello"))
        assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply
        got = stream(process.port, "/v1/chat/completions", chat("the hello"))
        assert got["done"] and not got["errors"], got
        assert got["text"] == (reply["choices"][0]["message"]["content"] or ""), (got, reply)
        status, reply = call(process.port, "POST", "/v1/chat/completions", chat(LONG))
        assert status == 400 and is_openai_error(reply, "context_length_exceeded"), reply
    finally:
        process.stop()
    assert "Traceback" not in process.text(), process.text()[-4000:]


@pytest.mark.slow
def test_the_memory_probe_needs_the_key_and_clears_the_prompt_cache(served):
    """``GET /kvq/memory`` (on in this server through ``KVQ_SERVE_MEMORY_PROBE=1``) needs the key, and leaves the
    prompt cache empty: a second probe clears nothing."""
    status, reply = call(served.port, "GET", MEMORY_PATH, key=None)
    assert status == 401 and is_openai_error(reply, "invalid_api_key"), reply
    assert call(served.port, "POST", "/v1/chat/completions", chat("the hello"))[0] == 200
    assert memory_probe(served.port)["prompt_cache_cleared"] >= 1
    assert memory_probe(served.port)["prompt_cache_cleared"] == 0


@pytest.mark.slow
def test_sigterm_lets_the_requests_in_flight_finish(served):
    """SIGTERM while 4 streams are in flight: each ends with ``[DONE]``, the port closes, the server exits 0.
    (Last in the module: it ends the shared server.)"""
    results, firsts = [{} for _ in range(4)], [threading.Event() for _ in range(4)]
    body = chat("the the world", max_tokens=CAP, logit_bias={"2": -100})
    readers = [threading.Thread(target=lambda got=got, first=first: got.update(
                   stream(served.port, "/v1/chat/completions", body, first=first)))
               for got, first in zip(results, firsts)]
    for reader in readers:
        reader.start()
    # every stream has its first event before the signal (on a loaded machine a stream could otherwise still be
    # connecting when the server stops accepting: that request was never in flight)
    assert all(first.wait(60) for first in firsts)
    os.kill(served.process.pid, signal.SIGTERM)
    for reader in readers:
        reader.join(60)
    assert served.process.wait(60) == 0, served.text()[-4000:]
    for got in results:
        assert got["status"] == 200 and got["done"] and not got["errors"], got
    in_flight = re.search(r"stopping; (\d+) requests in flight", served.text())
    assert in_flight and int(in_flight[1]) >= 1, served.text()[-4000:]
    with pytest.raises(OSError):
        call(served.port, "GET", "/health", timeout=2)
