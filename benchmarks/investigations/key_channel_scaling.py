"""Would scaling key channels before quantizing help? Per layer, on a model's own queries and keys (issue #53).

A quantizer whose error is isotropic in the space it quantizes (TurboQuant after its rotation) gives a score error
``q . e`` of variance proportional to ``|k|^2 |q|^2``. Storing ``k / s`` and attending with ``q * s`` (the same
scores) makes it ``|k / s|^2 |s q|^2``, least at ``s_c^2 = sqrt(E k_c^2 / E q_c^2)``, where it is ``R`` times the
unscaled one, ``R = (sum_c sqrt(E k_c^2 E q_c^2))^2 / (sum_c E k_c^2 * sum_c E q_c^2)`` (Cauchy-Schwarz: R <= 1, 1
when query and key channel energies are proportional). This prints, per layer and KV head, ``R`` and the relative
attention-output error of TurboQuant keys (values exact) without and with that scaling, on the last 1,024 queries
of a 2,048-token window (BOS first where the tokenizer adds one) over all its keys, keys centred by the mean of
tokens 4..260 (as kvq's guard centres a layer), ``s`` estimated from tokens 4..512 of the same window. Pure MLX,
no cache: it measures the lead, not an implementation.

Columns after "plain": the query-aware ``s`` above; key-only ``s_c = (E k_c^2)^(alpha/2)`` for each ``--key-alpha``
(no query statistics: what a cache can decide from its keys); with ``--block N``, key-only ``alpha = 1/2`` from the
first ``N`` tokens after the sinks only (what kvq's first compression sees): per channel, per channel rounded to a
power of two, per RoPE pair, per pair rounded, and each head's channel spread ``D sum E / (sum sqrt E)^2``. kvq ships
the per-channel power-of-two scales for heads of spread >= 1.5 (:mod:`kvq.cache.guard`); the outputs of
``--bits 4,3 --block 128`` are in ``benchmarks/results/key_scaling/``.

    uv run python benchmarks/investigations/key_channel_scaling.py [--model gemma-3-270m] [--bits 4,3] [--block 128]
"""

from __future__ import annotations

import argparse
import sys

import mlx.core as mx
import numpy as np

import kvq
from kvq.models import load
from kvq.plugins import registry
from kvq.textdata import bos_ids, encode_text, language_reference


def capture(model, ids):
    """Every attention call's float32 ``(queries, keys, values, scale)`` of one forward pass over ``ids``."""
    module = sys.modules[type(model).__module__]
    original, caught = module.scaled_dot_product_attention, []

    def record(queries, keys, values, cache, scale, mask, **kwargs):
        caught.append(tuple(x.astype(mx.float32) for x in (queries, keys, values)) + (scale,))
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    module.scaled_dot_product_attention = record
    try:
        model(mx.array(ids)[None])
    finally:
        module.scaled_dot_product_attention = original
    return caught


