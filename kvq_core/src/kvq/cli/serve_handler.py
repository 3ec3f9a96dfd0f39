"""``kvq serve``'s HTTP side: subclasses of mlx-lm's request handler and response generator.

What they add to mlx-lm's server (issue #54):

- a request checked before mlx-lm sees it (:func:`kvq.cli.serve_api.checked_request`); every refusal in OpenAI's
  error shape with its HTTP status, a failure in the middle of a stream as an SSE ``data: {"error": ...}`` event;
- one served model: a request naming another gets 404 ``model_not_found`` (or, with ``--any-model``, the served
  model's answer) and never makes the server unload it;
- a prompt that does not fit the model's context refused (``context_length_exceeded``), and a completion stopped
  where the context ends (``finish_reason`` ``length``);
- ``--api-key``: a Bearer token on every request but ``/health`` (401 otherwise);
- a count of the requests in flight, which SIGTERM lets finish (:mod:`kvq.cli.serve_run`); a client that
  disconnects stops its generation within a few tokens, streamed or not (:class:`ClientWatch`, then mlx-lm's
  ``ctx.stop()``), logged in one line;
- with ``KVQ_SERVE_MEMORY_PROBE=1`` in its environment (load tests and benchmarks only), ``GET /kvq/memory``: the
  prompt cache cleared and MLX's active memory in the server process (:meth:`KVQHandler.send_memory`).

It subclasses mlx-lm 0.32's server: :data:`MLX_LM_RELIES_ON` lists what it overrides or calls there, and
``tests/test_serve_hardened.py`` fails when an installed mlx-lm no longer has it. :mod:`kvq.cli.serve_run` runs
them.
"""

from __future__ import annotations

import gc
import hmac
import io
import json
import logging
import os
import select
import socket
import threading
import urllib.parse

import mlx.core as mx
from mlx_lm import server

from .serve_api import MAX_BODY_BYTES, RequestError, ServePolicy, checked_request, context_length_error, parse_body

#: mlx-lm versions whose server these subclasses were written and tested against (version prefixes)
MLX_LM_VERSIONS = ("0.32.",)
#: What the subclasses override or call in ``mlx_lm.server``: name -> its parameter names there
MLX_LM_RELIES_ON = {
    "APIHandler.__init__": ("self", "response_generator", "args", "system_fingerprint", "kwargs"),
    "APIHandler.do_POST": ("self",),
    "APIHandler.handle_completion": ("self", "request", "stop_words"),
    "APIHandler.generate_response": ("self", "text", "finish_reason", "prompt_token_count",
                                     "completion_token_count", "prompt_cache_count", "token_logprobs", "top_tokens",
                                     "tokens", "tool_calls", "reasoning_text"),
    "APIHandler.completion_usage_response": ("self", "prompt_token_count", "completion_token_count",
                                             "prompt_cache_count"),
    "APIHandler.handle_health_check": ("self",),
    "APIHandler._set_cors_headers": ("self",),
    "ResponseGenerator.__init__": ("self", "model_provider", "prompt_cache"),
    "ResponseGenerator._tokenize": ("self", "tokenizer", "request", "args"),
    "ResponseGenerator.generate": ("self", "request", "generation_args", "progress_callback"),
    "ResponseGenerator.stop_and_join": ("self",),
    "ResponseGenerator.join": ("self",),
    "ModelProvider._load": ("self", "model_path", "adapter_path", "draft_model_path"),
    "LRUPromptCache.__init__": ("self", "max_size", "max_bytes"),
    "LRUPromptCache.trim_to": ("self", "n_sequences", "n_bytes"),
    "get_system_fingerprint": (),
    "run": ("host", "port", "model_provider", "server_class", "handler_class"),
}
#: Seconds one read or write on a client's socket may block (a client that stalls is dropped)
SOCKET_TIMEOUT = 120
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
TEXT_PATHS = ("/v1/completions",)
#: The environment variable that turns ``GET /kvq/memory`` on (off unless it is ``1``)
MEMORY_PROBE = "KVQ_SERVE_MEMORY_PROBE"
MEMORY_PATH = "/kvq/memory"


