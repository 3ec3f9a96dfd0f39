"""``kvq eval --methods kvcache,affine:4,...``: quality and memory of methods on a model, against mlx-lm's KVCache.

Protocol (the one of the published KV-quantization perplexity tables): windows of the text at fixed offsets; each
window's context is prefilled in chunks of 512, then the next --score-tokens are scored by teacher forcing. Where the
model's tokenizer adds a BOS token to a text (Gemma's; SmolLM2's and Qwen2's add none), each window and needle prompt
starts with it, in place of the window's first text token (same length; the BOS is never scored). Per method,
against the reference (kvcache: mlx-lm's KVCache in the model's dtype) on the same tokens in the same run:
perplexity and its change, mean KL(kvcache || method), top-1 agreement, attention-output error per layer, needle
retrieval, bits per coordinate, KV bytes (nbytes and measured).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from ..cache import method_string
from ..evaluation import spec as spec_module
from .argtypes import add_layout_options

EPILOG = "method strings:\n" + method_string.__doc__.split("Grammar", 1)[1].split("\n", 1)[1] + """
A method calibrated per model (vecinfer) uses the calibration of --model unless [model_id=...] names another.
The reference, kvcache (mlx-lm's KVCache in the model's dtype; fp16 is its older name, kvq-fp16 kvq's 16-bit cache),
is always run first (added if not listed). kvq caches keep --sinks first and
--window last tokens uncompressed; their bits per coordinate exclude those tokens (the table also gives the
effective bits at the context length); the window grows to --window + flush - 1 tokens before its oldest flush
tokens are compressed together (--flush, 128 by default: kvq.defaults.DEFAULT_FLUSH; per method with [flush=N],
e.g. turboquant:3[flush=1]). mlx-affine quantizes every token.
"""


def _depths(text: str) -> tuple[float, ...]:
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        depths = tuple(float(v) for v in text.split(","))
    except ValueError:
        depths = (-1.0,)
    if not all(0 <= d <= 1 for d in depths):
        raise ValueError(f"--needle-depths must be numbers in 0..1 separated by commas (or 'none'); got {text!r}")
    return depths


def _text(path: str | None) -> tuple[str, str]:
    if path is None:
        from ..textdata import language_reference

        text, source = language_reference(), "Python language reference (pydoc_data.topics, sorted, joined)"
    else:
        try:
            text, source = Path(path).read_text(encoding="utf-8"), str(path)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--text: cannot read {path}: {exc}") from None
    if not text.strip():
        raise ValueError(f"--text: {source} is empty")
    return text, source


def _model_config(name: str | None) -> tuple[Path, dict]:
    from ..models import resolve_model

    path = resolve_model(name)
    config = json.loads((path / "config.json").read_text())
    config = config.get("text_config", config)
    return path, config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq eval", description=__doc__, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name, folder, .gguf or Hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--methods", required=True, help="comma-separated method strings (see below)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: the Python language reference)")
    p.add_argument("--context", default="2048", help="context lengths, comma-separated, K suffix allowed (default 2048)")
    p.add_argument("--windows", type=int, default=3, help="text windows per context (default 3)")
    p.add_argument("--score-tokens", type=int, default=256, help="tokens scored per window (default 256)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk size (default 512)")
    add_layout_options(p)
    p.add_argument("--flush", type=int, default=None,
                   help="kvq caches: tokens compressed together as they leave the window (default 128, "
                        "kvq.defaults.DEFAULT_FLUSH; a method string's [flush=N] wins)")
    p.add_argument("--needle-depths", default="0.1,0.5,0.9", help="needle trials, depths in 0..1 ('none': skip)")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON (after every method)")
    p.add_argument("--markdown", default=None, metavar="OUT", help="write the tables as markdown")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="plot PPL change and KL vs bits per coordinate")
    p.add_argument("--mlx-quantized-matmul", action="store_true",
                   help="mlx-affine attention through mlx-lm's quantized_matmul path even on CPU (slow there; the "
                        "default on CPU is dequantize + float attention, the same products)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def check(args) -> tuple[list, list[int], str, str, Path, dict]:
    """Every input check that needs no model weights. :raises ValueError: the first bad input, named."""
    from ..bench.ops import parse_sizes

    contexts = list(parse_sizes(args.context, "--context"))
    for name in ("windows", "score_tokens", "chunk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    for name in ("sinks", "window"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be an integer >= 0; got {getattr(args, name)}")
    if args.flush is not None and args.flush < 1:
        raise ValueError(f"--flush must be an integer >= 1; got {args.flush}")
    _depths(args.needle_depths)
    text, source = _text(args.text)
    specs = spec_module.parse_methods(args.methods, sinks=args.sinks, window=args.window)
    path, config = _model_config(args.model)
    limit = config.get("max_position_embeddings")
    if limit is not None and max(contexts) > limit:
        raise ValueError(f"--context {max(contexts)} is longer than the model's max_position_embeddings ({limit})")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    # validated for this model; a method calibrated per model (vecinfer) uses --model's calibration by default
    specs = [spec_module.spec_for_model(spec, args.model, head_dim, args.sinks, args.window) for spec in specs]
    for spec in specs:
        if args.flush is not None and not (spec.is_mlx or spec.is_reference):
            spec.cache_options.setdefault("flush", args.flush)  # the method string's own [flush=N] wins
    return specs, contexts, text, source, path, config


def _check_mlx_sinks(specs, model) -> None:
    """:raises ValueError: an mlx-affine row on a model with learned attention-sink logits (gpt-oss), which
        mlx-lm's quantized attention refuses ("Quantized SDPA does not support attention sinks"): named before
        any work, instead of after the rows before it."""
    import mlx.core as mx

    if not any(isinstance(getattr(layer.self_attn, "sinks", None), mx.array) for layer in model.layers):
        return
    for spec in specs:
        if spec.is_mlx or spec.value_method == spec_module.MLX_AFFINE:
            raise ValueError(f"method {spec.label!r}: mlx-lm's quantized attention does not support learned "
                             "attention sinks, which this model's attention has (gpt-oss); leave mlx-affine out")


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    specs, contexts, text, source, path, config = check(args)
    import mlx.core as mx

    from ..evaluation import EvalSettings, Evaluation, report
    from ..models import load
    from ..textdata import bos_ids, encode_text

    model, tokenizer = load(path)
    _check_mlx_sinks(specs, model)
    text_ids = encode_text(tokenizer, text)
    limit = config.get("max_position_embeddings")
    notes = [f"context {c} + {args.score_tokens} scored tokens exceed max_position_embeddings {limit}"
             for c in contexts if limit is not None and c + args.score_tokens > limit]
    for note in notes:
        print(f"kvq eval: note: {note}", file=sys.stderr)
    document = {"meta": {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "kvq eval " + " ".join(argv), "model": args.model or "SmolLM2-135M-Instruct",
        "model_path": str(path), "model_dtype": str(model.layers[0].self_attn.q_proj.weight.dtype),
        "text": source, "text_tokens": len(text_ids), "bos": bos_ids(tokenizer), "versions": report.versions(),
        "notes": notes,
    }, "runs": []}
    for context in contexts:
        settings = EvalSettings(context, args.windows, args.score_tokens, args.chunk, args.sinks, args.window,
                                _depths(args.needle_depths), dequantize_mlx=(mx.default_device() == mx.cpu
                                                                            and not args.mlx_quantized_matmul),
                                progress=not args.no_progress)
        evaluation = Evaluation(model, tokenizer, text_ids, settings)
        run = {"settings": _settings_dict(settings), "offsets": evaluation.offsets, "rows": []}
        document["runs"].append(run)

        def save(row, run=run):
            run["rows"].append(row)
            if args.json:
                report.write_json(document, args.json)

        evaluation.run(specs, on_row=save)
    print(report.markdown(document))
    if args.markdown:
        Path(args.markdown).write_text(report.markdown_file(document))
    if args.plot:
        report.plot(document, args.plot)
    return 0


def _settings_dict(settings) -> dict:
    import attrs

    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in attrs.asdict(settings).items()}
