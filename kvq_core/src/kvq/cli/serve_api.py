"""What ``kvq serve`` checks in a request before mlx-lm's server sees it, and OpenAI's error shape for what it refuses.

Every refusal is ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status (OpenAI's API reference,
"Error codes"): the official ``openai`` client raises ``BadRequestError`` (400), ``AuthenticationError`` (401),
``NotFoundError`` (404) ... whose message is ``message``. mlx-lm 0.32's server answers ``{"error": "<string>"}``,
which that client shows as ``Error code: 400`` alone, and lets some malformed fields through to its generation thread
(``"messages": "hello"``: ``'str' object has no attribute 'get'``; ``"stop": 5`` stops the thread for good).

Pure functions of the request body and a :class:`ServePolicy`; nothing here touches the network or a model.
"""

from __future__ import annotations

import json
import math

import attrs

#: Request bodies above this many bytes are refused with 413 before they are read (images arrive as data URLs)
MAX_BODY_BYTES = 32 * 2**20

#: Numeric request fields: name -> (int or float, lowest, highest); None = unbounded. OpenAI's ranges where it has
#: the field, mlx-lm's where only it has it (``top_logprobs``: mlx-lm returns at most 11).
NUMBERS = {
    "temperature": (float, 0, 2),
    "top_p": (float, 0, 1),
    "top_k": (int, 0, None),
    "min_p": (float, 0, 1),
    "presence_penalty": (float, -2, 2),
    "frequency_penalty": (float, -2, 2),
    "repetition_penalty": (float, 0, None),
    "repetition_context_size": (int, 0, None),
    "presence_context_size": (int, 0, None),
    "frequency_context_size": (int, 0, None),
    "xtc_probability": (float, 0, 1),
    "xtc_threshold": (float, 0, 1),
    "num_draft_tokens": (int, 0, None),
    "top_logprobs": (int, 0, 11),
    "seed": (int, None, None),
    "n": (int, 1, 1),
}
#: Fields that must be JSON objects when given
OBJECTS = ("role_mapping", "chat_template_kwargs", "logit_bias", "stream_options")
#: Content part types mlx-lm's server understands (text; images where the model has a processor)
PART_TYPES = frozenset({"text", "image_url", "input_image", "image"})
#: mlx-lm's name for "the model given on the command line"
DEFAULT_MODEL = "default_model"


class RequestError(Exception):
    """A request the server refuses: an HTTP ``status`` and OpenAI's error fields (``str(error)`` is the message)."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type

    def body(self) -> dict:
        """The JSON answer: ``{"error": {"message", "type", "param", "code"}}``."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen
class ServePolicy:
    """What ``kvq serve`` enforces on every request, from its command line and the served model's config.json.

    Attributes:
        model_id: the served model's name, listed by ``GET /v1/models`` and put in every answer's ``model``.
        names: every name a request's ``model`` may use for it (``model_id``, the folder path, ``default_model`` ...).
        any_model: answer a request naming any other model with the served one (``--any-model``), not 404.
        api_key: the Bearer token every request but ``/health`` must carry (``--api-key``); None: no check.
        max_tokens_cap: the most tokens a request may ask for (``--max-tokens-cap``); None: no cap.
        context_length: the model's context in tokens (``max_position_embeddings`` or equivalent); None: unknown.
        vocab_size: the model's vocabulary size (bounds ``logit_bias`` token ids); None: unknown.
    """

    model_id: str
    names: frozenset[str] = frozenset()
    any_model: bool = False
    api_key: str | None = None
    max_tokens_cap: int | None = None
    context_length: int | None = None
    vocab_size: int | None = None


#: config.json keys that hold a model's context length, in the order they are read (llama/qwen, gpt2, others)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx",
                "max_seq_len")


def config_context_length(config: dict) -> int | None:
    """The context length in tokens that an mlx-lm ``config.json`` states (also under ``text_config``), or None."""
    for source in (config, config.get("text_config") or {}):
        for key in CONTEXT_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length_error(prompt_tokens: int, context_length: int, param: str) -> RequestError:
    """The refusal of a prompt that leaves no room in the model's context (code ``context_length_exceeded``)."""
    return RequestError(f"This model's maximum context length is {context_length} tokens, and the prompt has "
                        f"{prompt_tokens} tokens: shorten the {param}.", param=param, code="context_length_exceeded")


