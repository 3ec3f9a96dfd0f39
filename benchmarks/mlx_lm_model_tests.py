"""Run mlx-lm's own model tests (its ``tests/test_models.py``) with kvq's caches swapped in (issue #25).

    git clone https://github.com/ml-explore/mlx-lm && git -C mlx-lm show REV:tests/test_models.py > /tmp/test_models.py
    R=benchmarks/results/mlx-lm-model-tests
    python benchmarks/mlx_lm_model_tests.py --tests /tmp/test_models.py --tests-ref ml-explore/mlx-lm@REV \
        --method mlx-lm --out $R          (first: the same file with mlx-lm's own caches, on this machine)
    python benchmarks/mlx_lm_model_tests.py --tests /tmp/test_models.py --tests-ref ml-explore/mlx-lm@REV \
        --method fp16 --out $R            (then fp16, turboquant:4, affine:4 ...)
    python benchmarks/mlx_lm_model_tests.py --report --out $R      (only rewrites the markdown from the JSON)

``REV`` is the tag of the installed mlx-lm (``git tag -l v0.32.2``) where the repository has one, else the commit
nearest it (``git log -- mlx_lm/_version.py``). The file is not part of kvq (kvq copies no other project's code): it
is read where it lies and run by pytest in this process (:func:`pytest.main`, :class:`Recorder` as a plugin, none
of kvq's pytest settings) while :class:`KvqSwap` makes every cache that mlx-lm builds for a model kvq's:

* ``mlx_lm.models.cache.make_prompt_cache`` (and its binding in the test file and in every loaded ``mlx_lm``
  module) becomes :func:`kvq.make_prompt_cache` with ``--method``;
* every model class of ``mlx_lm.models`` that defines ``make_cache`` gets one that returns kvq's caches for the
  model (mlx-lm's own ``make_cache`` still answers kvq, which asks it which layers slide).

The tests check the shapes and dtypes of the outputs, not their values, so every call of a model with kvq's caches
is repeated with mlx-lm's own caches and the outputs compared (:class:`KvqSwap`); where the call raises, mlx-lm's
is computed to see whether it raises the same (:func:`diagnose`).

A model whose attention kvq cannot serve (:mod:`kvq.cache.servable`) keeps mlx-lm's caches with an
``UnservableModelWarning``; each such model type is listed and its tests are counted as run on mlx-lm's caches, not
on kvq's. Tests that build no model cache (RoPE, masks, SSM kernels, weight conversion) are counted apart too. Two
kinds of test are excluded, found by reading the file (:func:`exclusions`): those that assert that a cache is of
mlx-lm's class (``assertIsInstance(c, KVCache)``: a kvq cache is not), and those that build mlx-lm's cache classes
themselves (``KVCache()``: tests of those classes, with no model whose caches kvq could make). Both still run; their
outcomes are listed, not counted. A test whose model has more than ``--max-weights-gb`` of weights is skipped with
the reason: kvq's attention computes the graph it is part of (:func:`kvq.attention.run_block`), so a test that
builds a full-size model and never computes it (mlx-lm's cohere test: Command R's 35B parameters) would.

Each test starts from ``mx.random.seed(0)``, so that a run's measurements repeat. By default every token is
compressed from the first (``--sinks 0 --window 0 --flush 1``): with kvq's defaults (4 sinks, a 128-token window)
the few tokens these tests run would never leave 16 bits. For each failed comparison (``mx.allclose``,
``mx.array_equal``) of a test the largest difference is recorded, so a test whose tolerance a 4-bit cache cannot
meet says by how much.

Writes ``OUT/<method>.json`` and ``OUT/<method>.md``, and ``OUT/README.md`` from every JSON there.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import json
import pkgutil
import platform
import sys
import tempfile
import time
import traceback
import unittest
import warnings
from pathlib import Path

from kvq.bench.output import slug

#: The names of mlx-lm's cache classes a test may assert or build (``mlx_lm.models.cache``).
MLX_CACHE_CLASSES = ("KVCache", "RotatingKVCache", "QuantizedKVCache", "ChunkedKVCache", "BatchKVCache",
                     "BatchRotatingKVCache", "ArraysCache", "MambaCache", "CacheList")
#: The ``--method`` that swaps nothing: mlx-lm's own caches, the baseline of this machine.
BASELINE = "mlx-lm"
#: Exclusion reasons (:func:`exclusions`).
TYPE_ASSERTION = "type assertion"
CACHE_CLASS_TEST = "mlx-lm cache class test"


def method_kwargs(spec: str, sinks: int, window: int, flush: int) -> dict:
    """Keyword arguments of :func:`kvq.make_prompt_cache` for a method string of ``kvq eval`` (``fp16``,
    ``turboquant:4``, ``affine:4``, ``qjl+affine:4`` ...; :mod:`kvq.evaluation.spec`), with these cache options
    unless the string sets its own (``affine:4[window=8]``).

    ``None`` for :data:`BASELINE` (nothing swapped).

    :raises ValueError: a malformed string, or ``mlx-affine`` (mlx-lm's own cache, not kvq's).
    """
    from kvq.evaluation.spec import parse_method

    if spec == BASELINE:
        return None
    if spec == "kvcache":
        raise ValueError(f"{spec!r} is mlx-lm's own cache: run --method {BASELINE} (nothing swapped)")
    # fp16 names kvq's 16-bit cache here, as in the result files of this runner (kvq-fp16 in other commands)
    parsed = parse_method("kvq-fp16" if spec == "fp16" else spec)
    if parsed.is_mlx:
        raise ValueError(f"{spec!r} is mlx-lm's own quantized cache; this runner swaps in kvq's caches")
    kwargs = parsed.cache_kwargs(sinks, window)
    kwargs.setdefault("flush", flush)
    return kwargs


def model_type(model) -> str:
    """``model``'s mlx-lm ``model_type`` (its args', else its own), else its module's name."""
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None) or type(model).__module__