def causal_attention(q, k, v, scale):
    """Rows ``q`` (the last ``T_q`` positions) over all of ``k``/``v`` (GQA by repetition), causal."""
    rep = q.shape[1] // k.shape[1]
    k, v = mx.repeat(k, rep, axis=1), mx.repeat(v, rep, axis=1)
    scores = (q * scale) @ k.swapaxes(-1, -2)
    T, Tk = q.shape[2], k.shape[2]
    visible = mx.arange(Tk)[None] <= (mx.arange(T)[:, None] + Tk - T)
    return mx.softmax(mx.where(visible, scores, -1e30), axis=-1) @ v


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--bits", default="4,3")
    p.add_argument("--method", default="turboquant")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--block", type=int, default=0,
                   help="also try key-only scales from tokens 4..4+BLOCK: per channel, rounded to 2^k, per RoPE pair, rounded")
    p.add_argument("--key-alpha", type=float, nargs="*", default=[0.5],
                   help="also try key-only scales s_c = (E k_c^2)^(alpha/2) (no query statistics)")
    args = p.parse_args()
    model, tokenizer = load(args.model)
    tokens = encode_text(tokenizer, language_reference())
    start = len(tokens) // 2
    ids = list(tokens[start : start + args.context])
    bos = bos_ids(tokenizer)
    if bos:
        ids[0] = bos[0]
    caught = capture(model, ids)
    impl = registry().implementations[(args.method, "mlx")]
    bits = [int(b) for b in args.bits.split(",")]
    print(f"{args.model}, {args.context} tokens; per layer: R per KV head, then attention error of turboquant keys "
          f"plain -> scaled at {', '.join(map(str, bits))} bits; "
          f"columns: plain, query-aware, key-only alpha {args.key_alpha}")
    totals = {b: {} for b in bits}
    for layer, (q, k, v, scale) in enumerate(caught):
        mean = mx.mean(k[:, :, 4:260], axis=2, keepdims=True)
        centred = k - mean
        B, Hq, T, D = q.shape
        Hk = k.shape[1]
        grouped = q.reshape(B, Hk, Hq // Hk, T, D)
        Ek = mx.mean(centred[:, :, 4:512] ** 2, axis=2, keepdims=True)  # [1, Hk, 1, D]
        Eq = mx.mean(grouped[..., 4:512, :] ** 2, axis=(2, 3))[:, :, None, :]
        Ek = mx.maximum(Ek, 1e-4 * mx.mean(Ek, axis=-1, keepdims=True))
        Eq = mx.maximum(Eq, 1e-4 * mx.mean(Eq, axis=-1, keepdims=True))
        R = np.array(mx.sum(mx.sqrt(Ek * Eq), -1) ** 2 / (mx.sum(Ek, -1) * mx.sum(Eq, -1))).ravel()
        def normed(s):
            return s / mx.exp(mx.mean(mx.log(s), axis=-1, keepdims=True))

        scales = [normed(mx.power(Ek / Eq, 0.25))] + [normed(mx.power(Ek, a / 2)) for a in args.key_alpha]
        if args.block:  # key-only alpha 0.5 from the first compressed block: per channel, per RoPE pair, pow2
            Eb = mx.mean(centred[:, :, 4 : 4 + args.block] ** 2, axis=2, keepdims=True)
            Eb = mx.maximum(Eb, 1e-4 * mx.mean(Eb, axis=-1, keepdims=True))
            half = D // 2
            pair = (Eb[..., :half] + Eb[..., half:]) / 2
            Ep = mx.concatenate([pair, pair], axis=-1)
            sp = normed(mx.power(Ep, 0.25))
            spread = np.array(D * mx.sum(Eb, -1) / mx.sum(mx.sqrt(Eb), -1) ** 2).ravel()
            sc = normed(mx.power(Eb, 0.25))
            scales += [sc, mx.power(2.0, mx.round(mx.log2(sc))), sp, mx.power(2.0, mx.round(mx.log2(sp)))]
        rows = q[:, :, T // 2 :]
        ref = causal_attention(rows, k, v, scale)
        line = [f"layer {layer:2d}: R {np.round(R, 3)}" + (f" spread {np.round(spread, 2)}" if args.block else "")]
        for b in bits:
            params = kvq.make_params(args.method, bits=b)

            def decoded(x):
                return impl.kvq_dequantize(impl.kvq_quantize(x, params), mx.float32)

            errors = []
            for keys in [decoded(centred) + mean] + [decoded(centred / s) * s + mean for s in scales]:
                out = causal_attention(rows, keys, v, scale)
                errors.append(float(mx.sqrt(mx.sum((out - ref) ** 2) / mx.sum(ref**2))))
            for i, e in enumerate(errors):
                totals[b].setdefault(i, []).append(e)
            line.append(f"{b} bits " + " -> ".join(f"{e:.4f}" for e in errors))
        print("  ".join(line), flush=True)
    for b in bits:
        print(f"mean over layers, {b} bits: " + " -> ".join(f"{np.mean(v):.4f}" for v in totals[b].values()))


if __name__ == "__main__":
    main()
