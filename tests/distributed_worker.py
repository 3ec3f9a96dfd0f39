"""One rank of ``tests/test_distributed.py``, started by ``mlx.launch --backend ring -n 2 -- <python> <this file>``.

Every rank builds the same small random model (float32, seeded), then seeds its *global* random generators (MLX and
numpy) differently per rank, so that anything kvq drew from process state would differ between ranks. It then
generates greedily with each kvq cache twice: with the whole model in this process (the single-process run) and
with the model sharded over the group (``tensor``: ``model.shard``; ``pipeline``: ``model.model.pipeline``), and
writes ``OUT/rank<r>.json``: ``status`` ("ok" or "error" with the traceback), and per part (``tensor``,
``pipeline``): tokens and per-step log-probabilities of both runs per cache, what the caches hold, hashes of the
seeded rotation/sketch matrices, and (tensor) the errors for a model with fewer KV heads than ranks; ``generate``:
the exit code and standard output of ``kvq generate`` on this rank. A rank that fails writes its file and exits 1
(``mlx.launch`` itself exits 0 even then, so the test reads every rank's file).

    python distributed_worker.py tensor,pipeline,generate OUT MODEL_FOLDER     (or: fail OUT)
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import traceback
from pathlib import Path

import mlx.core as mx
import numpy as np

#: Prompt length and generated tokens: with 4 sinks and a 16-token window, 20 prompt tokens are compressed at once
PROMPT_TOKENS, NEW_TOKENS = 40, 6
COMMON = {"sinks": 4, "window": 16, "step": 32}
#: The caches compared (name -> kvq.make_prompt_cache options); vecinfer is added for tensor parallelism
METHODS = {
    "affine4": {"method": "affine", "bits": 4, **COMMON},
    "turboquant4": {"method": "turboquant", "bits": 4, **COMMON},
    "affine8": {"method": "affine", "bits": 8, **COMMON},
}
#: ``kvq generate`` arguments (the model folder is added)
GENERATE = ["generate", "--method", "turboquant", "--bits", "4", "--sinks", "4", "--window", "16", "--max-tokens",
            "6", "--no-chat", "--prompt", "the hello world " * 8]
VECINFER_ID = "tiny-distributed"
VECINFER = {"method": "vecinfer", **COMMON,
            "key_params": {"model_id": VECINFER_ID, "per_head": True, "sub_dim": 4, "code_bits": 6},
            "value_params": {"model_id": VECINFER_ID, "per_head": True, "sub_dim": 4, "code_bits": 6,
                             "role": "values"}}


def tiny_config(kind: str, kv_heads: int = 2, vocab: int = 256) -> dict:
    """mlx-lm config of a small ``llama`` (2 layers) or ``qwen2`` (4 layers): hidden 256, 4 heads of 64."""
    return dict(model_type=kind, hidden_size=256, num_hidden_layers=2 if kind == "llama" else 4,
                intermediate_size=512, num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=1e-5,
                vocab_size=vocab, rope_theta=10000.0, tie_word_embeddings=False)


def tiny_model(kind: str, kv_heads: int = 2, vocab: int = 256, seed: int = 0):
    """A random mlx-lm model of :func:`tiny_config` in float32, the same for the same arguments."""
    from mlx_lm.models import llama, qwen2

    module = {"llama": llama, "qwen2": qwen2}[kind]
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(tiny_config(kind, kv_heads, vocab)))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def save_tiny_folder(dest: Path, tokenizer_folder: Path, kind: str = "llama") -> Path:
    """An mlx-lm model folder (weights, index, config) of :func:`tiny_model`, with the tokenizer files of
    ``tokenizer_folder`` (its vocabulary size is used)."""
    import shutil

    from mlx_lm.utils import save_config, save_model

    vocab = json.loads((tokenizer_folder / "config.json").read_text())["vocab_size"]
    save_model(dest, tiny_model(kind, vocab=vocab))
    save_config(tiny_config(kind, vocab=vocab), dest / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, dest / name)
    return dest


def prompt() -> list[int]:
    return [(7 * i + 3) % 256 for i in range(PROMPT_TOKENS)]


def generate(model, options: dict) -> tuple[list[int], list[list[float]], list]:
    """Greedy tokens, their float32 log-probabilities ``[NEW_TOKENS][V]`` and the kvq caches after the run.

    mlx-lm's ``generate_step`` prefills in chunks of 16 tokens and evaluates only the caches' ``state`` after each:
    in pipeline mode the send to the next rank is reachable only through ``cache[-1].keys = mx.depends(...)``.
    """
    import kvq
    from mlx_lm.generate import generate_step

    cache = kvq.make_prompt_cache(model, **options)
    tokens, logprobs = [], []
    for token, lp in generate_step(mx.array(prompt()), model, max_tokens=NEW_TOKENS, prompt_cache=cache,
                                   sampler=lambda x: mx.argmax(x, axis=-1), prefill_step_size=16):
        tokens.append(int(token))
        logprobs.append(np.array(lp.astype(mx.float32)).tolist())
    return tokens, logprobs, cache


def matrix_hashes() -> dict[str, str]:
    """sha256 of the seeded constants of TurboQuant (both rotations, the QJL residual sketch) and QJL."""
    from kvq_backends_qjl.sketch import make_sketch
    from kvq_backends_turboquant.rotation import rotation, sketch_matrix

    arrays = {"turboquant hadamard signs": rotation("hadamard", 64, 0).signs,
              "turboquant qr": rotation("qr", 64, 0).matrix, "turboquant_prod sketch": sketch_matrix(64, 0),
              "qjl sketch": make_sketch(64, 256, "orthogonal", 0).matrix}
    return {name: hashlib.sha256(np.array(a).tobytes()).hexdigest() for name, a in arrays.items()}


def calibrate_vecinfer(model, rank: int, group) -> None:
    """Rank 0 calibrates per-head VecInfer codebooks of the whole model; every rank then reads them."""
    from kvq_backends_vecinfer.calibrate import Options, calibrate
    from kvq_backends_vecinfer.collect import record
    from kvq_backends_vecinfer.params import VecInferParams

    if rank == 0:
        settings = [VecInferParams(role=r, sub_dim=4, code_bits=6, per_head=True) for r in ("keys", "values")]
        ids = [(5 * i + 1) % 256 for i in range(256)]
        calibrate(record(model, ids, seq_len=64, progress=False), VECINFER_ID, settings,
                  Options(iterations=6, points_per_centroid=32), progress=False)
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))  # the files exist before anyone reads them


def cache_summary(caches: list) -> dict:
    """KV heads held per layer and the number of layers (KVQCache layout is ``(B, H, D_k, D_v, dtype)``)."""
    return {"layers": len(caches), "kv_heads": [c._layout[1] for c in caches]}


def pipeline_cache_equal(single: list, sharded: list, first: int) -> list[bool]:
    """Whether each local layer's stored arrays equal those of the same layer in the single-process run."""
    from mlx.utils import tree_flatten

    equal = []
    for i, cache in enumerate(sharded):
        a = [v for _, v in tree_flatten(single[first + i].state) if isinstance(v, mx.array)]
        b = [v for _, v in tree_flatten(cache.state) if isinstance(v, mx.array)]
        equal.append(len(a) == len(b) and all(x.shape == y.shape and mx.array_equal(x, y).item()
                                              for x, y in zip(a, b)))
    return equal


