"""What every kernel implementation shares: the device test, the first-use check, the cost estimate.

A kernel is only offered on the back end it was built for, on a machine whose default device is that GPU.
Before a kernel variant (one template key: head_dim, bits, dtype ...) is used for the first time in a process, it
runs on a small input and is compared with the pure-MLX implementation; a mismatch or an error disables that
variant for the rest of the process with a :class:`KernelDisabledWarning` naming the kernel, and selection
falls back to pure MLX (docs/DESIGN.md, "Selection").
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

from kvq.costmodel import estimate
from kvq.plugins import registry

from . import attend, prefill
from .dialect import BACKENDS, gpu_backend


class KernelDisabledWarning(RuntimeWarning):
    """A kernel variant failed its first-use check on this device and is disabled (pure MLX serves instead)."""


#: (backend, kernel name, template key) -> (passed, detail), for this process.
CHECKS: dict[tuple, tuple[bool, str]] = {}


def first_use_check(backend: str, name: str, key: tuple, check: Callable[[], tuple[bool, str]]) -> bool:
    """Run ``check()`` once per ``(backend, name, key)`` in this process and remember the outcome.

    :param check: returns ``(passed, detail)``; an exception counts as a failure (its text is the detail).
    :return: whether the variant may be used. A failure warns once with :class:`KernelDisabledWarning`.
    """
    entry = (backend, name, key)
    if entry not in CHECKS:
        try:
            passed, detail = check()
        except Exception as exc:  # noqa: BLE001 - any failure disables the kernel, and is reported
            passed, detail = False, f"{type(exc).__name__}: {exc}"
        CHECKS[entry] = (bool(passed), detail)
        if not passed:
            warnings.warn(f"kvq_metal: {backend} kernel {name} {key} disabled on this device: {detail}; "
                          f"pure MLX serves instead", KernelDisabledWarning, stacklevel=3)
    return CHECKS[entry][0]


def _check_key(params):
    """``params`` itself as part of a first-use-check key (frozen attrs: hashed by value, cheap on the decode hot
    path), or its ``repr`` where a field makes it unhashable (an array of fitted outlier channels)."""
    try:
        hash(params)
    except TypeError:
        return repr(params)
    return params


class KernelImpl:
    """Base of kvq_metal's implementation objects: one method on one back end (``"metal"`` or ``"cuda"``).

    Subclasses set ``method``, define ``kernel_supports(problem)`` (shape/bits/params limits) and the ops they
    implement, and use :meth:`fallback` (the method's registered pure-MLX implementation) where a call falls
    outside the kernel's limits; that gives the same result, computed by pure MLX.

    :raises ValueError: from the constructor, ``backend`` not one of ``metal``, ``cuda``.
    """

    method = ""

    def __init__(self, backend: str) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
        self.backend = backend

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.backend!r})"

    def fallback(self) -> Any:
        """The registered pure-MLX implementation of this method (a method, not a property: pluggy inspects
        every attribute of a registered object, before the method's plugin may have loaded)."""
        return registry().implementations[(self.method, "mlx")]

    def live(self) -> bool:
        """Whether this back end is the GPU of MLX's default device here."""
        return gpu_backend() == self.backend

    def supports(self, problem) -> bool:
        """On this back end's GPU, for problems :meth:`kernel_supports` accepts, after a passed first-use check."""
        if problem.device != self.backend or not self.live():
            return False
        return bool(self.kernel_supports(problem))

    def explain(self, problem) -> str:
        """Why this implementation does not serve ``problem`` (shown by ``kvq select``)."""
        if problem.device != self.backend:
            return f"{self.backend} kernel, not for {problem.device}"
        if not self.live():
            return f"{self.backend} is not MLX's default device here"
        return "" if self.kernel_supports(problem) else "outside the kernel's limits (or disabled by its check)"

    def attend_dense(self, queries, keys, values, scale, dense):
        """Decode attention over compressed ``keys``/``values`` and uncompressed tokens (``dense``, a
        :class:`kvq.attention.DenseTokens`: a cache's sinks and residual window) in one softmax and one fused
        call, without a mask (every key precedes every query). Before its first use per (parameters, head_dim,
        query rows, dtype) the fused call is compared with attending the parts separately (pure MLX) on a small
        input; a mismatch disables it with a :class:`KernelDisabledWarning`.

        :return: ``(out [B, H_q, T_q, D_v] float32, lse [B, H_q, T_q])``, or ``None`` where the kernel does not
            take uncompressed tokens for this call or its check failed (the caller then attends the parts
            separately and merges them: the same result).
        """
        if not self._dense_checked(queries, keys, values, dense.window_keys.dtype):
            return None
        return self._attend_dense(queries, keys, values, scale, dense)

    def bind_dense(self, queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
        """:meth:`attend_dense` bound once for a cache's decode steps (:class:`kvq.contract.BindsDense`): a
        :class:`kvq_metal.step.DecodeStep` over these compressed ``keys``/``values`` and sinks, called as
        ``step(queries, window_keys, window_values) -> out`` (the model's dtype) with one launch per step; the same
        first-use check as :meth:`attend_dense`. ``None`` where :meth:`attend_dense` would not serve.

        :param queries: ``[B, H_q, T_q, D]`` of the shape and dtype every step passes. :param sink_keys,
            sink_values: ``[B, H_kv, n, D]`` or ``None``. :param window_keys, window_values: the window now (its
            dtype is bound; its length is the step's).
        """
        if not self._dense_checked(queries, keys, values, window_keys.dtype):
            return None
        return self._bind_unchecked(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values)

    def bind_ragged_dense(self, queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values):
        """:meth:`bind_dense` for rows of different lengths (:class:`kvq.contract.BindsRaggedDense`): a
        ragged :class:`kvq_metal.step.DecodeStep`, called as ``step(queries, window_keys, window_values, lengths)``
        (int32 ``[B, 2]``: each row's compressed and window token counts); the same first-use check as
        :meth:`attend_dense`. ``None`` where :meth:`attend_dense` would not serve."""
        if not self._dense_checked(queries, keys, values, window_keys.dtype) or \
                not self._dense_checked(queries, keys, values, window_keys.dtype, ragged=True):
            return None
        return self._bind_unchecked(queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values,
                                    ragged=True)

    def _bind_unchecked(self, queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values,
                        ragged: bool = False):
        """:meth:`bind_dense` without its first-use check: the tensor-core kernel's
        :class:`kvq_metal.step.DecodeStep` as :meth:`_dense_call` describes it (``None``: not served)."""
        call = self._dense_call(queries, keys, values)
        if call is None:
            return None
        return attend.bind_decode(queries, scale, call, self.backend, sink_keys=sink_keys, sink_values=sink_values,
                                  window_keys=window_keys, window_values=window_values, ragged=ragged)

    def attend_columns(self, queries, keys, values, intervals, scale, sink_logits=None):
        """A prefill chunk's attention over 16-bit columns, each query row seeing its own column intervals
        (:class:`kvq.contract.AttendsColumns`, issue #51): the tensor-core prefill kernel
        (:func:`kvq_metal.prefill.prefill_attend`) where it serves (its knob on, a CUDA device, arguments that
        :func:`kvq_metal.prefill.check_inputs` takes) and this implementation is the CUDA one, after the first-use
        check (:func:`kvq_metal.prefill.check_parity`, once per head_dim, dtype, intervals per row, sinks, GQA
        ratio and the knobs' ``warpgroups`` and ``pipeline``). The columns arrive decoded, so the kernel is the same for every method.

        :param queries: ``[B, H_q, T_q, D]`` float16 or bfloat16. :param keys, values: ``[B, H_kv, N, D]`` of the
            queries' dtype. :param intervals: int32 ``[T_q, P, 2]`` (:func:`kvq.cache.prefill.column_intervals`).
        :param scale: the softmax scale. :param sink_logits: ``[H_q]`` learned sink logits, or ``None``.
        :return: ``[B, H_q, T_q, D]`` in the queries' dtype, or ``None`` where it does not serve (the cache then
            attends with a mask: the same result within 16-bit rounding).
        """
        if not (prefill.TUNING.tc and self.backend == "cuda" and gpu_backend() == "cuda"):
            return None
        try:  # a call the kernel refuses (a shape it does not take) is the masked path's
            intervals, sinks = prefill.check_inputs(queries, keys, values, intervals, scale, sink_logits)
        except (TypeError, ValueError):
            return None
        key = (queries.shape[3], queries.dtype, intervals.shape[1], sinks is not None,
               queries.shape[1] // keys.shape[1], prefill.TUNING.warpgroups,
               prefill.TUNING.pipeline)  # the form checked is the one run
        if not first_use_check(self.backend, "prefill_attend", key, lambda: prefill.check_parity(*key[:5])):
            return None
        return prefill.launch(queries, keys, values, intervals, scale, sinks)

    def check_heads(self, keys) -> int:
        """KV heads of the first-use checks' problems: 1 (a method whose parameters fix the head count, a
        calibrated one, returns that count)."""
        return 1

    def _dense_checked(self, queries, keys, values, dtype, ragged: bool = False) -> bool:
        """The first-use check of the fused call with uncompressed tokens of ``dtype`` (see :meth:`attend_dense`),
        or with ``ragged`` of its ragged decode step (:func:`kvq_metal.common.check_attend_ragged`: checked only
        where a batch first binds one)."""
        from .common import check_attend_dense, check_attend_ragged, query_rows

        rows = query_rows(queries, keys)
        key = (_check_key(keys.params), _check_key(values.params), queries.shape[3], rows, dtype)
        check, name = (check_attend_ragged, "ragged") if ragged else (check_attend_dense, "dense")
        return first_use_check(self.backend, f"decode_attend_{name}[{self.method}]", key,
                               lambda: check(self, keys.params, values.params, queries.shape[3], rows, dtype,
                                             heads=self.check_heads(keys)))

    def _attend_dense(self, queries, keys, values, scale, dense):
        """The unchecked fused call of :meth:`attend_dense`: :func:`kvq_metal.attend.decode_attend` as
        :meth:`_dense_call` describes it; ``None``: not served."""
        call = self._dense_call(queries, keys, values)
        if call is None:
            return None
        return attend.decode_attend(queries, scale, call.keys, call.values, self.backend, signs=call.signs,
                                    out_dim=call.out_dim, dense=dense)

    def _dense_call(self, queries, keys, values):
        """How the tensor-core kernel reads these compressed tokens together with uncompressed ones
        (:class:`kvq_metal.attend.DenseCall`), or ``None`` where it does not (methods with such a kernel define
        it)."""
        return None

    def kernel_supports(self, problem) -> bool:  # pragma: no cover - overridden
        """Whether the kernel serves ``problem`` (its shape, bits and parameters) after its first-use check;
        the device is already known to match. Subclasses define it."""
        raise NotImplementedError

    def estimate(self, problem, *, launches: int, bytes_moved: float, flops: float = 0.0) -> float:
        """:func:`kvq.costmodel.estimate` for this back end."""
        return estimate(problem, launches=launches, bytes_moved=bytes_moved, flops=flops)
