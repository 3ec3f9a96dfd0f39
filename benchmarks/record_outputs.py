"""Greedy tokens and logits of every method on a fixed prompt: a record to compare before and after a refactor.

A change that moves code must not change results. This script runs a model with each method's kvq cache on a
fixed prompt (a prefill of the prompt, then greedy decode), keeps every step's logits (float32) and the tokens,
and saves them as ``.npz``; ``--compare`` loads an earlier record and exits 1 unless every token is identical and
every logit is bit-identical (the plain cache, in one call or in chunks) or within ``--rtol`` of the largest logit
(rotating caches, batches, files, trims: float32 additions may come in another order).

    python benchmarks/record_outputs.py before.npz
    python benchmarks/record_outputs.py after.npz --compare before.npz

Scenarios (:func:`run`): the prompt in one call, in chunks of 1, 16 and 512, a rotating cache whose ring wraps,
batches of packed and unpacked rows, a prompt-cache file round trip and a trim, each then decoded greedily.

Model: a random-weight llama (4 layers, head_dim 64, seeded; no download) by default, or ``--model default``
(SmolLM2-135M-Instruct, :func:`kvq.models.load`). The cache keeps 2 sinks and an 8-token window flushed every 8 tokens
(:data:`FLUSH`), so most of the prompt is compressed; VecInfer is calibrated on the same model first (under a temporary ``KVQ_CACHE_DIR``).
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
           "turboquant:4[outlier_channels=8]", "turboquant:3.5", "vecinfer[model_id=record-outputs]")


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


def _greedy(model, cache, logits: list, steps: int) -> list[int]:
    """``steps`` greedy decode steps from ``logits[-1]``; every step's logits appended to ``logits``."""
    tokens = []
    for _ in range(steps):
        tok = mx.argmax(logits[-1])
        tokens.append(tok.item())
        logits.append(model(tok.reshape(1, 1), cache=cache)[0, -1].astype(mx.float32))
    return tokens


def _prefill(model, cache, prompt: mx.array, chunk: int) -> list:
    """``prompt`` ``[1, T]`` fed in chunks of ``chunk`` tokens; every prompt position's logits (float32)."""
    logits = []
    for a in range(0, prompt.shape[1], chunk):
        out = model(prompt[:, a : a + chunk], cache=cache)[0].astype(mx.float32)
        mx.eval(out)
        logits.extend(out)
    return logits


def _batch(model, caches_of, prompts: list, steps: int, pack: bool) -> tuple[list, list]:
    """Rows prefilled alone, merged into one :class:`kvq.cache.BatchKVQCache` per layer (``pack``: decode with packed
    rows), then ``steps`` greedy steps of all rows at once: ``(tokens per step [B], logits per step [B, vocab])``."""
    rows = []
    last = []
    for p in prompts:
        cache = caches_of()
        last.append(model(p, cache=cache)[0, -1].astype(mx.float32))
        rows.append(cache)
    batch = [type(rows[0][i]).merge([r[i] for r in rows]) for i in range(len(rows[0]))]
    for b in batch:
        b.pack = pack
    logits, tokens = [mx.stack(last)], []
    for _ in range(steps):
        tok = mx.argmax(logits[-1], axis=-1)
        tokens.append(np.array(tok))
        logits.append(model(tok[:, None], cache=batch)[:, -1].astype(mx.float32))
    return tokens, logits


#: Tokens per window flush of the record's caches (2 sinks, a window of 8): most of every prompt is compressed, in
#: many flushes, some of them inside a prefill chunk.
FLUSH = 8

#: The scenarios each method runs (``--scenarios``): how tokens reach the cache and which cache class holds them.
SCENARIOS = ("plain", "chunk1", "chunk16", "chunk512", "rotating", "batch_packed", "batch_rows", "saveload", "trim")