class KvqSwap:
    """While entered: every cache mlx-lm builds for a model is kvq's (see the module docstring), and failed
    ``mx.allclose``/``mx.array_equal`` comparisons are measured. :attr:`events` lists each cache request (model
    type, whether kvq served it, kvq's reason when not, or the error kvq raised), :attr:`comparisons` each failed
    comparison; :class:`Recorder` takes them per test.

    The tests check the shapes and dtypes of a model's outputs, not their values. So that a pass says something
    about the values too, each set of kvq caches handed out has a shadow: mlx-lm's own caches for the same model,
    which every call of the model's ``Model`` class with the kvq caches repeats its inputs on; the two outputs
    are compared (:attr:`agreement`: largest absolute difference and the reference's largest magnitude, per call)
    wherever both can be computed.

    :param kwargs: keyword arguments of :func:`kvq.make_prompt_cache` (:func:`method_kwargs`), or ``None``: the
        baseline, which swaps nothing and only records.
    :param max_weights_gb: a test that asks kvq's caches for a model with more GiB of weights is skipped
        (``unittest.SkipTest``, reason given): kvq's attention evaluates the graph it is part of, so a test that
        builds a full-size model and never evaluates it would compute all its weights (mlx-lm's cohere test: the
        defaults of Command R, 35B parameters).
    """

    def __init__(self, kwargs: dict | None, max_weights_gb: float | None = None) -> None:
        self.kwargs = kwargs
        self.max_weights_gb = max_weights_gb
        self.events: list[dict] = []
        self.comparisons: list[dict] = []
        self.agreement: list[dict] = []
        self._shadows: dict[int, tuple[list, list]] = {}  # id(kvq caches) -> (kvq caches, mlx-lm's caches)
        self._calling = 0  # > 0 inside a model call: nested Model calls (a wrapper's language model) do not shadow
        self._inside = 0  # > 0 while kvq builds caches: mlx-lm's make_cache then answers as mlx-lm's
        self._undo: list = []
        self.patched_classes: list[str] = []
        self.unimportable: dict[str, str] = {}

    def make_prompt_cache(self, model, max_kv_size=None):
        """kvq's caches for ``model`` (mlx-lm's ``make_prompt_cache(model, max_kv_size)`` signature), recorded in
        :attr:`events`; mlx-lm's own where kvq declines the model (``UnservableModelWarning``), and always for the
        baseline (``kwargs`` ``None``)."""
        import kvq
        from kvq.cache import BatchKVQCache, KVQCache, UnservableModelWarning
        from kvq.cache.patch import _ORIGINAL_MAKE

        from mlx.utils import tree_flatten

        weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))  # (shapes only: nothing evaluated)
        event = {"model_type": model_type(model), "weights_gb": round(weights / 2**30, 3)}
        self.events.append(event)
        if self.kwargs is not None and self.max_weights_gb is not None and weights > self.max_weights_gb * 2**30:
            event.update(made=False, too_big=True)
            raise unittest.SkipTest(
                f"runner: a {event['model_type']} of {weights / 2**30:.1f} GiB of weights; kvq's attention evaluates "
                f"as it goes (kvq.attention.run_block), which computes the weights, where mlx-lm's test never "
                f"evaluates them; above --max-weights-gb {self.max_weights_gb}")
        self._inside += 1
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                caches = _ORIGINAL_MAKE(model, max_kv_size) if self.kwargs is None else \
                    kvq.make_prompt_cache(model, max_kv_size=max_kv_size, **self.kwargs)
        except Exception as exc:
            event.update(served=False, error=f"{type(exc).__name__}: {exc}")
            raise
        finally:
            self._inside -= 1
        for w in caught:
            if issubclass(w.category, UnservableModelWarning):
                event["unserved"] = str(w.message)
            else:  # not ours to swallow
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        event["served"] = any(isinstance(c, (KVQCache, BatchKVQCache)) for c in caches)
        event["made"] = True
        event["caches"] = sorted({type(c).__name__ for c in caches})
        if event["served"]:
            self._inside += 1
            try:
                self._shadows[id(caches)] = (caches, _ORIGINAL_MAKE(model, max_kv_size))
            finally:
                self._inside -= 1
        return caches

    def clear(self) -> None:
        """Forget the requests, comparisons, agreement and shadows so far (a new test starts)."""
        self.events.clear()
        self.comparisons.clear()
        self.agreement.clear()
        self._shadows.clear()

    def _call_for(self, original):
        """A ``Model.__call__`` that, called with kvq caches :meth:`make_prompt_cache` handed out, repeats the
        call with their shadow (mlx-lm's caches) and records how far apart the outputs are (:meth:`_agree`)."""
        import inspect

        swap, signature = self, inspect.signature(original)

        def __call__(model, *args, **kwargs):
            if swap._calling or swap._inside or not swap._shadows:
                return original(model, *args, **kwargs)
            try:
                bound = signature.bind(model, *args, **kwargs)
            except TypeError:
                return original(model, *args, **kwargs)
            cache = bound.arguments.get("cache")
            shadow = swap._shadows.get(id(cache))
            shadowed = shadow is not None and shadow[0] is cache
            if shadowed:
                bound.arguments["cache"] = shadow[1]
            swap._calling += 1
            try:
                try:
                    out = original(model, *args, **kwargs)
                except Exception as exc:
                    if shadowed:  # does mlx-lm's run fail the same way once its output is computed?
                        swap._evaluated_failure(model, exc, lambda: original(*bound.args, **bound.kwargs))
                    raise
                if shadowed:
                    try:
                        reference = original(*bound.args, **bound.kwargs)
                    except Exception as exc:  # noqa: BLE001 - mlx-lm's run failing is recorded, not raised
                        swap.agreement.append({"model_type": model_type(model), "error": f"mlx-lm's caches: "
                                               f"{type(exc).__name__}: {_short(str(exc), 200)}"})
                    else:
                        swap._agree(model, out, reference)
            finally:
                swap._calling -= 1
            return out

        __call__.__doc__ = original.__doc__
        return __call__

    def _evaluated_failure(self, model, error: Exception, reference) -> None:
        """Record in :attr:`agreement` what mlx-lm's caches give for the call that raised ``error`` with kvq's, once
        the output of ``reference()`` (the call with mlx-lm's caches) is computed: kvq's attention computes the
        graph it is part of, mlx-lm's tests do not, so an error of MLX itself (its CPU back end has no float16
        ``gather_mm``) shows with kvq's caches only unless mlx-lm's output is computed too."""
        import mlx.core as mx

        entry = {"model_type": model_type(model), "kvq_error": f"{type(error).__name__}: {_short(str(error), 200)}"}
        try:
            mx.eval(reference())
            entry["mlx_lm_evaluated"] = "computed"
        except Exception as exc:  # noqa: BLE001 - the point is to see it
            entry["mlx_lm_evaluated"] = f"{type(exc).__name__}: {_short(str(exc), 200)}"
        self.agreement.append(entry)

    def _agree(self, model, out, reference) -> None:
        """Record how far ``out`` (kvq's caches) is from ``reference`` (mlx-lm's) in :attr:`agreement`, or why it
        could not be computed."""
        import mlx.core as mx

        entry = {"model_type": model_type(model)}
        if not isinstance(out, mx.array) or not isinstance(reference, mx.array):
            entry["error"] = f"outputs are {type(out).__name__}, not arrays"
        else:
            entry.update(dtype=str(out.dtype).split(".")[-1], shape=list(out.shape))
            try:
                a, b = out.astype(mx.float32), reference.astype(mx.float32)
                entry.update(max_abs_diff=float(mx.max(mx.abs(a - b)).item()),
                             max_abs_ref=float(mx.max(mx.abs(b)).item()))
            except Exception as exc:  # noqa: BLE001 - e.g. MLX's CPU back end computes no float16 gather_mm
                entry["error"] = f"{type(exc).__name__}: {_short(str(exc), 200)}"
        self.agreement.append(entry)

    def _make_cache_for(self, original):
        """A ``make_cache`` method that gives kvq's caches, around a model class's own ``original``."""
        swap = self

        def make_cache(model, *args, **kwargs):
            """kvq's caches for this model (benchmarks/mlx_lm_model_tests.py); mlx-lm's while kvq asks."""
            if swap._inside:  # kvq asking which caches mlx-lm would make
                return original(model, *args, **kwargs)
            return swap.make_prompt_cache(model, kwargs.get("max_kv_size"))

        return make_cache

    def _compare(self, name, original):
        """``mx.allclose``/``mx.array_equal`` as before, recording in :attr:`comparisons` how far apart the two
        arrays were when the answer is False."""
        swap = self

        def compare(a, b, *args, **kwargs):
            """MLX's comparison, its answer unchanged; a False one is measured."""
            result = original(a, b, *args, **kwargs)
            try:
                if not result.item():
                    import mlx.core as mx

                    a32, b32 = mx.array(a).astype(mx.float32), mx.array(b).astype(mx.float32)
                    diff = mx.abs(a32 - b32)
                    entry = {"check": name, "shape": list(a32.shape), "max_abs_diff": float(mx.max(diff).item()),
                             "max_abs_ref": float(mx.max(mx.abs(b32)).item())}
                    if name == "allclose":
                        rtol = kwargs.get("rtol", args[0] if args else 1e-5)
                        atol = kwargs.get("atol", args[1] if len(args) > 1 else 1e-8)
                        entry.update(rtol=rtol, atol=atol, worst_over_tolerance=float(
                            mx.max(diff / (atol + rtol * mx.abs(b32))).item()))
                    swap.comparisons.append(entry)
            except Exception as exc:  # noqa: BLE001 - a measurement aid must not change the test's outcome
                swap.comparisons.append({"check": name, "unmeasured": f"{type(exc).__name__}: {exc}"})
            return result

        return compare

    def _set(self, owner, name, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self) -> "KvqSwap":
        import mlx.core as mx
        import mlx.nn as nn
        import mlx_lm.models
        from mlx_lm.models import cache as mlx_cache

        import kvq  # noqa: F401 - imported first, so that kvq keeps mlx-lm's original functions

        original = mlx_cache.make_prompt_cache
        for name, module in list(sys.modules.items()):
            if name.startswith("mlx_lm") and getattr(module, "make_prompt_cache", None) is original:
                self._set(module, "make_prompt_cache", self.make_prompt_cache)
        for info in sorted(pkgutil.iter_modules(mlx_lm.models.__path__), key=lambda i: i.name) if self.kwargs \
                is not None else ():  # (the baseline records make_prompt_cache only)
            name = f"mlx_lm.models.{info.name}"
            try:
                module = importlib.import_module(name)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - an optional dependency missing (olmo exits)
                self.unimportable[name] = f"{type(exc).__name__}: {exc}"
                continue
            for cls in list(vars(module).values()):
                if not (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == name):
                    continue
                if "make_cache" in vars(cls):
                    self._set(cls, "make_cache", self._make_cache_for(vars(cls)["make_cache"]))
                    self.patched_classes.append(f"{name}.{cls.__name__}")
                if cls.__name__ == "Model" and "__call__" in vars(cls):
                    self._set(cls, "__call__", self._call_for(vars(cls)["__call__"]))
        for name in ("allclose", "array_equal"):
            self._set(mx, name, self._compare(name, getattr(mx, name)))
        return self

    def bind(self, module) -> None:
        """Swap ``module``'s own binding of mlx-lm's ``make_prompt_cache`` (the test file imports it by name)."""
        from kvq.cache.patch import _ORIGINAL_MAKE, make_prompt_cache as kvq_patched

        if getattr(module, "make_prompt_cache", None) in (_ORIGINAL_MAKE, kvq_patched):
            self._set(module, "make_prompt_cache", self.make_prompt_cache)

    def __exit__(self, *exc) -> None:
        while self._undo:
            owner, name, value = self._undo.pop()
            setattr(owner, name, value)


