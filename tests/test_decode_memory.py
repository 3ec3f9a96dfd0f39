"""Pure-MLX decode attention over compressed tokens holds one block's working set, never the context (issue #21).

Memory is measured (``mx.get_peak_memory``), not inferred. For each method: 8192 compressed tokens
(B=1, H_kv=2, H_q=4, head_dim 64) and one query; ``kvq.attention.VECTOR_BUDGET_BYTES`` is lowered to 256 KiB, so
blocks are 256 tokens (128 KiB of float32 keys, as many of values) and the context is 32 blocks. The peak above
the resident inputs must stay within the working set each implementation states for one block (a number of
float32 copies of the block's keys and values: ``COPIES``) plus the block's scores and a small constant: 0.6 to
2.6 MiB here (measured: 0.26 to 2.4 MiB). Before, kvq decoded the whole context in one block in decode: these cases
then peaked at 8.3 (fp16) to 72 MiB (turboquant_rvq 3+3) above the inputs; 16.5 MiB for turboquant:4, 44.4 MiB for
turboquant_prod:4, 11.5 MiB for qjl + affine:4, against 1.1 MiB or less of compressed keys and values.
"""

from __future__ import annotations

import gc

import mlx.core as mx
import numpy as np
import pytest

import kvq
import kvq.attention
from kvq.attention import attend_encoded
from kvq.cache import block_implementation
from kvq.contract import Fits, optional_hook

pytestmark = pytest.mark.usefixtures("private_codebook_cache")

B, H_KV, H_Q, D, T = 1, 2, 4, 64, 8192
BLOCK = 256
#: Float32 copies of one block of its keys (``scores``) or values (``weighted_values``) that each implementation
#: states it holds at most (its docstrings): decoded vectors, unpacked codes, ±1 signs.
COPIES = {"fp16": 2, "affine": 8, "turboquant": 6, "turboquant_rvq": 10, "turboquant_prod": 6, "qjl": 8,
          "vecinfer": 2}
#: Beyond the blocks: the query, its rotations or sketch, the accumulators and the outputs (a few KiB here).
SLACK = 64 * 2**10
#: On a GPU the bound is half the float32 context (4 MiB), not ``COPIES``: the per-block copies were counted from
#: the CPU's allocations, and MLX's CUDA back end allocates more temporaries per block (measured on an H200:
#: 1.56 MiB for fp16, 2.25 to 3.08 MiB for turboquant:3, turboquant_prod:4, turboquant_rvq 3+3 and
#: affine:4+turboquant_prod:4, against CPU bounds of 0.58 to 2.58 MiB). Still a block, not the context (8 MiB),
#: whose single block peaked at 8.3 to 72 MiB before.

