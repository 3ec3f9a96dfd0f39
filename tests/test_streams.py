"""kvq_metal's streams kernel description (issue #21), on the CPU: for qjl keys with affine values,
turboquant_prod and vecinfer, the pure-MLX reference of the kernel (:func:`kvq_metal.reference.decode_attend_streams`)
over each method's :class:`~kvq_metal.streams.StreamCall` equals the method's own pure-MLX attention; so on a GPU
(tests/test_kernels_gpu.py) only the kernel against the reference remains to check. Also what the launch plan
refuses, and that the cache now asks qjl's own attention for qjl keys (the same numbers as before)."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest

import kvq
from kvq.plugins import registry
from kvq_metal import reference, streams, streams_plan
from kvq_metal.common import normal, relative_error

from test_vecinfer import _calibrated  # noqa: F401  (its data_dir fixture is not needed: ours below)


def _quantize(x, params):
    return registry().implementations[(params.method, "mlx")].kvq_quantize(x, params)


def _check(queries, keys, values, call, prepare, finish, scale, rows):
    pure = registry().implementations[(keys.method, "mlx")]
    want, want_lse = pure.kvq_attend(queries, keys, values, scale, None)
    got, lse = streams.attend_streams(queries, scale, keys.shape[1], call, prepare, finish, "cuda",
                                      attend_fn=reference.decode_attend_streams)
    assert got.shape == want.shape and lse.shape == want_lse.shape
    assert relative_error(got, want) < 1e-5
    assert mx.max(mx.abs(lse - want_lse)).item() < 1e-5
    assert streams.supported(call, rows), streams.explain(call, rows)


@pytest.mark.parametrize("D,kp,vbits,n_rep,Tq,T", [(128, {}, 4, 4, 1, 300), (64, {"outlier_channels": 0}, 2, 1, 2, 100),
                                                   (128, {"outlier_channels": 2}, 8, 8, 1, 77),
                                                   (64, {"sketch_dim": 96}, 4, 2, 1, 50)])
def test_qjl_affine_description_equals_pure_mlx(D, kp, vbits, n_rep, Tq, T):
    from kvq_backends_qjl import kernels as qjl_kernels

    kparams = kvq.make_params("qjl", **kp)
    vparams = kvq.make_params("affine", bits=vbits).for_head_dim(D)
    x = normal((2, 2, T, D), 0, mx.float16)
    keys, values = _quantize(x[:1], kparams), _quantize(x[1:], vparams)
    q = normal((1, 2 * n_rep, Tq, D), 1, mx.float16)
    call = qjl_kernels.key_stream_call(keys, values)
    _check(q, keys, values, call, qjl_kernels.prepare(keys), lambda o: o, D ** -0.5, n_rep * Tq)


@pytest.mark.parametrize("D,bits,value_method,n_rep,Tq", [(128, 4, "turboquant_prod", 4, 1),
                                                         (64, 3, "turboquant", 1, 2), (96, 2, "turboquant_prod", 8, 1),
                                                         (256, 4, "turboquant_prod", 2, 1)])
def test_turboquant_prod_description_equals_pure_mlx(D, bits, value_method, n_rep, Tq):
    from kvq_backends_turboquant.kernels import turboquant_prod

    kparams = kvq.make_params("turboquant_prod", bits=bits)
    vparams = kvq.make_params(value_method, bits=bits)
    x = normal((2, 2, 200, D), 0, mx.float16)
    keys, values = _quantize(x[:1], kparams), _quantize(x[1:], vparams)
    q = normal((1, 2 * n_rep, Tq, D), 1, mx.float16)
    pure = registry().implementations[("turboquant_prod", "mlx")]
    call = turboquant_prod.stream_call(keys, values)
    _check(q, keys, values, call, lambda r: pure.prepare_queries(r, keys), lambda o: pure.finish_values(o, values),
           D ** -0.5, n_rep * Tq)


@pytest.mark.parametrize("per_head,code_bits,sub_dim,n_rep", [(False, 6, 4, 4), (True, 8, 4, 1), (False, 5, 2, 2)])
def test_vecinfer_description_equals_pure_mlx(per_head, code_bits, sub_dim, n_rep, tmp_path, monkeypatch):
    from kvq_backends_vecinfer import storage, vq
    from kvq_backends_vecinfer.impl import _layer
    from kvq_backends_vecinfer.kernels import stream_call

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    try:
        _, kp, vp = _calibrated(per_head=per_head, code_bits=code_bits, sub_dim=sub_dim)
        kp, vp = kp.for_layer(0), vp.for_layer(0)
        x = normal((2, 2, 300, 64), 0, mx.float16)
        x = x.at[0, 1, 17].add(float("nan"))  # a key stored with the reserved pattern: NaN for that head in both
        keys, values = _quantize(x[:1], kp), _quantize(x[1:], vp)
        q = normal((1, 2 * n_rep, 1, 64), 1, mx.float16)
        smoothing = _layer(kp, 2).smoothing
        pure = registry().implementations[("vecinfer", "mlx")]
        want, _ = pure.kvq_attend(q, keys, values, 0.125, None)
        got, _ = streams.attend_streams(q, 0.125, 2, stream_call(keys, values),
                                        lambda r: vq.transform_queries(r, smoothing),
                                        lambda o: vq.inverse_transform(o, None), "cuda",
                                        attend_fn=reference.decode_attend_streams)
        assert mx.all(mx.isnan(got[:, n_rep:])).item() and mx.all(mx.isnan(want[:, n_rep:])).item()
        assert relative_error(got[:, :n_rep], want[:, :n_rep]) < 1e-5
    finally:
        storage.forget()


def test_plan_says_what_it_refuses():
    from kvq_backends_qjl import kernels as qjl_kernels

    x = normal((2, 1, 40, 64), 0, mx.float16)
    keys = _quantize(x[:1], kvq.make_params("qjl"))
    values = _quantize(x[1:], kvq.make_params("affine", bits=4).for_head_dim(64))
    call = qjl_kernels.key_stream_call(keys, values)
    assert streams.supported(call, 8) and not streams.supported(call, 9)
    assert "9 query rows" in streams.explain(call, 9)
    with pytest.raises(ValueError, match="9 query rows"):
        streams.decode_attend_streams(mx.zeros((1, 1, 9, call.query_dim)), call, "cuda")
    with pytest.raises(ValueError, match="query width"):
        streams.decode_attend_streams(mx.zeros((1, 1, 4, 7)), call, "cuda")
    wide = attrs.evolve(call.keys[0], bits=12, vec=1)
    assert "tables of at most" in streams.explain(attrs.evolve(call, keys=(wide,)), 4)
    # values of another method than affine: no call (pure MLX attends them)
    turbo = _quantize(x[1:], kvq.make_params("turboquant", bits=4))
    assert qjl_kernels.key_stream_call(keys, turbo) is None


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("tuning", [{}, {"qsh": True}, {"qsh": True, "rep": False}], ids=["registers", "qsh", "single"])
def test_tensor_core_plan_takes_qjl_and_prod_within_shared_memory(rows, tuning):
    """CUDA's tensor-core streams kernel (``decode_attend_streams_tc.cu``) takes qjl keys with affine values and
    turboquant_prod (head_dim 64 to 256, 1 to 8 rows, with the sinks and window), each within 48 KB of static
    shared memory, also with its query fragments in shared memory (``qsh``) and single code tables (``rep``
    False); it refuses 9 rows and VecInfer's vector codes, saying why (the SIMT kernel serves those)."""
    from kvq_backends_qjl import kernels as qjl_kernels

    knobs = (None, tuning.get("qsh", False), tuning.get("rep"))  # pf, qsh, rep (kvq_metal.knobs.StreamsKnobs')
    from kvq_backends_turboquant.kernels import turboquant_prod

    calls = []
    for D, kp in ((128, {}), (64, {"sketch_dim": 96}), (256, {"outlier_channels": 8, "sketch_dim": 256})):
        x = normal((2, 1, 40, D), 0, mx.float16)
        keys = _quantize(x[:1], kvq.make_params("qjl", **kp))
        values = _quantize(x[1:], kvq.make_params("affine", bits=4).for_head_dim(D))
        calls.append((qjl_kernels.key_stream_call(keys, values), D))
    for D, bits, vm in ((128, 4, "turboquant_prod"), (128, 3, "turboquant_prod"), (256, 4, "turboquant_prod"),
                        (64, 2, "turboquant")):
        x = normal((2, 1, 40, D), 0, mx.float16)
        keys = _quantize(x[:1], kvq.make_params("turboquant_prod", bits=bits))
        values = _quantize(x[1:], kvq.make_params(vm, bits=bits))
        calls.append((turboquant_prod.stream_call(keys, values), D))
    for call, D in calls:
        for dense in ((0, False, 0, 0), (2, True, D, 0)):
            template, why = streams_plan.tc_plan(streams._signature(call, rows, dense), 1, 2, *knobs)
            assert template is not None, why
            t = dict(template)
            assert t["R"] == rows and t["DQ"] == call.query_dim and t["DO"] == call.out_dim and t["ND"] == dense[0]
            tables = sum((32 if t[f"{s}_BITS"] == 1 else (1 << (2 * t[f"{s}_BITS"])) if t[f"{s}_PAIR"]
                          else (1 << t[f"{s}_BITS"]))
                         * (32 if t[f"{s}_REP"] else 1) for s in ("KA", "KB", "VA", "VB")
                         if s in ("KA", "VA") or t[f"{s}_ON"])
            assert t["QSH"] is bool(tuning.get("qsh")) and t["SLACK"] == 0  # StreamsKnobs' default
            if tuning.get("rep") is False:
                assert not any(t[f"{s}_REP"] for s in ("KA", "KB", "VA", "VB"))
            k_steps = max((t["KA_DIM"] + (t["KB_DIM"] if t["KB_ON"] else 0)) // 16, t["D"] // 16)
            fragments = 64 * k_steps if t["QSH"] else 0
            assert (max(tables, rows * t["DO"]) + rows * max(t["DQ"], t["D"]) + fragments
                    <= streams.TC_SHARED_WORDS)
    call, D = calls[0]
    assert dict(streams_plan.tc_plan(streams._signature(call, rows), 1, 2, slack=4)[0])["SLACK"] == 4
    with pytest.raises(ValueError, match="slack must be an integer from 0 to 8"):
        streams_plan.tc_plan(streams._signature(call, rows), 1, 2, slack=9)
    assert "9 query rows" in streams_plan.tc_plan(streams._signature(call, 9), 1, 2)[1]
    vector = attrs.evolve(call.keys[0], vec=4, dim=256)
    assert "vector codes" in streams_plan.tc_plan(streams._signature(attrs.evolve(call, keys=(vector,)), 4), 1, 2)[1]


def test_cache_attends_qjl_keys_with_qjl_attention_same_numbers():
    """The cache now hands qjl keys (with affine values) to qjl's own kvq_attend (which a GPU's kernel can serve);
    on the CPU that is the same blockwise computation as the per-side block protocol it used before."""
    from kvq.attention import attend_encoded
    from kvq.cache import KVQCache, engine, make_config
    from kvq.cache.centring import KeyTransform
    from kvq.cache.choice import attend_fn, block_implementation, own_attend

    cache = KVQCache(make_config("qjl", value_method="affine", value_params={"bits": 4}, window=16, flush=8, sinks=2))
    k, v = normal((1, 2, 120, 64), 3, mx.float16), normal((1, 2, 120, 64), 4, mx.float16)
    cache.update_and_fetch(k, v)
    cache.release_chunk()
    assert own_attend(cache.config)
    q = normal((1, 4, 1, 64), 5, mx.float16)
    keys, values = cache.compressed_keys.view(), cache.compressed_values.view()
    got = attend_fn(cache.config, keys, q)(q, keys, values, 0.125, None)
    want = attend_encoded(q, keys, values, 0.125, None, block_implementation("qjl", "keys"),
                          block_implementation("affine", "values"))
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    out = cache.attend(q, 0.125)
    parts = engine.attend(q, 0.125, cache.parts(1, cache.offset - 1), cache.config, KeyTransform(cache.key_mean, cache.key_scale))
    assert relative_error(out, parts) < 1e-3


def test_bound_step_matrices_equal_the_methods_transforms(tmp_path, monkeypatch):
    """The bound step runs each method's query preparation and value finish as matrices
    (:func:`kvq_metal.streams_impl.linear_matrix`): for qjl, turboquant_prod and vecinfer they equal the functions."""
    from kvq_backends_qjl.kernels import QJLKernels
    from kvq_backends_turboquant.kernels import TurboQuantProdKernels
    from kvq_backends_vecinfer import storage
    from kvq_backends_vecinfer.kernels import VecInferKernels

    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    try:
        _, vkp, vvp = _calibrated(code_bits=6)
        x = normal((2, 2, 64, 64), 0, mx.float16)
        cases = [(QJLKernels("cuda"), kvq.make_params("qjl"), kvq.make_params("affine", bits=4).for_head_dim(64)),
                 (TurboQuantProdKernels("cuda"), kvq.make_params("turboquant_prod", bits=3),
                  kvq.make_params("turboquant_prod", bits=3)),
                 (VecInferKernels("cuda"), vkp.for_layer(0), vvp.for_layer(0))]
        q = normal((1, 2, 3, 5, 64), 1)
        for impl, kp, vp in cases:
            keys, values = _quantize(x[:1], kp), _quantize(x[1:], vp)
            prepare, finish = impl._matrices(keys, values, impl.stream_call(keys, values))
            want = impl.prepare(keys)(q)
            assert relative_error(q @ prepare[:, None], want) < 1e-6, impl
            fn = impl.finish(values)
            if fn is None:
                assert finish is None
                continue
            out = normal((1, 2, 3, 5, finish.shape[0]), 2)
            assert relative_error(out @ finish, fn(out)) < 1e-6, impl
    finally:
        storage.forget()


def test_bound_step_matrices_are_kept_per_parameters_and_calibration(tmp_path, monkeypatch):
    """A cache binds at every window flush: the matrices are made once per parameters (qjl) and, for vecinfer,
    again after the calibration is read anew (a recalibration in the same process)."""
    from kvq_backends_qjl.kernels import QJLKernels
    from kvq_backends_vecinfer import storage
    from kvq_backends_vecinfer.kernels import VecInferKernels

    x = normal((2, 2, 64, 64), 0, mx.float16)
    impl = QJLKernels("cuda")
    keys = _quantize(x[:1], kvq.make_params("qjl"))
    values = _quantize(x[1:], kvq.make_params("affine", bits=4).for_head_dim(64))
    call = impl.stream_call(keys, values)
    assert impl._matrices(keys, values, call)[0] is impl._matrices(keys, values, call)[0]
    monkeypatch.setenv("KVQ_DATA_DIR", str(tmp_path))
    storage.forget()
    try:
        _, kp, vp = _calibrated(code_bits=6)
        kp, vp = kp.for_layer(0), vp.for_layer(0)
        vi = VecInferKernels("cuda")
        keys, values = _quantize(x[:1], kp), _quantize(x[1:], vp)
        call = vi.stream_call(keys, values)
        first = vi._matrices(keys, values, call)[0]
        assert vi._matrices(keys, values, call)[0] is first
        storage.forget()  # read again: new arrays, new matrices (equal here: the same file)
        again = vi._matrices(keys, values, call)[0]
        assert again is not first and relative_error(again, first) == 0.0
    finally:
        storage.forget()


def test_streams_launch_plan_is_made_once_per_signature(monkeypatch):
    """A window flush binds every layer's decode step again (:func:`kvq_metal.streams.bind_streams`): its launch
    plan (the bound kernel and merge, on CUDA) is made once per signature and kept for other token counts, which
    change only the grid; other launch knobs make another plan."""
    from kvq_backends_qjl import kernels as qjl_kernels
    from kvq_metal import dialect
    from kvq_metal.attend import splits_for

    built = []

    def fake_cuda_kernel(**kw):
        built.append(kw["name"])
        return lambda **call: [mx.zeros(s, d) for s, d in zip(call["output_shapes"], call["output_dtypes"])]

    monkeypatch.setattr(mx.fast, "cuda_kernel", fake_cuda_kernel)
    monkeypatch.setattr(dialect, "includes_work", lambda: False)
    monkeypatch.setattr(streams, "_PLANS", {})
    impl = kvq.registry().implementations[("qjl", "cuda")]
    x = normal((2, 2, 3000, 128), 0, mx.bfloat16)
    keys = _quantize(x[:1], kvq.make_params("qjl"))
    values = _quantize(x[1:], kvq.make_params("affine", bits=4).for_head_dim(128))
    q, w = normal((1, 8, 1, 128), 1, mx.bfloat16), normal((1, 2, 132, 128), 2, mx.bfloat16)

    def step(T):
        k, v = keys.tokens(0, T), values.tokens(0, T)
        call = qjl_kernels.key_stream_call(k, v)
        prepare, finish = impl._matrices(k, v, call)
        return streams.bind_streams(call, q, 128 ** -0.5, prepare, finish, "cuda", w[:, :, :4], w[:, :, :4],
                                    w[:, :, 4:], w[:, :, 4:])

    first = step(300)
    made = len(built)
    for T in (1000, 3000):
        later = step(T)
        assert len(built) == made  # no kernel object made again
        (main, merge), (main0, merge0) = later.launches, first.launches
        assert main.call is main0.call and merge.call is merge0.call
        tile = 16 * streams.TUNING.nt * streams.THREADS // 32
        assert main.grid[1] == splits_for(2, T, "cuda", tile, streams.TUNING.groups) + 2
    out = later(q, w[:, :, 4:], w[:, :, 4:])
    assert out.shape == (1, 8, 1, 128) and out.dtype == mx.bfloat16
    monkeypatch.setattr(streams, "TUNING", attrs.evolve(streams.TUNING, qsh=not streams.TUNING.qsh))
    assert step(300).launches[0].call is not first.launches[0].call and len(built) == made + 1