def _assigned_cache_names(tree: ast.AST) -> set[str]:
    """The names the test file binds to mlx-lm's cache classes (``from mlx_lm.models.cache import KVCache``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "mlx_lm.models.cache":
            names |= {a.asname or a.name for a in node.names if a.name in MLX_CACHE_CLASSES}
    return names


def _class_refs(node: ast.AST, names: set[str]) -> list[str]:
    """Cache class names (bare or ``cache.KVCache``) referred to in ``node``."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in names:
            found.append(sub.id)
        elif isinstance(sub, ast.Attribute) and sub.attr in MLX_CACHE_CLASSES:
            found.append(sub.attr)
    return found


def exclusions(source: str) -> dict[str, dict]:
    """Tests of the file to exclude from kvq's counts, by test name: ``{"reason": TYPE_ASSERTION or
    CACHE_CLASS_TEST, "detail": ..., "lines": [...]}``.

    A type assertion is ``assertIsInstance(x, C)``, ``isinstance(x, C)`` or ``type(x) is C`` (``==``) with ``C`` one
    of mlx-lm's cache classes. A cache class test builds one of those classes itself (``KVCache()``), which no
    model asked for.
    """
    tree = ast.parse(source)
    names = _assigned_cache_names(tree) | set(MLX_CACHE_CLASSES)
    out = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef) and node.name.startswith("test")):
            continue
        asserts, builds = [], []
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                func = sub.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if called in ("assertIsInstance", "isinstance") and len(sub.args) >= 2 and \
                        _class_refs(sub.args[1], names):
                    asserts.append((sub.lineno, ast.unparse(sub)))
                elif called in names:
                    builds.append((sub.lineno, ast.unparse(sub)))
            elif isinstance(sub, ast.Compare) and any(isinstance(o, (ast.Is, ast.Eq)) for o in sub.ops) and \
                    isinstance(sub.left, ast.Call) and getattr(sub.left.func, "id", None) == "type" and \
                    any(_class_refs(c, names) for c in sub.comparators):
                asserts.append((sub.lineno, ast.unparse(sub)))
        if asserts:
            out[node.name] = {"reason": TYPE_ASSERTION, "lines": [n for n, _ in asserts],
                              "detail": "; ".join(sorted({t for _, t in asserts}))}
        elif builds:
            out[node.name] = {"reason": CACHE_CLASS_TEST, "lines": [n for n, _ in builds],
                              "detail": "builds " + ", ".join(sorted({t.split("(")[0] for _, t in builds}))}
    return out


