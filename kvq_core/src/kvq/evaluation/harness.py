"""One evaluation at one context length: every method on the same windows, against the reference run.

The reference (``kvcache``: mlx-lm's own caches in the model's dtype) runs first; its log-probabilities, and at window 0 its keys, values and queries, are kept
so that every later method is compared on the same tokens in the same process.
"""

from __future__ import annotations

import gc
import time
from typing import Callable

import attrs
import mlx.core as mx
from tqdm import tqdm

from ..defaults import DEFAULT_FLUSH, DEFAULT_SINKS, DEFAULT_WINDOW
from ..textdata import bos_ids
from ..cache.still import layer_still_channels
from .attention_error import AttentionHook, InputRecorder, LayerReference, sliding_windows
from .needle import CODES, greedy_answer, is_match, needle_prompt
from ..cache.prefill import release_shared_mask
from ..cache.prompt import prefill_prompt
from .perplexity import score, summarize, token_metrics, window_offsets
from .spec import MethodSpec, bits_per_coordinate, make_cache, model_dtype

#: Bits of an uncompressed coordinate (sinks, window) when quoting effective bits: a float16 model's.
DENSE_BITS = 16


@attrs.frozen
class EvalSettings:
    """How one context length is evaluated (the defaults are the protocol of REFERENCE_VALUES.md).

    :param context: tokens prefilled before the scored ones.
    :param windows: text windows (at fixed offsets, see :func:`window_offsets`).
    :param score_tokens: tokens scored per window, in one teacher-forced forward pass.
    :param chunk: prefill chunk size.
    :param sinks, window: kvq caches' uncompressed first and last tokens (a method string may override them).
    :param needle_depths: one needle trial per depth (0..1) at ``context`` tokens; empty: no needle test.
    :param dequantize_mlx: serve mlx-affine attention as dequantize + float attention (same products; MLX's
        CPU quantized_matmul is slow).
    :param progress: show a tqdm progress bar on stderr.
    """

    context: int
    windows: int = 3
    score_tokens: int = 256
    chunk: int = 512
    sinks: int = DEFAULT_SINKS
    window: int = DEFAULT_WINDOW
    needle_depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    dequantize_mlx: bool = True
    progress: bool = True


def _head_dim(model) -> int:
    args = model.args
    return getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads


