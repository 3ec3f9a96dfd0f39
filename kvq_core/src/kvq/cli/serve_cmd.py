"""``kvq serve``: mlx-lm's HTTP server (its OpenAI-style API, batching and prompt cache) with kvq caches.

    kvq serve --model M --method turboquant --bits 4 --port 8080
    mlx.launch --backend ring -n 2 -- python -m kvq.cli serve --model M --method turboquant --bits 4

The cache options (``--method``, ``--bits``, ``--param``, ``--key-method`` ... ``--sinks``, ``--window``,
``--kernels``) are kvq's, as in ``kvq generate`` (a method calibrated per model, ``vecinfer``, uses ``--model``'s
calibration unless ``--param model_id=...`` names another); every other option goes to ``mlx_lm.server`` unchanged (see
``mlx_lm.server --help``: ``--host``, ``--port``, ``--max-tokens``, ``--temp`` ...). ``--model`` is resolved as by
``kvq generate`` (default model, mlx-lm folder, GGUF file, Hub id). The server is mlx-lm's own: kvq only makes
the loaded model's ``make_cache()`` return kvq caches (:func:`kvq.patch_model`), which mlx-lm's
request loop, ``BatchGenerator`` and prompt-cache reuse then use. Under ``mlx.launch`` mlx-lm shards the model
(tensor parallel, or ``--pipeline``), rank 0 serves HTTP and every rank builds its kvq caches.

The HTTP side is mlx-lm's request handler subclassed (:mod:`kvq.cli.serve_handler`, for mlx-lm 0.32): requests
are checked before mlx-lm sees them and refused in OpenAI's error shape (``{"error": {"message", "type", "param",
"code"}}``, which the official ``openai`` client shows); the server serves its one model (``GET /v1/models`` lists
it; a request naming another gets 404 ``model_not_found``, or with ``--any-model`` the served model's answer, and
never unloads it); a prompt beyond the model's context is refused (``context_length_exceeded``); ``--api-key`` asks
every request but ``/health`` for ``Authorization: Bearer KEY``; SIGTERM lets the requests in flight finish.
A request served from a stored prompt cache (``kvq.cache.reuse``), or with its prompt chunked otherwise, gets the
cache a fresh run would build, up to float rounding. That rounding can differ with the batch a request runs in, as
with mlx-lm's own caches, and a quantized cache amplifies it wherever a value rounds to the other code, so logits
move slightly (docs/usage.md, "Batches, chunks and float rounding").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from .argtypes import non_negative_float, positive_int
from .generate_cmd import add_cache_arguments
from .serve_api import DEFAULT_MODEL, ServePolicy, config_context_length


def plain_text(doc: str) -> str:
    """``doc`` (reStructuredText) as ``--help`` shows it: ``:func:`name``` and ````name```` as name."""
    return re.sub(r"``([^`]+)``", r"\1", re.sub(r":\w+:`~?([^`]+)`", r"\1", doc))


def build_parser() -> argparse.ArgumentParser:
    """The ``kvq serve`` argument parser (kvq's options only; the others are passed on to mlx-lm)."""
    p = argparse.ArgumentParser(prog="kvq serve", description=plain_text(__doc__),
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=PASSED_ON)
    add_cache_arguments(p)
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: pipeline parallel (each rank its own layers), not tensor parallel")
    p.add_argument("--api-key", default=os.environ.get("KVQ_SERVE_API_KEY"),
                   help="requests must send 'Authorization: Bearer KEY' (default: $KVQ_SERVE_API_KEY; none: no check)")
    p.add_argument("--any-model", action="store_true",
                   help="answer a request naming any model with the served one (default: 404 model_not_found)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=None, metavar="N",
                   help="refuse requests for more than N tokens (and lower mlx-lm's --max-tokens default to N)")
    p.add_argument("--drain-seconds", type=non_negative_float, default=30.0, metavar="S",
                   help="on SIGTERM or Ctrl-C, wait up to S seconds for the requests in flight (default 30)")
    return p


#: What ``kvq serve --help`` says of the options it passes on (mlx-lm's parser is built only when the server starts).
PASSED_ON = ("Every other option goes to mlx_lm.server unchanged, among them --host, --port, --max-tokens, --temp, "
             "--top-p, --prompt-cache-size, --prompt-cache-bytes, --decode-concurrency, --prompt-concurrency, "
             "--prefill-step-size, --log-level (mlx_lm.server --help lists them all). --kv-bits is refused: kvq "
             "compresses the cache itself (--method, --bits), and mlx-lm would serve requests one at a time.")


def check_passed_on(rest: list[str], options: dict) -> None:
    """Refuse mlx-lm server options that cannot work with kvq's caches, before the model is loaded.

    ``--kv-bits`` asks mlx-lm to quantize each cache once it holds ``--quantized-kv-start`` tokens (5000 by
    default): a kvq cache refuses that unless it already holds exactly that (:meth:`kvq.cache.protocol.
    CacheProtocol.to_quantized`), so long prompts would fail with HTTP 500 after the server started, and mlx-lm
    serves requests one at a time with it. kvq's own options give what it asks for, batched.

    :param options: the cache's :func:`kvq.cli.generate_cmd.cache_options`, named in the message by
        :func:`kvq.cli.generate_cmd.cache_label` (as the server's log names them).
    :raises ValueError: ``--kv-bits`` among ``rest`` (the message names the kvq options that do the same).
    """
    from .generate_cmd import cache_label

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--kv-bits", default=None)
    parser.add_argument("--kv-group-size", default="64")
    given, _ = parser.parse_known_args(rest)
    if given.kv_bits is not None:
        raise ValueError(f"--kv-bits {given.kv_bits}: kvq serve's caches are compressed already "
                         f"({cache_label(options)}); mlx-lm's --kv-bits would "
                         f"quantize them a second time (kvq refuses: requests would fail once a prompt passes "
                         f"--quantized-kv-start) and would serve requests one at a time. Drop --kv-bits; for the "
                         f"layout it names use --method affine --bits {given.kv_bits} --param "
                         f"group_size={given.kv_group_size}")


def serve_policy(args: argparse.Namespace, path: Path) -> ServePolicy:
    """What the server enforces, from ``kvq serve``'s options and the model folder ``path``'s config.json: the
    served model's id (``--model`` as given, or the default model's name) and every name that means it."""
    from .. import models

    config = json.loads((path / "config.json").read_text())
    model_id = args.model or models.DEFAULT_MODEL
    names = {model_id, DEFAULT_MODEL, str(path), str(path.resolve()), path.name}
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return ServePolicy(model_id=model_id, names=frozenset(names), any_model=args.any_model, api_key=args.api_key,
                       max_tokens_cap=args.max_tokens_cap, context_length=config_context_length(config),
                       vocab_size=vocab if isinstance(vocab, int) else None)


def check_sharding(path: Path, pipeline: bool, num_ranks: int) -> None:
    """Refuse before the server starts what would otherwise fail in its generation thread.

    :raises ValueError: tensor parallel over a group size that does not divide the KV heads of ``path``'s
        config.json (:func:`kvq.distributed.check_tensor_parallel`), or pipeline parallel on a folder without the
        ``model.safetensors.index.json`` that ``mlx_lm.utils.sharded_load`` reads.
    """
    from ..distributed import check_tensor_parallel

    if num_ranks == 1:
        return
    if pipeline:
        if not (path / "model.safetensors.index.json").is_file():
            raise ValueError(f"--pipeline: mlx-lm's sharded loading needs model.safetensors.index.json in {path} "
                             "(mlx_lm.convert and mlx_lm.utils.save_model write it)")
        return
    config = json.loads((path / "config.json").read_text())
    heads = config.get("num_attention_heads")
    if heads:
        check_tensor_parallel(config.get("num_key_value_heads") or heads, heads, num_ranks)


def provider_class(options: dict):
    """A subclass of ``mlx_lm.server.ModelProvider`` whose loaded models make kvq caches with ``options``."""
    from mlx_lm import server

    from .. import distributed
    from ..cache import patch_model
    from .generate_cmd import cache_label

    class KVQModelProvider(server.ModelProvider):
        """mlx-lm's model provider; each loaded model's ``make_cache()`` returns this rank's kvq caches."""

        def _load(self, *args, **kwargs):
            super()._load(*args, **kwargs)
            patch_model(self.model, **options)
            caches = self.model.make_cache()
            self.is_batchable = self.draft_model is None and all(hasattr(c, "merge") for c in caches)
            heads = distributed.kv_head_range(self.model)
            logging.info(f"kvq serve: kvq caches of {cache_label(options)} for every request: {len(caches)} "
                         f"layers on this rank" + (f", KV heads {heads[0]}:{heads[1]}" if heads else ""))
            first = next((c for c in caches if hasattr(c, "config")), None)
            if first is not None:  # short chats stay uncompressed (kvq generate prints a NOTE when that happens)
                from ..cache.schedule import first_flush, most_held

                config = first.config
                flush = config.flush_tokens  # --flush made a multiple of the methods' blocks (QJL's groups)
                logging.info(f"kvq serve: each sequence's first {config.sinks} tokens (sinks) and up to its newest "
                             f"{most_held(config.window, flush)} (the window, flushed {flush} at a "
                             f"time) stay in 16 bits: a conversation compresses from "
                             f"{first_flush(config.sinks, config.window, flush)} tokens on (--sinks, "
                             f"--window, --flush)")

    return KVQModelProvider


def scan_or_empty(scan):
    """``scan`` (huggingface_hub's ``scan_cache_dir``, which mlx-lm's ``GET /v1/models`` calls) made to answer an
    empty cache where the machine has no Hugging Face hub folder (``CacheNotFound``) instead of raising: the
    endpoint then lists the served model alone, with no traceback in the log."""
    from huggingface_hub.errors import CacheNotFound

    def scan_cache_dir(*args, **kwargs):
        try:
            return scan(*args, **kwargs)
        except CacheNotFound:  # mlx-lm reads only ``repos`` (HFCacheInfo's other fields vary by version)
            return SimpleNamespace(repos=frozenset(), size_on_disk=0, warnings=[])

    return scan_cache_dir


def main(argv: list[str]) -> int:
    """Run ``kvq serve`` until interrupted; returns 0.

    :raises ValueError: an mlx-lm whose server kvq was not written for
        (:func:`kvq.cli.serve_handler.check_mlx_lm_version`), bad method or parameters, an unknown model, a
        sharding that cannot work (see :func:`check_sharding`), or a port that cannot be bound; the dispatcher
        prints it as one line and exits 1.
    :raises TypeError: an unknown parameter name.
    """
    import functools

    import mlx.core as mx
    import mlx_lm
    from mlx_lm import server

    from .. import models
    from ..cache import make_config
    from . import serve_handler, serve_run
    from .generate_cmd import cache_options

    args, rest = build_parser().parse_known_args(argv)
    serve_handler.check_mlx_lm_version(mlx_lm.__version__)
    options = cache_options(args)
    make_config(**options)  # bad methods and parameters fail before the model is loaded
    check_passed_on(rest, options)
    path = models.resolve_model(args.model)
    check_sharding(path, args.pipeline, mx.distributed.init().size())
    run = functools.partial(serve_run.run, policy=serve_policy(args, path), drain_seconds=args.drain_seconds)
    saved = server.ModelProvider, server.scan_cache_dir, server.run, sys.argv
    server.ModelProvider, server.run = provider_class(options), run
    server.scan_cache_dir = scan_or_empty(server.scan_cache_dir)
    sys.argv = ["kvq serve", "--model", str(path), *(["--pipeline"] * args.pipeline), *rest]
    try:
        server.main()
    finally:
        server.ModelProvider, server.scan_cache_dir, server.run, sys.argv = saved
    return 0