def _short(text: str, limit: int = 600) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Recorder:
    """A pytest plugin: one row per test and per subtest (``unittest``'s ``subTest``), with its outcome, its
    error, the cache requests :class:`KvqSwap` saw while it ran and the comparisons it failed."""

    def __init__(self, swap: KvqSwap, excluded: dict[str, dict]) -> None:
        self.swap = swap
        self.excluded = excluded
        self.rows: list[dict] = []
        self._subtests: dict[str, int] = {}
        self._mark = 0.0  # when the running test, or its last subtest, started

    def pytest_collection_modifyitems(self, session, config, items) -> None:
        """Swap the test file's own ``make_prompt_cache`` binding."""
        for module in {item.module for item in items if getattr(item, "module", None) is not None}:
            self.swap.bind(module)

    def pytest_runtest_setup(self, item) -> None:
        """Forget what earlier tests requested, and seed MLX's generator (the tests draw random weights unseeded:
        seeded, a run's measurements repeat)."""
        import mlx.core as mx

        self.swap.clear()
        mx.random.seed(0)
        self._mark = time.perf_counter()

    def _take(self) -> tuple[list, list, list]:
        taken = list(self.swap.events), list(self.swap.comparisons), list(self.swap.agreement)
        self.swap.events.clear()  # (shadows stay: a subtest's caches may serve the next)
        self.swap.comparisons.clear()
        self.swap.agreement.clear()
        return taken

    def pytest_runtest_logreport(self, report) -> None:
        """A row per subtest report, and per test (its setup's failure or skip, else its call)."""
        from _pytest.subtests import SubtestReport

        name = report.nodeid.split("::")[-1]
        if isinstance(report, SubtestReport):
            label = report.context.msg or ", ".join(f"{k}={v}" for k, v in report.context.kwargs.items())
            self._subtests[report.nodeid] = self._subtests.get(report.nodeid, 0) + 1
            self._row(f"{name} [{label}]", name, report, parent=name)
        elif report.when == "call" or (report.when == "setup" and not report.passed):
            self._row(name, name, report, parent=None, had_subtests=report.nodeid in self._subtests)

    def _row(self, label, test, report, parent, had_subtests=False) -> None:
        events, comparisons, agreement = self._take()
        now = time.perf_counter()
        seconds, self._mark = now - self._mark, now
        outcome = report.outcome
        error = None
        if report.failed:
            crash = getattr(report.longrepr, "reprcrash", None)
            error = _short(crash.message if crash is not None else str(report.longrepr))
        elif report.skipped:
            longrepr = report.longrepr
            error = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        served = sorted({e["model_type"] for e in events if e.get("served")})
        unserved = {e["model_type"]: e["unserved"] for e in events if e.get("unserved")}
        made = any(e.get("made") for e in events)  # (kvq's caches or not: SSM-only models keep mlx-lm's)
        row = {"test": label, "outcome": outcome, "error": error, "parent": parent,
               "cache": "kvq" if served else "mlx-lm (kvq declined)" if unserved else "mlx-lm" if made else "none",
               "served_model_types": served, "unserved": unserved,
               "kvq_errors": sorted({e["error"] for e in events if e.get("error")}),
               "weights_gb": max([e["weights_gb"] for e in events], default=None),
               "comparisons": comparisons, "agreement": agreement, "seconds": round(seconds, 3)}
        if had_subtests:
            row["container"] = True  # its subtests are the rows that count
        exclusion = self.excluded.get(test)
        if exclusion is not None:
            row["excluded"] = exclusion["reason"]
        self.rows.append(row)