def parse_body(raw: bytes) -> dict:
    """A request body's JSON object. :raises RequestError: not JSON, or not an object."""
    try:
        body = json.loads(raw)
    except ValueError as exc:  # also bytes that are not UTF-8
        raise RequestError(f"the request body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


def checked_request(body: dict, chat: bool, policy: ServePolicy) -> dict:
    """``body`` checked field by field, as mlx-lm's server should receive it.

    Fields given as JSON null count as absent (OpenAI's meaning); ``model`` becomes mlx-lm's ``default_model`` (so
    no request can make the server load another model); ``stream_options`` gets its ``include_usage``.

    :param chat: a ``/v1/chat/completions`` request (``messages``), else ``/v1/completions`` (``prompt``).
    :raises RequestError: 400 naming the first bad field (``param``), or 404 ``model_not_found``.
    """
    body = {k: v for k, v in body.items() if v is not None}
    check_model(body, policy)
    check_messages(body.get("messages")) if chat else check_prompt(body.get("prompt"))
    check_max_tokens(body, policy.max_tokens_cap)
    for name in ("stream", "logprobs"):
        if name in body and not isinstance(body[name], bool):
            raise RequestError(f"{name} must be true or false, not {body[name]!r}", param=name)
    for name, (kind, low, high) in NUMBERS.items():
        if name in body:
            check_number(name, body[name], kind, low, high)
            body[name] = kind(body[name])  # mlx-lm takes only floats for some (xtc_probability)
    for name in OBJECTS:
        if name in body and not isinstance(body[name], dict):
            raise RequestError(f"{name} must be a JSON object", param=name)
    check_stop(body.get("stop"))
    check_logit_bias(body.get("logit_bias"), policy.vocab_size)
    if "tools" in body and not (isinstance(body["tools"], list) and all(isinstance(t, dict) for t in body["tools"])):
        raise RequestError("tools must be a list of objects", param="tools")
    if "stream_options" in body:
        include = body["stream_options"].get("include_usage", False)
        if not isinstance(include, bool):
            raise RequestError("stream_options.include_usage must be true or false", param="stream_options")
        body["stream_options"] = {**body["stream_options"], "include_usage": include}
    return body


def check_model(body: dict, policy: ServePolicy) -> None:
    """Refuse a request for another model (404 ``model_not_found``) or another adapter or draft model (400), then
    point ``body`` at the served one: mlx-lm's server would unload it and try the Hub for any other name."""
    model = body.get("model", DEFAULT_MODEL)
    if not isinstance(model, str):
        raise RequestError(f"model must be a string, not {model!r}", param="model")
    if model not in policy.names and model != DEFAULT_MODEL and not policy.any_model:
        raise RequestError(f"The model '{model}' does not exist: this server serves '{policy.model_id}' alone "
                           "(GET /v1/models)", status=404, param="model", code="model_not_found")
    for name in ("adapters", "draft_model"):
        if body.get(name, DEFAULT_MODEL) != DEFAULT_MODEL:
            raise RequestError(f"{name} is fixed by the server's command line and cannot be chosen per request",
                               param=name)
    body["model"] = DEFAULT_MODEL


def check_messages(messages) -> None:
    """``messages``: a non-empty list of objects, each with a string ``role`` and a ``content`` that is a string, a
    list of content parts or (an assistant's turn only) absent."""
    if not isinstance(messages, list) or not messages:
        what = "missing" if messages is None else f"{type(messages).__name__} {messages!r:.40}"
        raise RequestError(f"messages must be a non-empty list of message objects (got {what})", param="messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with role and content", param=where)
        if not isinstance(message.get("role"), str) or not message["role"]:
            raise RequestError(f"{where}.role must be a non-empty string", param=f"{where}.role")
        content = message.get("content")
        if content is None and message["role"] != "assistant":
            raise RequestError(f"{where}.content is required for role {message['role']!r}", param=f"{where}.content")
        if isinstance(content, list):
            check_parts(content, f"{where}.content")
        elif content is not None and not isinstance(content, str):
            raise RequestError(f"{where}.content must be a string or a list of content parts",
                               param=f"{where}.content")
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise RequestError(f"{where}.tool_calls must be a list of objects", param=f"{where}.tool_calls")


def check_parts(parts: list, where: str) -> None:
    """A message's list of content parts: objects of a known ``type``; text parts carry a string ``text``."""
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in PART_TYPES:
            raise RequestError(f"{where}[{j}] must be a content part with type one of {sorted(PART_TYPES)}",
                               param=f"{where}[{j}]")
        if part["type"] == "text" and not isinstance(part.get("text"), str):
            raise RequestError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")


def check_prompt(prompt) -> None:
    """``prompt`` of ``/v1/completions``: a non-empty string (mlx-lm takes no lists of prompts or token ids)."""
    if not isinstance(prompt, str) or not prompt:
        what = "missing" if prompt is None else f"{type(prompt).__name__} {prompt!r:.40}"
        raise RequestError(f"prompt must be a non-empty string (got {what}; lists of prompts or token ids are not "
                           "supported)", param="prompt")


def check_max_tokens(body: dict, cap: int | None) -> None:
    """``max_tokens`` and ``max_completion_tokens``: positive integers, at most the operator's ``cap``."""
    for name in ("max_tokens", "max_completion_tokens"):
        if name in body:
            check_number(name, body[name], int, 1, None)
            if cap is not None and body[name] > cap:
                raise RequestError(f"{name} is {body[name]}, above this server's cap of {cap} "
                                   "(kvq serve --max-tokens-cap)", param=name)


def check_number(name: str, value, kind: type, low, high) -> None:
    """``value`` is an int (``kind`` int) or any finite number (``kind`` float), not a bool, within [low, high]."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or (kind is int and not isinstance(value, int)) or not math.isfinite(value):
        raise RequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, not {value!r}",
                           param=name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"between {low} and {high}" if low is not None and high is not None else \
            f"at least {low}" if low is not None else f"at most {high}"
        raise RequestError(f"{name} must be {bounds}, not {value!r}", param=name)


def check_stop(stop) -> None:
    """``stop``: a non-empty string or a list of them."""
    words = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(words, list) and all(isinstance(w, str) and w for w in words)):
        raise RequestError("stop must be a non-empty string or a list of non-empty strings", param="stop")


def check_logit_bias(bias, vocab_size: int | None) -> None:
    """``logit_bias``: token ids (as strings, inside the vocabulary) to numbers in [-100, 100]."""
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise RequestError(f"logit_bias keys must be token ids, not {key!r}", param="logit_bias") from None
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise RequestError(f"logit_bias token id {token} is outside the vocabulary", param="logit_bias")
        check_number(f"logit_bias[{key}]", value, float, -100, 100)