def _eos_ids(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_ids", None) or {tokenizer.eos_token_id}
    return {int(i) for i in ids}


def cache_kind(spec: MethodSpec) -> str:
    """``"mlx-lm KVCache"`` (the reference), ``"mlx-lm QuantizedKVCache"`` or ``"kvq KVQCache"``."""
    return "mlx-lm KVCache" if spec.is_reference else "mlx-lm QuantizedKVCache" if spec.is_mlx else "kvq KVQCache"


class Evaluation:
    """Runs :class:`MethodSpec` rows one after the other (the first must be the reference: mlx-lm's KVCache)."""

    def __init__(self, model, tokenizer, text_ids: list[int], settings: EvalSettings) -> None:
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        s = settings
        self.head_dim = _head_dim(model)
        length = s.context + s.score_tokens + 1
        self.offsets = window_offsets(len(text_ids), length, s.windows)
        # A window starts as any text the model reads does: with the BOS token where the tokenizer adds one (in
        # place of the window's first text token, so windows keep their length; the BOS is prefilled, never scored)
        self.bos = bos_ids(tokenizer)
        self.windows = [mx.array(self.bos + text_ids[o : o + length - len(self.bos)]) for o in self.offsets]
        self.needles = [needle_prompt(tokenizer, text_ids[self.offsets[i % s.windows]:], s.context, depth,
                                      CODES[i % len(CODES)], self.bos) for i, depth in enumerate(s.needle_depths)]
        self.reference_logprobs: list[mx.array] = []
        self.reference_nll: list[mx.array] = []
        self.layers: LayerReference | None = None
        self.reference_row: dict | None = None

    @property
    def steps_per_method(self) -> int:
        return self.settings.windows + 1 + len(self.settings.needle_depths)

    def run(self, specs: list[MethodSpec], on_row: Callable[[dict], None] | None = None) -> list[dict]:
        """Evaluate ``specs`` (the reference first); ``on_row`` is called with each finished row."""
        rows = []
        bar = tqdm(total=len(specs) * self.steps_per_method, desc=f"kvq eval {self.settings.context}",
                   unit="step", disable=not self.settings.progress, dynamic_ncols=True)
        with AttentionHook(self.model, self.settings.dequantize_mlx) as hook, bar:
            for spec in specs:
                rows.append(self.run_one(spec, hook, bar))
                if on_row is not None:
                    on_row(rows[-1])
        return rows

    def run_one(self, spec: MethodSpec, hook: AttentionHook, bar) -> dict:
        """All measurements of one method string; returns its row."""
        s, start = self.settings, time.perf_counter()
        sinks, window = spec.sinks_window(s.sinks, s.window)
        per_window, seconds, memory = [], {"prefill": [], "score": []}, None
        for w, ids in enumerate(self.windows):
            bar.set_postfix_str(f"{spec.label}: window {w + 1}/{s.windows}")
            metrics, mem = self._window(spec, hook, w, ids, seconds)
            per_window.append(metrics)
            memory = memory or mem
            bar.update(1)
        bar.set_postfix_str(f"{spec.label}: attention error")
        t = time.perf_counter()
        if self.layers is None:  # the reference row
            self._record_layers(spec, hook)
        errors = self.layers.errors(spec, hook, s.sinks, s.window)
        seconds["attention_error"] = time.perf_counter() - t
        bar.update(1)
        t = time.perf_counter()
        needle = self._needles(spec, bar)
        seconds["needle"] = time.perf_counter() - t
        seconds["total"] = time.perf_counter() - start
        row = self._row(spec, sinks, window, summarize(per_window, self.reference_nll), errors, needle, memory)
        row["seconds"] = seconds
        self.reference_row = self.reference_row or row
        return row

    def _window(self, spec, hook, w, ids, seconds):
        s = self.settings
        release_shared_mask()  # a mask the last scored chunk's layers shared is not this window's memory
        gc.collect()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        t = time.perf_counter()
        cache = make_cache(self.model, spec, s.sinks, s.window)
        prefill_prompt(self.model, cache, ids[: s.context], step=s.chunk)
        seconds["prefill"].append(time.perf_counter() - t)
        memory = {"kv_bytes": sum(c.nbytes for c in cache), "active_memory_growth": mx.get_active_memory() - before,
                  "peak_memory_growth": mx.get_peak_memory() - before, **layer_methods(cache, self.head_dim)}
        t = time.perf_counter()
        logprobs = score(self.model, cache, ids[s.context : -1])
        seconds["score"].append(time.perf_counter() - t)
        if len(self.reference_logprobs) <= w:  # the reference run
            self.reference_logprobs.append(logprobs)
        metrics = token_metrics(self.reference_logprobs[w], logprobs, ids[s.context + 1 :])
        mx.eval(metrics)
        if len(self.reference_nll) <= w:
            self.reference_nll.append(metrics["nll"])
        return metrics, memory

    def _record_layers(self, spec: MethodSpec, hook: AttentionHook) -> None:
        """Window 0 run once more with the reference cache, recording every layer's keys and values as given and
        the scored tokens' queries (:class:`LayerReference`); a run of its own, so that the memory measured in
        the windows holds no recording."""
        s = self.settings
        ids = self.windows[0]
        cache = make_cache(self.model, spec, s.sinks, s.window)
        recorder = InputRecorder(cache)
        prefill_prompt(self.model, cache, ids[: s.context], step=s.chunk)
        hook.recording = {}
        try:
            score(self.model, cache, ids[s.context : -1])
            queries, scales, sinks = zip(*(hook.recording[id(c)] for c in cache))
        finally:
            hook.recording = None
            recorder.detach()
        kv = recorder.kv()
        mx.eval(queries, kv)
        windows = sliding_windows(cache)
        still = layer_still_channels(self.model, [0 if w is None else w[0] for w in windows])
        self.layers = LayerReference(kv, queries, scales, s.context, s.chunk, windows, sinks, still)

    def _needles(self, spec, bar) -> dict:
        s, trials = self.settings, []
        for depth, prompt, i in zip(s.needle_depths, self.needles, range(len(self.needles))):
            bar.set_postfix_str(f"{spec.label}: needle at depth {depth:g}")
            cache = make_cache(self.model, spec, s.sinks, s.window)
            eos = _eos_ids(self.tokenizer)
            answer_ids = greedy_answer(self.model, cache, prompt, s.chunk, eos)
            answer = self.tokenizer.decode([t for t in answer_ids if t not in eos])
            code = CODES[i % len(CODES)]
            trials.append({"depth": depth, "code": code, "answer": answer, "match": is_match(answer, code),
                           "prompt_tokens": len(prompt)})
            del cache
            bar.update(1)
        rate = sum(t["match"] for t in trials) / len(trials) if trials else None
        return {"rate": rate, "trials": trials}

    def _row(self, spec, sinks, window, quality, errors, needle, memory) -> dict:
        key_bits, value_bits = memory.pop("layer_bits", None) or bits_per_coordinate(spec, self.head_dim,
                                                                                      model_dtype(self.model))
        bits = (key_bits + value_bits) / 2
        dense = min(sinks + window, self.settings.context)
        effective = ((self.settings.context - dense) * bits + dense * DENSE_BITS) / self.settings.context
        ref = self.reference_row or {**memory}
        return {
            "method": spec.label, "cache": cache_kind(spec),
            "key_method": spec.key_method, "value_method": spec.value_method,
            "key_params": spec.key_params, "value_params": spec.value_params, "sinks": sinks, "window": window,
            "flush": None if spec.is_mlx or spec.is_reference else spec.cache_options.get("flush", DEFAULT_FLUSH),
            "bits_per_coordinate": bits, "key_bits_per_coordinate": key_bits,
            "value_bits_per_coordinate": value_bits, "effective_bits_per_coordinate": effective,
            **quality,
            "attention_error": {"mean": sum(errors) / len(errors), "max": max(errors), "per_layer": errors},
            "needle": needle,
            **memory,
            "kv_bytes_ratio": memory["kv_bytes"] / ref["kv_bytes"],
            "memory_ratio": memory["active_memory_growth"] / max(ref["active_memory_growth"], 1),
        }


def layer_methods(cache: list, head_dim: int) -> dict:
    """What the layers of ``cache`` ended up storing, after a prefill: ``{"layer_bits": (keys, values) bits per
    coordinate averaged over the layers, "outlier_layers": indices of the layers kvq's outlier-layer guard flagged
    (:mod:`kvq.cache.guard`; stored with affine:8 under its default policy), "centred_layers", "scaled_layers":
    indices of the layers whose keys are stored centred, scaled}``, and for a bits budget (:mod:`kvq.cache.budget`) ``"layer_bits_each"``:
    each layer's ``[keys, values]`` bits per coordinate; empty for caches that are not kvq's. A centred layer's mean and a
    scaled layer's scales (32 bits per key channel and head each) are counted in its keys' bits, spread over the tokens
    it holds."""
    from ..cache import KVQCache

    layers = [c for c in cache if isinstance(c, KVQCache)]
    if not layers or len(layers) != len(cache):
        return {}
    bits = []
    for c in layers:
        side_bits = sum(32 / max(c.offset, 1) for x in (c.key_mean, c.key_scale) if x is not None)
        bits.append((c.config.key_params.accounting(head_dim).bits_per_coordinate + side_bits,
                     c.config.value_params.accounting(head_dim).bits_per_coordinate))
    budgeted = {"layer_bits_each": [list(b) for b in bits]} if any(c.config.budget for c in layers) else {}
    return {"layer_bits": (sum(b[0] for b in bits) / len(bits), sum(b[1] for b in bits) / len(bits)), **budgeted,
            "outlier_layers": [i for i, c in enumerate(layers) if c.config.outlier_layer],
            "centred_layers": [i for i, c in enumerate(layers) if c.key_mean is not None],
            "scaled_layers": [i for i, c in enumerate(layers) if c.key_scale is not None]}