def counts(rows: list[dict]) -> dict:
    """Counted rows (not excluded, not a container of subtests) by outcome, and passes by the caches they used."""
    counted = [r for r in rows if not r.get("excluded") and not r.get("container")]
    out = {"counted": len(counted)}
    for outcome in ("passed", "failed", "skipped"):
        out[outcome] = sum(r["outcome"] == outcome for r in counted)
    passed = [r for r in counted if r["outcome"] == "passed"]
    out["passed_on_kvq_caches"] = sum(r["cache"] == "kvq" for r in passed)
    out["passed_on_mlx_lm_caches_kvq_declined"] = sum(r["cache"] == "mlx-lm (kvq declined)" for r in passed)
    out["passed_on_mlx_lm_caches_other"] = sum(r["cache"] == "mlx-lm" for r in passed)
    out["passed_without_a_model_cache"] = sum(r["cache"] == "none" for r in passed)
    out["excluded"] = sum(bool(r.get("excluded")) and not r.get("container") for r in rows)
    return out


#: Diagnoses of a failure (:func:`diagnose`).
SAME_ERROR_EVALUATED = "MLX: mlx-lm's caches raise the same once their output is computed"
BASELINE_FAILS = "fails with mlx-lm's caches too (baseline run)"
TOLERANCE_MISSED = "a comparison with an exact reference missed its tolerance"
KVQ_REFUSED = "kvq.make_prompt_cache refused the model (the method's limits, named in the error)"
UNEXPLAINED = "unexplained"
BASELINE_ITSELF = "fails with mlx-lm's own caches on this machine"


def diagnose(row: dict, baseline: dict | None) -> str:
    """Why a failed row failed, as far as the run shows it: the error mlx-lm's caches give too once computed
    (:meth:`KvqSwap._evaluated_failure`), a failure of the same test in the ``baseline`` document (``--method
    mlx-lm``), kvq refusing the model when asked for its caches (affine: a head_dim of 8 or 16, which
    ``mx.quantize`` cannot group), a failed comparison (:attr:`KvqSwap.comparisons`, measured), else
    :data:`UNEXPLAINED`."""
    for entry in row.get("agreement", []):
        if "kvq_error" in entry and entry.get("mlx_lm_evaluated") == entry["kvq_error"] and \
                row["error"] and entry["kvq_error"].split(":")[0] in row["error"]:
            return SAME_ERROR_EVALUATED
    if baseline is not None:
        same = [r for r in baseline["tests"] if r["test"] == row["test"]]
        if same and same[0]["outcome"] == "failed":
            return BASELINE_FAILS
    if row.get("kvq_errors"):
        return KVQ_REFUSED
    if any("max_abs_diff" in m for m in row.get("comparisons", [])):
        return TOLERANCE_MISSED
    return UNEXPLAINED