def check_mlx_lm_version(version: str) -> None:
    """Refuse an mlx-lm whose server the subclasses were not written for (``KVQ_SERVE_ANY_MLX_LM=1`` overrides).

    :raises ValueError: ``version`` matches none of :data:`MLX_LM_VERSIONS`.
    """
    if version.startswith(MLX_LM_VERSIONS) or os.environ.get("KVQ_SERVE_ANY_MLX_LM") == "1":
        return
    wanted = ", ".join(v + "x" for v in MLX_LM_VERSIONS)
    raise ValueError(f"kvq serve subclasses mlx-lm {wanted}'s server and mlx-lm {version} is installed: install "
                     f"one of those (or set KVQ_SERVE_ANY_MLX_LM=1 to try anyway)")


class Refusal(BaseException):
    """A :class:`RequestError` on its way out of mlx-lm's ``handle_completion``: that method answers any
    ``Exception`` of the generator with 404 and a bare string, so the refusal passes it as a ``BaseException`` and
    :meth:`KVQHandler.handle_completion` answers it."""

    def __init__(self, error: RequestError):
        super().__init__(str(error))
        self.error = error


class InFlight:
    """How many requests are being answered (a context manager counts one); :meth:`wait_idle` waits for none."""

    def __init__(self):
        self.count = 0
        self._changed = threading.Condition()

    def __enter__(self):
        with self._changed:
            self.count += 1

    def __exit__(self, *exc_info):
        with self._changed:
            self.count -= 1
            self._changed.notify_all()

    def wait_idle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for no request in flight; whether there is none."""
        with self._changed:
            return self._changed.wait_for(lambda: self.count == 0, seconds)


class KVQResponseGenerator(server.ResponseGenerator):
    """mlx-lm's response generator; a prompt longer than ``context_length`` tokens is refused, a completion stops
    where the context ends, and every failure reaches the handler as a :class:`Refusal`."""

    def __init__(self, model_provider, prompt_cache, context_length: int | None = None):
        self.context_length = context_length  # before mlx-lm's __init__, which starts the generation thread
        super().__init__(model_provider, prompt_cache)

    def _tokenize(self, tokenizer, request, args):
        """mlx-lm's tokenization (in the generation thread); its errors and a prompt too long become
        :class:`RequestError` (400), and ``args.max_tokens`` is cut to the room left in the context."""
        param = "messages" if request.request_type == "chat" else "prompt"
        try:
            tokenized = super()._tokenize(tokenizer, request, args)
        except Exception as exc:  # the chat template or a content part refused the request
            raise RequestError(f"the {param} could not be made into a prompt: {exc}", param=param) from exc
        size = len(tokenized[0])
        if self.context_length is not None:
            if size >= self.context_length:
                raise context_length_error(size, self.context_length, param)
            args.max_tokens = min(args.max_tokens, self.context_length - size)
        return tokenized

    def generate(self, request, generation_args, progress_callback=None):
        """mlx-lm's ``generate``; a request refused or failed before its first token raises :class:`Refusal`."""
        try:
            return super().generate(request, generation_args, progress_callback)
        except RequestError as error:
            raise Refusal(error) from error
        except Exception as exc:
            logging.error("kvq serve: generation failed", exc_info=exc)
            raise Refusal(RequestError(f"generation failed: {exc}", status=500, type="server_error")) from exc


def client_gone(connection: socket.socket) -> bool:
    """Whether the client closed ``connection`` (end of file or reset waiting, without blocking). A client that only
    shut its sending side counts as gone too: HTTP clients do not do that while they wait for an answer."""
    try:
        if not select.select([connection], [], [], 0)[0]:
            return False
        return connection.recv(1, socket.MSG_PEEK) == b""
    except (ConnectionError, OSError):
        return True