CASES = {  # id: (key method, key params, value method, value params)
    "fp16": ("fp16", {}, "fp16", {}),
    "affine:4": ("affine", {"bits": 4}, "affine", {"bits": 4}),
    "affine:6": ("affine", {"bits": 6}, "affine", {"bits": 6}),  # codes straddle bytes: the most temporaries
    "turboquant:4": ("turboquant", {"bits": 4}, "turboquant", {"bits": 4}),
    "turboquant:3": ("turboquant", {"bits": 3}, "turboquant", {"bits": 3}),  # codes straddle words
    "turboquant:data-outliers": ("turboquant", {"bits": 2, "outlier_channels": 16, "outlier_bits": 3,
                                                "outlier_select": "data"}, "turboquant", {"bits": 3}),
    "turboquant_prod:4": ("turboquant_prod", {"bits": 4}, "turboquant_prod", {"bits": 4}),
    "turboquant_rvq:3+3": ("turboquant_rvq", {"bits": 3, "residual_bits": 3}, "turboquant_rvq",
                           {"bits": 3, "residual_bits": 3}),
    "qjl+affine:4": ("qjl", {}, "affine", {"bits": 4}),
    "turboquant:4+affine:4": ("turboquant", {"bits": 4}, "affine", {"bits": 4}),
    "affine:4+turboquant_prod:4": ("affine", {"bits": 4}, "turboquant_prod", {"bits": 4}),
    "vecinfer": ("vecinfer", None, "vecinfer", None),
}


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of :data:`BLOCK` tokens at these shapes (1 KiB of float32 key and value a token)."""
    monkeypatch.setattr(kvq.attention, "VECTOR_BUDGET_BYTES", BLOCK * 4 * B * H_KV * 2 * D)


@pytest.fixture
def vecinfer_data(monkeypatch, tmp_path):
    """Calibrations go to a temporary KVQ_DATA_DIR; nothing read is kept in memory afterwards."""
    from kvq_backends_vecinfer import storage

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    yield
    storage.forget()


def _vecinfer_params():
    """Keys and values parameters of a synthetic calibration (random codebooks, unit smoothing) for these shapes."""
    from kvq_backends_vecinfer import storage
    from kvq_backends_vecinfer.params import VecInferParams

    params = []
    for role in ("keys", "values"):
        p = VecInferParams(model_id="decode-memory", role=role, sub_dim=4, code_bits=8, layer=0)
        meta = {"format": storage.FORMAT, "method": "vecinfer", "model_id": "decode-memory", "role": role,
                "sub_dim": 4, "code_bits": 8, "per_head": False, "head_dim": D, "num_kv_heads": H_KV, "layers": [0]}
        arrays = {"codebook.0": mx.random.normal((1, 256, 4))}
        if role == "keys":
            arrays["smoothing.0"] = mx.ones((H_KV, D))
        storage.save(storage.Calibration(meta, arrays, storage.path_for(p)))
        params.append(p)
    return params


def _encode(method: str, params, x: mx.array):
    """``(implementation, Encoded)`` of ``x`` as a cache stores it (parameters fitted on the data first)."""
    fit = optional_hook(params, Fits)
    params = fit(x) if fit is not None else params
    impl = kvq.registry().implementations[(method, "mlx")]
    return impl, impl.kvq_quantize(x, params)


def _attention(key_method, key_params, value_method, value_params):
    """The decode attention a cache runs over these compressed keys and values, as ``fn(block_size)``, and the
    bytes they hold."""
    registry = kvq.registry()
    k, v, q = mx.random.normal((B, H_KV, T, D)), mx.random.normal((B, H_KV, T, D)), mx.random.normal((B, H_Q, 1, D))
    kp = key_params if not isinstance(key_params, dict) else registry.method(key_method).make_params(**key_params)
    vp = value_params if not isinstance(value_params, dict) else registry.method(value_method).make_params(
        **value_params)
    k_impl, keys = _encode(key_method, kp, k)
    v_impl, values = _encode(value_method, vp, v)
    mx.eval(q, keys.data, values.data)
    if key_method == value_method:  # the method's own kvq_attend (block size its own, or the default)
        def fn(block_size=None):
            if block_size is None:
                return k_impl.kvq_attend(q, keys, values, D**-0.5, None)
            return attend_encoded(q, keys, values, D**-0.5, None, k_impl, v_impl, block_size=block_size)
    else:  # two methods: each side's block protocol (kvq.cache's _attend_fn)
        kb, vb = block_implementation(key_method, "keys"), block_implementation(value_method, "values")

        def fn(block_size=None):
            return attend_encoded(q, keys, values, D**-0.5, None, kb, vb, block_size=block_size)
    return fn, keys.nbytes + values.nbytes


def _peak_above_inputs(fn) -> int:
    """Peak bytes that ``fn()`` and evaluating its result allocate beyond what was resident before."""
    mx.eval(fn())  # once before: constants (rotations, codebooks, sketches) are built and cached
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


def _relative_error(a, b) -> float:
    a, b = np.array(a, dtype=np.float64), np.array(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("case", list(CASES))
def test_decode_peak_is_one_block_not_the_context(case, small_blocks, vecinfer_data):
    key_method, key_params, value_method, value_params = CASES[case]
    if key_method == "vecinfer":
        key_params, value_params = _vecinfer_params()
    fn, compressed = _attention(key_method, key_params, value_method, value_params)
    extra = _peak_above_inputs(fn)
    side = 4 * B * H_KV * BLOCK * D  # float32 bytes of one block of keys (or values)
    scores = 4 * 4 * B * H_Q * BLOCK  # scores, probabilities and their masked and shifted copies
    bound = (COPIES[key_method] + COPIES[value_method]) * side + scores + SLACK
    context = 4 * B * H_KV * T * 2 * D  # float32 keys and values of the whole context: what a block must not be
    print(f"{case}: peak {extra / 2**20:.2f} MiB above the inputs; bound {bound / 2**20:.2f} MiB; "
          f"compressed {compressed / 2**20:.2f} MiB; float32 context {context / 2**20:.0f} MiB")
    assert bound < context / 2
    if mx.default_device() == mx.gpu:  # see GPU_BOUND
        bound = context // 2
    assert extra <= bound, f"{case}: {extra / 2**20:.2f} MiB above the inputs, bound {bound / 2**20:.2f} MiB"
    # blocks change nothing beyond float32 rounding: the same attention in one block
    out, lse = fn()
    whole, whole_lse = fn(T)
    assert _relative_error(out, whole) < 1e-5 and _relative_error(lse, whole_lse) < 1e-5


def test_qjl_unpacked_signs_stay_within_their_block(small_blocks, monkeypatch):
    """QJL off the CPU's 1-bit matmul path (GPUs, prefill) unpacks sign bits to ±1 floats: one block at a time."""
    from kvq_backends_qjl import attend as qjl_attend

    monkeypatch.setattr(qjl_attend, "BITS_MATMUL_MAX_ROWS", 0)
    fn, _ = _attention("qjl", {"outlier_channels": 4}, "affine", {"bits": 4})
    extra = _peak_above_inputs(fn)
    side = 4 * B * H_KV * BLOCK * D
    bound = (COPIES["qjl"] + COPIES["affine"]) * side + 4 * 4 * B * H_Q * BLOCK + SLACK
    print(f"qjl (unpacked signs) + affine:4: peak {extra / 2**20:.2f} MiB, bound {bound / 2**20:.2f} MiB")
    assert extra <= bound


def test_default_block_is_bounded_by_vector_budget():
    """At a model's decode shapes the budget, not the score budget, sets the block: 4096 tokens at 8 KV heads of
    head_dim 128 and 32 query heads (8 KiB of float32 key and value a token), however long the context."""
    from kvq.attention import VECTOR_BUDGET_BYTES, block_size_for, token_bytes_of

    per_token = token_bytes_of(1, 8, 128, 128)
    assert per_token == 8192
    assert block_size_for(1, 32, 1, 32768, per_token) == VECTOR_BUDGET_BYTES // per_token == 4096
    assert block_size_for(1, 32, 1, 32768) == 32768  # scores alone: the whole context in one block
    assert block_size_for(1, 32, 1, 1000, per_token) == 1000
    assert block_size_for(64, 32, 1, 32768, token_bytes_of(64, 8, 128, 128)) == 256  # at least 256