def agreement(rows: list[dict]) -> dict:
    """Per model type and dtype, the worst relative difference of kvq's outputs from mlx-lm's over every shadowed
    call (largest absolute difference over the reference's largest magnitude), the calls compared, and those not
    compared (an output that could not be computed)."""
    out: dict[str, dict] = {}
    for r in rows:
        for a in r.get("agreement", []):
            mtype = out.setdefault(a["model_type"], {})
            if "max_abs_diff" in a:
                d = mtype.setdefault(a["dtype"], {"calls": 0, "worst_relative": 0.0, "worst_abs": 0.0})
                d["calls"] += 1
                d["worst_relative"] = max(d["worst_relative"], a["max_abs_diff"] / max(a["max_abs_ref"], 1e-30))
                d["worst_abs"] = max(d["worst_abs"], a["max_abs_diff"])
            else:
                mtype["not_compared"] = mtype.get("not_compared", 0) + 1
    return dict(sorted(out.items()))


def run(tests: Path, method: str, sinks: int = 0, window: int = 0, flush: int = 1, select: str | None = None,
        max_weights_gb: float | None = 4.0, baseline: dict | None = None) -> dict:
    """Run the test file with kvq's caches for ``method`` swapped in (:class:`KvqSwap`, whose ``max_weights_gb`` this
    is); the document :func:`main` writes as JSON: settings, versions, counts, excluded tests, unserved model types,
    failures (each with its :func:`diagnose`, against ``baseline``, the document of a ``mlx-lm`` run), kvq's
    agreement with mlx-lm's outputs (:func:`agreement`) and every row of :class:`Recorder`."""
    import mlx.core as mx
    import mlx_lm
    import pytest

    import kvq

    kwargs = method_kwargs(method, sinks, window, flush)
    source = tests.read_text()
    excluded = exclusions(source)
    started = time.perf_counter()
    with KvqSwap(kwargs, max_weights_gb) as swap, tempfile.TemporaryDirectory() as root:
        recorder = Recorder(swap, excluded)
        ini = Path(root) / "pytest.ini"
        ini.write_text("[pytest]\n")  # none of kvq's pytest settings: the file runs as mlx-lm's CI would run it
        args = [str(tests), "-c", str(ini), "--rootdir", root, "-p", "no:cacheprovider", "--import-mode=importlib",
                "-v", "--tb=short", "-W", "ignore::DeprecationWarning"]
        if select:
            args += ["-k", select]
        exit_code = pytest.main(args, plugins=[recorder])
        patched = list(swap.patched_classes)
        unimportable = dict(swap.unimportable)
    rows = recorder.rows
    unserved = {}
    for r in rows:
        for mtype, reason in r["unserved"].items():
            unserved.setdefault(mtype, {"reason": reason, "tests": []})["tests"].append(r["test"])
    return {
        "method": method, "make_prompt_cache_kwargs": kwargs, "max_weights_gb": max_weights_gb,
        "mlx_lm": mlx_lm.__version__, "mlx": mx.__version__, "kvq": getattr(kvq, "__version__", None),
        "python": platform.python_version(), "platform": f"{platform.system()} {platform.machine()}",
        "device": str(mx.default_device()),
        "tests_file": {"path": str(tests), "sha256": hashlib.sha256(source.encode()).hexdigest()},
        "pytest_exit_code": int(exit_code), "seconds": round(time.perf_counter() - started, 1),
        "counts": counts(rows),
        "excluded": [{"test": name, **e, "outcomes": [{"test": r["test"], "outcome": r["outcome"], "error": r["error"]}
                                                      for r in rows if r["test"].split(" [")[0] == name]}
                     for name, e in sorted(excluded.items())],
        "unserved": dict(sorted(unserved.items())),
        "failures": [{**r, "diagnosis": BASELINE_ITSELF if kwargs is None else diagnose(r, baseline)} for r in rows
                     if r["outcome"] == "failed" and not r.get("excluded") and not r.get("container")],
        "agreement": agreement(rows),
        "patched_make_cache": patched, "unimportable_model_modules": unimportable,
        "tests": rows,
    }


def _cell(text) -> str:
    return str(text or "").replace("|", "\\|").replace("\n", " ")


def _measured(row: dict) -> str:
    return "; ".join(f"{m['check']} max abs diff {m['max_abs_diff']:.3g} (outputs up to {m['max_abs_ref']:.3g}"
                     + (f"; atol {m['atol']}, rtol {m['rtol']}" if "atol" in m else "") + ")"
                     for m in row.get("comparisons", []) if "max_abs_diff" in m)


def _worst(row: dict, dtype: str) -> str:
    rel = [a["max_abs_diff"] / max(a["max_abs_ref"], 1e-30) for a in row.get("agreement", [])
           if a.get("dtype") == dtype and "max_abs_diff" in a]
    return f"{max(rel):.1e}" if rel else ""


