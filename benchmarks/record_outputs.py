"""Greedy tokens and logits of every method on a fixed prompt: a record to compare before and after a refactor.

A change that moves code must not change results. This script runs a model with each method's kvq cache on a
fixed prompt (a prefill of the prompt, then greedy decode), keeps every step's logits (float32) and the tokens,
and saves them as ``.npz``; ``--compare`` loads an earlier record and exits 1 unless every token and every logit
is bit-identical.

    python benchmarks/record_outputs.py before.npz
    python benchmarks/record_outputs.py after.npz --compare before.npz

Model: a random-weight llama (4 layers, head_dim 64, seeded; no download) by default, or ``--model default``
(SmolLM2-135M-Instruct, :func:`kvq.models.load`). The cache keeps 2 sinks and an 8-token window so most of the
prompt is compressed; VecInfer is calibrated on the same model first (under a temporary ``KVQ_CACHE_DIR``).
Runs on any device; on a GPU the kernels take part unless ``--kernels off``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import mlx.core as mx
import numpy as np

METHODS = ("fp16", "affine:4", "affine:k8v4", "turboquant:4", "turboquant:3", "turboquant:k4v3",
           "turboquant_prod:4", "turboquant_rvq[bits=2,residual_bits=2]", "qjl+affine:4",
           "turboquant:4[outlier_channels=8]", "vecinfer[model_id=record-outputs]")


def _model(name: str):
    if name == "default":
        import kvq.models

        model, _ = kvq.models.load(progress=False)
        return model, 32000
    from mlx_lm.models import llama

    mx.random.seed(0)
    args = llama.ModelArgs.from_dict(dict(
        model_type="llama", hidden_size=256, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, rope_theta=10000.0, tie_word_embeddings=False))
    model = llama.Model(args)
    model.set_dtype(mx.float16)
    mx.eval(model.parameters())
    return model, 512


def _calibrate_vecinfer(model, vocab: int) -> None:
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import record
    from kvq_backends_vecinfer.params import VecInferParams

    settings = [VecInferParams(role=r) for r in ("keys", "values")]
    ids = [(7 * i + 3) % vocab for i in range(256)]
    calibrate(record(model, ids, seq_len=64, progress=False), "record-outputs", settings,
              Options(iterations=4, points_per_centroid=16), progress=False)


def run(model_name: str, steps: int, prompt_len: int, kernels: str, methods=METHODS) -> dict[str, np.ndarray]:
    """``{method + "/tokens": int32 [steps], method + "/logits": float32 [steps + 1, vocab]}`` per method."""
    from kvq.evaluation.spec import make_cache, parse_method

    model, vocab = _model(model_name)
    prompt = mx.array([(11 * i + 5) % vocab for i in range(prompt_len)])[None]
    out = {}
    for label in methods:
        spec = parse_method(label)
        if spec.key_method == "vecinfer" and not out.get("_vecinfer_calibrated"):
            _calibrate_vecinfer(model, vocab)
            out["_vecinfer_calibrated"] = np.array(1)
        if label == "fp16":
            from mlx_lm.models.cache import make_prompt_cache

            cache = make_prompt_cache(model)
        else:
            spec.cache_options.setdefault("kernels", kernels)
            cache = make_cache(model, spec, sinks=2, window=8)
        logits = [model(prompt, cache=cache)[0, -1].astype(mx.float32)]
        tokens = []
        for _ in range(steps):
            tok = mx.argmax(logits[-1])
            tokens.append(tok.item())
            logits.append(model(tok.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32))
        mx.eval(logits)
        out[label + "/tokens"] = np.array(tokens, dtype=np.int32)
        out[label + "/logits"] = np.stack([np.array(x) for x in logits])
        print(f"{label:40s} tokens {tokens}")
    out.pop("_vecinfer_calibrated", None)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help=".npz file to write")
    ap.add_argument("--model", default="random", choices=("random", "default"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--kernels", default="off", choices=("auto", "off"))
    ap.add_argument("--compare", help="an earlier record: exit 1 unless every token and logit is identical")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random":
            os.environ["KVQ_CACHE_DIR"] = tmp  # VecInfer's calibration of the random model goes here
        result = run(args.model, args.steps, args.prompt_len, args.kernels)
    np.savez(args.out, **result)
    if args.compare:
        before = dict(np.load(args.compare))
        bad = []
        for key in sorted(set(before) | set(result)):
            if key not in before or key not in result:
                bad.append(f"{key}: only in {'after' if key in result else 'before'}")
            elif not np.array_equal(before[key], result[key]):
                diff = np.max(np.abs(before[key].astype(np.float64) - result[key].astype(np.float64)))
                bad.append(f"{key}: differs (max abs difference {diff:.3g})")
        print("\n".join(bad) if bad else f"all {len(result)} arrays identical to {args.compare}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