def too_few_kv_heads(group) -> dict:
    """What kvq and mlx-lm say for a model with 1 KV head on 2 ranks: kvq's two checks, then mlx-lm's own run."""
    import kvq.distributed
    from mlx_lm.models.cache import make_prompt_cache

    found = {}
    try:
        kvq.distributed.shard(tiny_model("llama", kv_heads=1), group)
    except ValueError as error:
        found["shard"] = str(error)
    model = tiny_model("llama", kv_heads=1)
    model.shard(group)  # as mlx_lm.utils.sharded_load does
    try:
        kvq.make_prompt_cache(model, "affine", bits=4)
    except ValueError as error:
        found["make_prompt_cache"] = str(error)
    try:
        model(mx.array([prompt()[:4]]), cache=make_prompt_cache(model))
    except Exception as error:  # mlx-lm's own failure, recorded for the test's docstring claim
        found["mlx_lm"] = f"{type(error).__name__}: {error}"
    return found


def generate_cli(folder: str) -> dict:
    """``kvq generate`` (:data:`GENERATE` on the model folder) on this rank: its exit code and standard output."""
    import contextlib
    import io

    from kvq.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        code = main([*GENERATE, "--model", folder])
    return {"exit_code": code, "stdout": out.getvalue()}


def run(mode: str, rank: int, group, folder: str | None) -> dict:
    """One part of the run: ``tensor``, ``pipeline``, ``generate`` or ``fail`` (rank 1 raises)."""
    import kvq.distributed
    from kvq import quality

    if mode == "fail":  # for the test of the test harness: one rank fails, the other succeeds
        if rank == 1:
            raise ValueError("rank 1 fails on purpose")
        return {}
    if mode == "generate":
        return generate_cli(folder)
    model = tiny_model("llama" if mode == "tensor" else "qwen2")
    methods = dict(METHODS)
    if mode == "tensor":
        calibrate_vecinfer(model, rank, group)
        methods["vecinfer"] = VECINFER
    mx.random.seed(1000 + rank)  # process state differs per rank from here on
    np.random.seed(1000 + rank)
    result = {"hashes": matrix_hashes(), "methods": {}}
    single = {name: generate(model, options) for name, options in methods.items()}
    kvq.distributed.shard(model, group, pipeline=mode == "pipeline")
    result["first_layer"] = kvq.distributed.first_layer(model)
    result["kv_head_range"] = kvq.distributed.kv_head_range(model)
    result["kv_layout"] = list(quality.kv_layout(model))  # what kvq generate's fp16 byte count assumes
    for name, options in methods.items():
        tokens, logprobs, caches = generate(model, options)
        first, single_caches = result["first_layer"], single[name][2]
        entry = {"single_tokens": single[name][0], "single_logprobs": single[name][1], "tokens": tokens,
                 "logprobs": logprobs, "caches": cache_summary(caches), "nbytes": sum(c.nbytes for c in caches),
                 "single_nbytes": sum(c.nbytes for c in single_caches[first : first + len(caches)])}
        if mode == "pipeline":
            entry["layers_equal"] = pipeline_cache_equal(single_caches, caches, first)
        result["methods"][name] = entry
    if mode == "tensor":
        result["too_few_kv_heads"] = too_few_kv_heads(group)
    return result


def main() -> int:
    modes, out, folder = sys.argv[1].split(","), Path(sys.argv[2]), (sys.argv[3:] or [None])[0]
    rank = int(os.environ.get("MLX_RANK", "0"))  # set by mlx.launch; the group says it again below
    os.environ["KVQ_DATA_DIR"] = str(out / "kvq-data")
    result = {"status": "error", "rank": rank}
    try:
        group = mx.distributed.init(strict=True)
        result.update(rank=group.rank(), size=group.size())
        for mode in modes:  # one process runs every part: each launch costs seconds of imports
            result[mode] = run(mode, group.rank(), group, folder)
        result["status"], code = "ok", 0
    except BaseException:  # the file says what failed; exiting 1 makes mlx.launch stop the other ranks
        result["traceback"], code = traceback.format_exc(), 1
    rank = result["rank"]
    tmp = out / f".rank{rank}.json"
    tmp.write_text(json.dumps(result))
    tmp.rename(out / f"rank{rank}.json")
    return code


if __name__ == "__main__":
    sys.exit(main())