def markdown(doc: dict) -> str:
    """The document as markdown: settings, counts, failures with their diagnoses, kvq's agreement with mlx-lm's
    outputs, the unserved model types, the excluded tests, every row."""
    c, tf, baseline = doc["counts"], doc["tests_file"], doc["method"] == BASELINE
    kwargs = "nothing swapped: mlx-lm's own caches" if baseline else \
        f"kvq.make_prompt_cache arguments `{json.dumps(doc['make_prompt_cache_kwargs'])}`"
    lines = [f"# mlx-lm's model tests with {'mlx-lm' if baseline else 'kvq'}'s `{doc['method']}` caches", "",
             f"mlx-lm {doc['mlx_lm']}, MLX {doc['mlx']} ({doc['device']}, {doc['platform']}), Python {doc['python']}. "
             f"Test file: {tf.get('ref') or tf['path']} (`tests/test_models.py`, sha256 `{tf['sha256'][:16]}`); "
             f"{kwargs}. {doc['seconds']} s.", "",
             f"Counted (tests and subtests, less excluded ones): {c['counted']}: **{c['passed']} passed**, "
             f"{c['failed']} failed, {c['skipped']} skipped. Of the passes, {c['passed_on_kvq_caches']} ran on kvq's "
             f"caches, {c['passed_on_mlx_lm_caches_kvq_declined']} on mlx-lm's caches because kvq declined the model "
             f"(below), {c['passed_on_mlx_lm_caches_other']} on mlx-lm's caches of models with no KV layers or of "
             f"this baseline, {c['passed_without_a_model_cache']} built no model cache (RoPE, masks, kernels, "
             f"weights). Excluded: {c['excluded']}.", ""]
    lines += ["## Failures", ""]
    if not doc["failures"]:
        lines += ["None.", ""]
    else:
        lines += ["| test | caches | error | diagnosis | measured |", "|---|---|---|---|---|"]
        for r in doc["failures"]:
            lines.append(f"| {_cell(r['test'])} | {r['cache']} | {_cell(_short(r['error'] or '', 160))} | "
                         f"{r['diagnosis']} | {_cell(_measured(r))} |")
        lines.append("")
    skipped = [r for r in doc["tests"] if r["outcome"] == "skipped"]
    if skipped:
        lines += ["## Skipped", "", "| test | reason |", "|---|---|"]
        lines += [f"| {_cell(r['test'])} | {_cell(r['error'])} |" for r in skipped]
        lines.append("")
    if not baseline:
        lines += ["## kvq's outputs against mlx-lm's", "",
                  "Each call of a model with kvq's caches repeated with mlx-lm's own caches for the same model (the "
                  "tests themselves check only shapes and dtypes): the worst relative difference of the outputs "
                  "(largest absolute difference over the reference's largest magnitude) per model type and dtype, "
                  "over that many calls; not compared: calls whose output could not be computed (MLX's CPU back end "
                  "has no float16 `gather_mm`).", "",
                  "| model type | float32 (calls) | float16 (calls) | not compared |", "|---|---|---|---|"]
        for mtype, a in doc["agreement"].items():
            cells = [f"{a[d]['worst_relative']:.1e} ({a[d]['calls']})" if d in a else ""
                     for d in ("float32", "float16")]
            lines.append(f"| {mtype} | {cells[0]} | {cells[1]} | {a.get('not_compared', '')} |")
        lines.append("")
        lines += ["## Model types kvq declined (UnservableModelWarning): their tests ran on mlx-lm's caches", ""]
        if not doc["unserved"]:
            lines += ["None.", ""]
        else:
            lines += ["| model type | kvq's reason | tests |", "|---|---|---|"]
            for mtype, u in doc["unserved"].items():
                reason = u["reason"].split("raises ", 1)[-1].split("); its layers")[0]
                lines.append(f"| {mtype} | {_cell(_short(reason, 160))} | {_cell(', '.join(u['tests']))} |")
            lines.append("")
    lines += ["## Excluded", "",
              f"*{TYPE_ASSERTION}*: the test asserts that a cache is of mlx-lm's class, which a kvq cache is not. "
              f"*{CACHE_CLASS_TEST}*: the test builds mlx-lm's cache classes itself, with no model asking for them, "
              "and tests their own interface (``update_and_fetch`` returning the stored arrays, ``to_quantized``), "
              "which kvq's caches do not offer (they return stand-ins that only attention reads); they ran on "
              "mlx-lm's classes. Both kinds ran; their outcomes are listed, not counted.", "",
              "| test | reason | what (line) | outcome |", "|---|---|---|---|"]
    for e in doc["excluded"]:
        outcome = "; ".join(o["outcome"] + (f": {o['error']}" if o["error"] else "") for o in e["outcomes"])
        lines.append(f"| {e['test']} | {e['reason']} | {_cell(e['detail'])} ({', '.join(map(str, e['lines']))}) | "
                     f"{_cell(_short(outcome or 'not run', 200))} |")
    lines += ["", "## Every test", "",
              "| test | outcome | caches | model types served by kvq | float32 / float16 worst relative "
              "difference from mlx-lm | s |", "|---|---|---|---|---|---|"]
    for r in doc["tests"]:
        outcome = r["outcome"] + (f" (excluded: {r['excluded']})" if r.get("excluded") else "") + \
            (" (subtests below)" if r.get("container") else "")
        worst = " / ".join(w for w in (_worst(r, "float32"), _worst(r, "float16")))
        lines.append(f"| {_cell(r['test'])} | {outcome} | {r['cache']} | {', '.join(r['served_model_types'])} | "
                     f"{worst if worst != ' / ' else ''} | {r['seconds']} |")
    return "\n".join(lines) + "\n"


