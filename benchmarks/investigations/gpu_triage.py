"""The numbers behind the tests that failed on the H200 after the attention-engine move (issue #49), on a GPU.

Run from the repository root on the GPU host (kvq's wheels and MLX on PYTHONPATH, as benchmarks/gpu_session.sh):

    MLX_ENABLE_TF32=0 python3 benchmarks/investigations/gpu_triage.py

Prints: which implementation a ``kernels="off"`` cache binds its decode step with on that device (the hot-path
depth test found no bound step there), the packed rows' differences from the rows alone per decode step (the rows
that have compressed nothing are attended in pure MLX alone and by the ragged kernel packed), a centred layer's
fused-kernel error beside MLX's own float16 parts, a rotating cache's active memory after its prompt, one decode
step and 200, and test_hot_path_depth.py run alone (to tell a failure of its own from another test's state).
"""
import sys, gc
sys.path.insert(0, "tests")
import mlx.core as mx, numpy as np
print("device", mx.default_device())

def section(name):
    print("\n=====", name, flush=True)

# 1. hot path: which implementation the plan picks with kernels=off on a GPU, and does bind run?
section("hot path")
try:
    from kvq.cache import KVQCache, make_config, engine
    from kvq.cache import choice
    from kvq.plugins import registry
    import test_hot_path_depth as h
    impl = registry().implementations[("affine", "mlx")]
    cache = KVQCache(make_config("affine", bits=4, sinks=4, window=16, flush=4, kernels="off"))
    k, v = h._data(1, 60)
    cache.update_and_fetch(k, v); cache.release_chunk()
    q = mx.random.normal((1, 4, 1, 64)).astype(mx.float16)
    cache.update_and_fetch(*h._data(1, 1, seed=20))
    keys = cache.compressed_keys.view()
    print("own_attend", choice.own_attend(cache.config), "keys", None if keys is None else keys.shape, "window", cache.window.length)
    plan = choice.attend_plan(cache.config, keys, q)
    print(plan.explain())
    ch = plan.choices.get("attend")
    print("choice impl is registry mlx impl:", ch is not None and ch.implementation is impl, ch and ch.backend, type(ch.implementation) if ch else None)
    print("bind_dense attr:", getattr(ch.implementation, "bind_dense", None))
    from kvq.contract import BindsDense, optional_hook
    print("optional_hook:", optional_hook(ch.implementation, BindsDense))
    print("fused:", cache._fused_attend(q, 0.125) is not None)
except Exception as e:
    import traceback; traceback.print_exc()

# 2. packed rows: max differences on the GPU
section("packed rows")
try:
    import test_packed_rows as p
    import warnings
    for method in ("affine", "turboquant"):
        packed, plain = p.batch_pair(p.config(method), (30, 6, 9))
        diffs = []
        for t, (g, w) in enumerate(p.decode((packed, plain), 13)):
            d = mx.abs(g - w)
            diffs.append((t, float(mx.max(d)), float(mx.max(mx.abs(w))), str(g.dtype)))
        print(method, "compressed-nothing rows: step, max|diff|, max|want|, dtype:", diffs)
    from kvq.cache.guard import OutlierLayerWarning
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OutlierLayerWarning)
        packed, plain = p.batch_pair(p.config("turboquant", window=12), (40, 16, 30), outlier=1)
        out = []
        for t, (g, w) in enumerate(p.decode((packed, plain), 1) + p.decode((packed, plain), 6, seed=50)):
            out.append((t, float(mx.max(mx.abs(g - w))), [float(mx.max(mx.abs(g[i] - w[i]))) for i in range(3)]))
        print("first compression differs: step, max|diff|, per row:", out)
        print("packed:", packed.packed)
except Exception:
    import traceback; traceback.print_exc()

# 3. centred layer through the fused kernel
section("centred layer")
try:
    import test_outlier_layers as o
    from kvq.cache import KVQCache, make_config
    for method, bits in [("turboquant", 4), ("turboquant", 3), ("affine", 4)]:
        keys, values = (x.astype(mx.float16) for x in o.keys_values("offsets"))
        q = mx.random.normal((o.B, 2 * o.H, 1, o.D), key=mx.random.key(3)).astype(mx.float16)
        outs = {}
        for kernels in ("auto", "off"):
            cache = KVQCache(make_config(method, bits=bits, window=32, kernels=kernels).for_layer(0))
            cache.update_and_fetch(keys, values); cache.release_chunk()
            outs[kernels] = cache.attend(q, o.D ** -0.5).astype(mx.float32)
            if kernels == "off":
                outs["float32"] = cache.attend(q.astype(mx.float32), o.D ** -0.5)
        print(method, bits, "auto vs f32", o.relative(outs["auto"], outs["float32"]), "off vs f32", o.relative(outs["off"], outs["float32"]),
              "auto vs off", o.relative(outs["auto"], outs["off"]))
except Exception:
    import traceback; traceback.print_exc()

# 4. rotating memory: where the 8 bytes come from
section("rotating memory")
try:
    import test_rotating_cache as r
    from kvq.cache import RotatingKVQCache, make_config
    config = make_config("turboquant", bits=4, window=64, flush=32)
    r._fill(RotatingKVQCache(config, 1024, 0), 203, 0, prompt=200)
    before = r._settle()
    ours = RotatingKVQCache(config, 1024, 0)
    r._fill(ours, 1100, 0)
    a = r._settle() - before
    r._fill(ours, 1101, 1100)
    b = r._settle() - before
    r._fill(ours, 1300, 1101)
    c = r._settle() - before
    print("after prompt", a, "after 1 decode", b, "after 200", c, "nbytes", ours.nbytes)
except Exception:
    import traceback; traceback.print_exc()

section("hot path test file alone")
import subprocess
r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "tests/test_hot_path_depth.py"],
                   capture_output=True, text=True, timeout=200)
print(r.stdout[-3000:], r.stderr[-1000:])