class ClientWatch:
    """The response generator as one request's handler sees it: every ``every`` tokens its answer checks that the
    client is still there, and raises ``ConnectionResetError`` if not (mlx-lm then stops that generation), so a
    client that leaves frees its slot before the first write fails, also when not streaming."""

    def __init__(self, generator, connection: socket.socket, every: int = 4):
        self._generator, self._connection, self._every = generator, connection, every

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, request, generation_args, progress_callback=None):
        """The generator's ``(ctx, responses)``, the responses watched."""
        ctx, responses = self._generator.generate(request, generation_args, progress_callback)
        return ctx, self._watched(responses)

    def _watched(self, responses):
        for i, response in enumerate(responses):
            if i % self._every == 0 and client_gone(self._connection):
                raise ConnectionResetError("the client closed the connection")
            yield response


class KVQHandler(server.APIHandler):
    """mlx-lm's request handler with kvq serve's checks; ``policy`` and ``in_flight`` are set by
    :func:`handler_class`."""

    policy: ServePolicy
    in_flight: InFlight
    timeout = SOCKET_TIMEOUT

    def send_json(self, status: int, body: dict, headers: tuple = ()) -> None:
        """Answer ``body`` as JSON with ``status`` and a Content-Length."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self._set_cors_headers()
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def send_refusal(self, error: RequestError) -> None:
        """Answer ``error`` in OpenAI's shape, logged in one line."""
        logging.info(f"kvq serve: {self.command} {self.path}: {error.status} {error.code or error.type}: {error}")
        self.send_json(error.status, error.body(), (("WWW-Authenticate", "Bearer"),) if error.status == 401 else ())

    def check_api_key(self) -> None:
        """:raises RequestError: 401 ``invalid_api_key`` when ``--api-key`` is set and the request lacks it."""
        key = self.policy.api_key
        if key is None:
            return
        given = self.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode()):
            return
        message = "Incorrect API key provided" if given else \
            "You didn't provide an API key: send the header 'Authorization: Bearer KEY'"
        raise RequestError(message, status=401, code="invalid_api_key")

    def read_body(self) -> bytes:
        """The request's body, read by its Content-Length.

        :raises RequestError: no Content-Length (411), one that is not a byte count (400) or above
            ``MAX_BODY_BYTES`` (413).
        """
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("the request needs a Content-Length header", status=411)
        if not length.strip().isdigit():
            raise RequestError(f"Content-Length {length!r} is not a byte count")
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the request body of {length} bytes is above {MAX_BODY_BYTES}", status=413)
        return self.rfile.read(int(length))

    def do_POST(self):
        """A completion: checked here, then answered by mlx-lm's ``do_POST`` from the checked body."""
        try:
            raw = self.read_body()  # first: a body left unread makes the closing socket reset the client's
            self.check_api_key()
            if self.path not in CHAT_PATHS + TEXT_PATHS:
                raise RequestError(f"Invalid URL (POST {self.path})", status=404, code="unknown_url")
            body = checked_request(parse_body(raw), self.path in CHAT_PATHS, self.policy)
        except RequestError as error:
            return self.send_refusal(error)
        data = json.dumps(body).encode()
        socket_file, self.rfile = self.rfile, io.BytesIO(data)
        self.headers.replace_header("Content-Length", str(len(data)))
        generator, self.response_generator = self.response_generator, ClientWatch(self.response_generator,
                                                                                  self.connection)
        try:
            with self.in_flight:
                super().do_POST()
        finally:
            self.rfile, self.response_generator = socket_file, generator

    def handle_completion(self, request, stop_words):
        """mlx-lm's ``handle_completion``; a refusal is answered in OpenAI's shape, a client gone is logged in a
        line (mlx-lm has stopped its generation), a failure mid-answer becomes a 500 or an SSE error event."""
        try:
            super().handle_completion(request, stop_words)
        except Refusal as refusal:
            self.send_refusal(refusal.error)
        except ConnectionError:
            logging.info(f"kvq serve: the client of {self.path} went away; its generation stopped")
        except Exception as exc:
            logging.error("kvq serve: generation failed mid-answer", exc_info=exc)
            self.send_failure(RequestError(f"generation failed: {exc}", status=500, type="server_error"))

    def send_failure(self, error: RequestError) -> None:
        """``error`` after the answer began: an SSE ``data: {"error": ...}`` event in a stream (the ``openai``
        client raises ``APIError`` with its message), else a 500 in place of the unsent 200."""
        try:
            if self.stream:
                self.wfile.write(f"data: {json.dumps(error.body())}\n\n".encode())
                self.wfile.flush()
            else:
                self._headers_buffer = []  # http.server's unsent header lines (the 200 status line)
                self.send_json(error.status, error.body())
        except ConnectionError:
            pass

    def generate_response(self, *args, **kwargs) -> dict:
        """mlx-lm's answer (or stream chunk), naming the served model."""
        return {**super().generate_response(*args, **kwargs), "model": self.policy.model_id}

    def completion_usage_response(self, *args, **kwargs) -> dict:
        """mlx-lm's usage chunk of a stream, naming the served model and of the request's object type."""
        response = super().completion_usage_response(*args, **kwargs)
        kind = "text_completion" if self.object_type == "text_completion" else "chat.completion.chunk"
        return {**response, "model": self.policy.model_id, "object": kind}

    def do_GET(self):
        """``/health`` (no key needed), ``/v1/models`` and ``/v1/models/ID`` (the served model alone); ``/kvq/memory``
        when :data:`MEMORY_PROBE` is ``1``."""
        path = urllib.parse.urlsplit(self.path).path
        if path == "/health":
            return self.handle_health_check()
        try:
            self.check_api_key()
            if path == "/v1/models":
                return self.send_json(200, {"object": "list", "data": [self.model_object()]})
            if path == MEMORY_PATH and os.environ.get(MEMORY_PROBE) == "1":
                return self.send_memory()
            if path.startswith("/v1/models/"):
                name = urllib.parse.unquote(path[len("/v1/models/"):])
                if name in self.policy.names:
                    return self.send_json(200, self.model_object())
                raise RequestError(f"The model '{name}' does not exist: this server serves "
                                   f"'{self.policy.model_id}' alone", status=404, code="model_not_found")
            raise RequestError(f"Invalid URL (GET {self.path})", status=404, code="unknown_url")
        except RequestError as error:
            self.send_refusal(error)

    def send_memory(self) -> None:
        """``GET /kvq/memory``: once no request is in flight (up to a minute; else 409 ``busy``), the prompt cache is
        cleared and MLX's buffer cache emptied; answers ``active_memory`` (bytes of MLX arrays alive in the server
        then: the model, and whatever requests left behind), ``peak_memory``, ``prompt_cache_cleared`` (entries) and
        ``prompt_cache_bytes`` (what they held). mlx-lm's generation thread keeps referencing the rows that
        finished in its last step (its loop's variables) until it takes the next request: answer one fixed short
        request before probing to make that part the same from probe to probe.

        :raises RequestError: requests still in flight after a minute.
        """
        if not self.in_flight.wait_idle(60):
            raise RequestError("requests are in flight: try again", status=409, code="busy")
        cache = self.response_generator.prompt_cache
        cleared, held = len(cache), cache.nbytes
        cache.trim_to(n_sequences=0)
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        self.send_json(200, {"active_memory": mx.get_active_memory(), "peak_memory": mx.get_peak_memory(),
                             "prompt_cache_cleared": cleared, "prompt_cache_bytes": held})

    def model_object(self) -> dict:
        """The served model as OpenAI's model object."""
        return {"id": self.policy.model_id, "object": "model", "created": self.created, "owned_by": "kvq"}


def handler_class(policy: ServePolicy) -> type[KVQHandler]:
    """A :class:`KVQHandler` subclass enforcing ``policy``, with its own in-flight count."""
    return type("KVQHandler", (KVQHandler,), {"policy": policy, "in_flight": InFlight()})