def summary(folder: Path) -> str:
    """``README.md`` of a results folder: one row per method from every ``*.json`` there."""
    docs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    lines = ["# mlx-lm's model tests with kvq's caches (issue #25)", "",
             "Written by `benchmarks/mlx_lm_model_tests.py` (its docstring says how); one file pair per method, "
             "`mlx-lm` being the file run with mlx-lm's own caches on the same machine.", "",
             "| method | mlx-lm | test file | counted | passed: on kvq caches / on mlx-lm's, kvq declined / other "
             "mlx-lm caches / no cache | failed (diagnoses) | skipped | excluded | worst relative difference from "
             "mlx-lm, float32 / float16 | file |", "|---|---|---|---|---|---|---|---|---|---|"]
    for d in docs:
        c, stem = d["counts"], slug(d["method"])
        diagnoses: dict[str, int] = {}
        for f in d["failures"]:
            diagnoses[f.get("diagnosis", UNEXPLAINED)] = diagnoses.get(f.get("diagnosis", UNEXPLAINED), 0) + 1
        worst = [max((a[t]["worst_relative"] for a in d.get("agreement", {}).values() if t in a), default=None)
                 for t in ("float32", "float16")]
        lines.append(f"| `{d['method']}` | {d['mlx_lm']} | {d['tests_file'].get('ref') or d['tests_file']['path']} | "
                     f"{c['counted']} | **{c['passed']}**: {c['passed_on_kvq_caches']} / "
                     f"{c['passed_on_mlx_lm_caches_kvq_declined']} / {c['passed_on_mlx_lm_caches_other']} / "
                     f"{c['passed_without_a_model_cache']} | {c['failed']} ("
                     + "; ".join(f"{n}: {k}" for k, n in sorted(diagnoses.items())) + f") | {c['skipped']} | "
                     f"{c['excluded']} | " + " / ".join("-" if w is None else f"{w:.1e}" for w in worst)
                     + f" | [{stem}.md]({stem}.md) |")
    lines += ["", "The worst relative difference is over every call of a model kvq served, repeated with mlx-lm's own "
              "caches (largest absolute difference of the outputs over the largest magnitude of mlx-lm's): for "
              "`fp16` it measures 16-bit storage; for the 4-bit methods it is what random-weight tiny models with "
              "every token compressed give, not a measure of quality on real models (`kvq eval` measures that). "
              "Each method's file lists its failures with their diagnoses, the skipped and excluded tests, the "
              "model types kvq declined, and every test."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring). Exit status: pytest's (1 when a test failed, excluded ones too)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=Path, help="mlx-lm's tests/test_models.py (from its repository)")
    parser.add_argument("--tests-ref", help="where the file came from, for the report (repository@commit)")
    parser.add_argument("--method", default="fp16", help="a kvq eval method string (fp16, turboquant:4, affine:4 ...), "
                        "or mlx-lm: nothing swapped (run it first: the other runs' failures are compared with it)")
    parser.add_argument("--sinks", type=int, default=0, help="kvq's uncompressed first tokens (default 0)")
    parser.add_argument("--window", type=int, default=0, help="kvq's uncompressed recent tokens (default 0)")
    parser.add_argument("--flush", type=int, default=1, help="kvq's flush block (default 1)")
    parser.add_argument("--max-weights-gb", type=float, default=4.0,
                        help="skip a test whose model has more GiB of weights (kvq's attention would compute them)")
    parser.add_argument("-k", dest="select", help="pytest's -k: run only the tests it selects")
    parser.add_argument("--out", type=Path, required=True, help="folder for METHOD.json, METHOD.md and README.md")
    parser.add_argument("--report", action="store_true",
                        help="only rewrite OUT/*.md and OUT/README.md from OUT/*.json")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report:
        for path in sorted(args.out.glob("*.json")):
            path.with_suffix(".md").write_text(markdown(json.loads(path.read_text())))
        (args.out / "README.md").write_text(summary(args.out))
        return 0
    if args.tests is None:
        parser.error("--tests is required (unless --report)")
    baseline_path = args.out / f"{BASELINE}.json"
    baseline = json.loads(baseline_path.read_text()) if args.method != BASELINE and baseline_path.exists() else None
    try:
        doc = run(args.tests.resolve(), args.method, args.sinks, args.window, args.flush, args.select,
                  args.max_weights_gb, baseline)
    except Exception:  # noqa: BLE001 - say what broke the runner itself, not a test
        traceback.print_exc()
        return 2
    doc["tests_file"]["ref"] = args.tests_ref
    doc["tests_file"]["path"] = args.tests.name
    stem = slug(args.method)  # kvq bench's file-name rule: turboquant:4 -> turboquant-4
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(doc))
    (args.out / "README.md").write_text(summary(args.out))
    c = doc["counts"]
    print(f"{args.method}: {c['passed']} passed ({c['passed_on_kvq_caches']} on kvq caches), {c['failed']} failed, "
          f"{c['skipped']} skipped, {c['excluded']} excluded; unserved: {', '.join(doc['unserved']) or 'none'}")
    return doc["pytest_exit_code"]


if __name__ == "__main__":
    sys.exit(main())