def run(model_name: str, steps: int, prompt_len: int, kernels: str, methods=METHODS, scenarios=SCENARIOS) \
        -> dict[str, np.ndarray]:
    """``{method/scenario/tokens: int32, method/scenario/logits: float32 [..., vocab]}`` per method and scenario.

    Scenarios: ``plain`` the prompt in one call, then greedy decode (what earlier records held, as
    ``method/tokens``); ``chunkN`` the prompt (700 tokens for ``chunk512``) in chunks of N, every position's logits,
    then decode; ``rotating`` every layer a :class:`~kvq.cache.RotatingKVQCache` (``max_kv_size=48``: its ring wraps
    during the prompt), prompt in chunks of 16; ``batch_packed``/``batch_rows`` three prompts of different lengths
    prefilled alone, merged into batch caches and decoded together with packed rows or without; ``saveload`` the
    prompt, a prompt-cache file written and read back, then decode; ``trim`` the prompt, 6 steps, a trim of 3, then
    decode.
    """
    from kvq.cache import load_prompt_cache, save_prompt_cache
    from kvq.evaluation.spec import parse_method

    model, vocab = _model(model_name)
    prompt = mx.array([(11 * i + 5) % vocab for i in range(prompt_len)])[None]
    long_prompt = mx.array([(13 * i + 7) % vocab for i in range(700)])[None]
    out = {}
    calibrated = False
    for label in methods:
        spec = parse_method(label)
        if spec.key_method == "vecinfer" and not calibrated:
            _calibrate_vecinfer(model, vocab)
            calibrated = True

        def caches(max_kv_size=None):
            if label == "fp16":
                from mlx_lm.models.cache import make_prompt_cache

                return make_prompt_cache(model, max_kv_size=max_kv_size)
            from kvq.cache import make_prompt_cache

            spec.cache_options.setdefault("kernels", kernels)
            return make_prompt_cache(model, max_kv_size=max_kv_size, **spec.cache_kwargs(2, 8, flush=FLUSH))

        for scenario in scenarios:
            if label == "fp16" and scenario in ("batch_packed", "batch_rows", "rotating"):
                continue  # mlx-lm's caches: not what this record guards
            key = label if scenario == "plain" else f"{label}/{scenario}"
            if scenario == "plain":
                cache = caches()
                logits = [model(prompt, cache=cache)[0, -1].astype(mx.float32)]
                tokens = _greedy(model, cache, logits, steps)
            elif scenario.startswith("chunk"):
                size = int(scenario[5:])
                cache = caches()
                logits = _prefill(model, cache, long_prompt if size == 512 else prompt, size)
                tokens = _greedy(model, cache, logits, steps)
            elif scenario == "rotating":
                cache = caches(max_kv_size=48)
                logits = _prefill(model, cache, prompt, 16)
                tokens = _greedy(model, cache, logits, steps)
            elif scenario.startswith("batch"):
                prompts = [prompt[:, :n] for n in (prompt_len, prompt_len - 23, prompt_len - 41)]
                steps_tokens, logits = _batch(model, caches, prompts, steps, scenario == "batch_packed")
                tokens = np.stack(steps_tokens).reshape(-1).tolist()
            elif scenario == "saveload":
                cache = caches()
                logits = [model(prompt, cache=cache)[0, -1].astype(mx.float32)]
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "cache.safetensors")
                    save_prompt_cache(path, cache)
                    cache = load_prompt_cache(path)
                tokens = _greedy(model, cache, logits, steps)
            elif scenario == "trim":
                cache = caches()
                logits = [model(prompt, cache=cache)[0, -1].astype(mx.float32)]
                tokens = _greedy(model, cache, logits, 6)
                for c in cache:
                    c.trim(3)
                logits.append(logits[-4])
                tokens += _greedy(model, cache, logits, steps)
            else:
                raise ValueError(f"unknown scenario {scenario!r}; choose from {SCENARIOS}")
            mx.eval(logits)
            out[key + "/tokens"] = np.array(tokens, dtype=np.int32)
            out[key + "/logits"] = np.stack([np.array(x) for x in logits])
            print(f"{key:52s} tokens {tokens[:12]}")
    return out


def _bit_exact(key: str) -> bool:
    """Whether ``key``'s logits must match bit for bit under ``--compare``: the plain cache's (one call, and chunked
    prefill); the other caches' may differ by float32 summation order (``--rtol``)."""
    scenario = key.split("/")[-2] if key.count("/") >= 2 else "plain"
    return scenario == "plain" or scenario.startswith("chunk")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help=".npz file to write")
    ap.add_argument("--model", default="random", choices=("random", "default"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--kernels", default="off", choices=("auto", "off"))
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    ap.add_argument("--methods", default=";".join(METHODS), help="method labels separated by ';' (a label may hold commas)")
    ap.add_argument("--rtol", type=float, default=0.0,
                    help="--compare: relative tolerance for logits of scenarios other than plain and chunkN (the "
                         "plain cache's are compared bit for bit); tokens always exactly")
    ap.add_argument("--compare", help="an earlier record: exit 1 unless every token and logit is identical")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random":
            os.environ["KVQ_CACHE_DIR"] = tmp  # VecInfer's calibration of the random model goes here
        result = run(args.model, args.steps, args.prompt_len, args.kernels, args.methods.split(";"),
                     args.scenarios.split(","))
    np.savez(args.out, **result)
    if args.compare:
        before = dict(np.load(args.compare))
        bad = []
        for key in sorted(set(before) | set(result)):
            if key not in before or key not in result:
                bad.append(f"{key}: only in {'after' if key in result else 'before'}")
            elif not np.array_equal(before[key], result[key]):
                a, b = before[key].astype(np.float64), result[key].astype(np.float64)
                scale = np.max(np.abs(a)) or 1.0
                rel = np.max(np.abs(a - b)) / scale if a.shape == b.shape else float("inf")
                exact = key.endswith("/tokens") or _bit_exact(key)
                if exact or rel > args.rtol:
                    bad.append(f"{key}: differs (max difference {rel:.3g} of the largest |logit|)")
                else:
                    print(f"{key}: within {args.rtol:g} (max difference {rel:.3g} of the largest |logit|)")
        print("\n".join(bad) if bad else f"all {len(result)} arrays identical to {args.compare}")
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
