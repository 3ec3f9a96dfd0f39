"""The base of the kernel implementations on the streams kernel (:mod:`kvq_metal.streams`): QJL,
TurboQuant-Prod and VecInfer subclass :class:`StreamsKernelImpl` in their plugins."""

from __future__ import annotations

from typing import Callable

import mlx.core as mx

from . import base, streams
from .base import KernelImpl, _check_key
from .common import check_attend, quantize_with_method, query_rows
from .streams import StreamCall, attend_streams, bind_streams, decode_attend_streams, supported


def linear_matrix(fn: Callable[[mx.array], mx.array], dim: int, heads: int = 1) -> mx.array:
    """The matrix of a linear map on grouped rows (a method's query preparation or value finish): ``fn`` applied
    to the identity, ``[heads, dim, out]`` float32 (``heads`` > 1 where the map differs per KV head)."""
    eye = mx.broadcast_to(mx.eye(dim, dtype=mx.float32)[None, None], (1, heads, 1, dim, dim))
    return mx.contiguous(fn(eye)[0, :, 0].astype(mx.float32))


#: :meth:`StreamsKernelImpl._matrices` by (class, key parameters, value parameters, head_dim, KV heads).
_MATRICES: dict = {}


class StreamsKernelImpl(KernelImpl):
    """Base of the kernel implementations on the streams kernel (``qjl``, ``turboquant_prod``, ``vecinfer``):
    decode attention only (``kvq_attend``, ``attend_dense``, ``bind_dense``), each call checked against the
    method's pure-MLX implementation before its first use (keyed by both sides' parameters, head_dim, query rows
    and dtype: a problem names the keys' parameters only). Pure MLX serves masks, empty caches and what the
    kernel does not take, with the same result.

    Subclasses define :meth:`stream_call` and :meth:`prepare` (and :meth:`finish` where the value streams are not
    in the output's domain); both must be linear maps on the rows (the bound step runs them as matrices)."""

    #: Whether :meth:`prepare` differs per KV head (its matrix is then one per head).
    prepare_per_head = False

    def stream_call(self, keys, values) -> StreamCall | None:  # pragma: no cover - overridden
        """The :class:`StreamCall` of these encodings, or ``None`` where the kernel does not read them."""
        raise NotImplementedError

    def prepare(self, keys) -> Callable[[mx.array], mx.array]:  # pragma: no cover - overridden
        """Scaled float32 grouped queries ``[B, H_kv, n_rep, T_q, D]`` -> prepared rows ``[..., query_dim]``."""
        raise NotImplementedError

    def finish(self, values) -> Callable[[mx.array], mx.array] | None:
        """Normalised ``[B, H_kv, n_rep, T_q, out_dim]`` -> ``[..., D_v]``; ``None``: already there."""
        return None

    def matrix_sources(self, keys, values) -> tuple:
        """The arrays :meth:`prepare` and :meth:`finish` read besides the parameters (their identity is part of the
        key under which the matrices are kept): none here; a calibrated method returns its loaded calibration's
        arrays, so a recalibration in the same process makes new matrices."""
        return ()

    def attend_kernel(self, queries, keys, values, scale, call: StreamCall | None = None):
        """The kernel path of :meth:`kvq_attend` (no checks; ``call``: the keys' and values' :class:`StreamCall`
        when the caller has it)."""
        finish = self.finish(values) or (lambda out: out)
        call = call or self.stream_call(keys, values)
        return attend_streams(queries, scale, keys.shape[1], call, self.prepare(keys), finish, self.backend)

    def _served_call(self, queries, keys, values, mask, dense: bool = False) -> StreamCall | None:
        """The :class:`StreamCall` of this call where the kernel serves it (``dense``: with a cache's uncompressed
        tokens too) and its signature passed the first-use check; ``None`` otherwise."""
        if mask is not None or keys.num_tokens == 0 or queries.shape[-1] != keys.head_dim:
            return None
        if queries.shape[1] % keys.shape[1] or values.head_dim != keys.head_dim:
            return None
        call = self.stream_call(keys, values)
        rows = query_rows(queries, keys)
        if call is None or not supported(call, rows, keys.head_dim if dense else None):
            return None
        # the kernel that will run (and the tensor-core kernel's knobs) is part of the key: a check of one variant
        # says nothing of another
        tc = self.backend == "cuda" and bool(streams.TUNING.tc)
        t = streams.TUNING
        knobs = (t.nt, t.pf, t.qsh, t.rep, t.minb) if tc else ()
        key = (_check_key(keys.params), _check_key(values.params), keys.head_dim, rows, queries.dtype, tc, knobs)
        passed = base.first_use_check(self.backend, f"decode_attend_streams[{self.method}]", key,
                                      lambda: check_attend(self, quantize_with_method, keys.params, values.params,
                                                           keys.head_dim, rows, queries.dtype,
                                                           heads=self.check_heads(keys)))
        return call if passed else None

    def kvq_attend(self, queries, keys, values, scale, mask):
        """``kvq_attend`` spec; pure MLX serves masks and calls beyond the kernel."""
        call = self._served_call(queries, keys, values, mask)
        if call is None:
            return self.fallback().kvq_attend(queries, keys, values, scale, mask)
        return self.attend_kernel(queries, keys, values, scale, call)

    def _matrices(self, keys, values, call: StreamCall) -> tuple[mx.array, mx.array | None]:
        """``(prepare [G, D, DQ], finish [DO, DV] or None)``: :meth:`prepare` and :meth:`finish` as matrices
        (:func:`linear_matrix`), made once per (implementation class, both sides' parameters, head_dim, KV heads,
        :meth:`matrix_sources`): a cache binds a new step at every window flush of every layer."""
        sources = self.matrix_sources(keys, values)
        key = (type(self), _check_key(keys.params), _check_key(values.params), keys.head_dim, keys.shape[1],
               tuple(id(a) for a in sources))  # the entry holds the sources: their ids stay theirs
        found = _MATRICES.get(key)
        if found is None:
            heads = keys.shape[1] if self.prepare_per_head else 1
            prepare = linear_matrix(self.prepare(keys), keys.head_dim, heads)
            finish = self.finish(values)
            if finish is not None:
                finish = linear_matrix(finish, call.out_dim)[0]
            if len(_MATRICES) > 256:
                _MATRICES.clear()
            found = _MATRICES[key] = (prepare, finish, sources)
        return found[0], found[1]

    def _attend_dense(self, queries, keys, values, scale, dense):
        """The unchecked fused call of :meth:`attend_dense`: the compressed tokens, sinks and window in one launch,
        computed exactly as a bound step (:func:`~kvq_metal.streams.bind_streams`) computes it (``None`` where the
        kernel does not take it)."""
        call = self._served_call(queries, keys, values, None, dense=True)
        if call is None:
            return None
        prepare, finish = self._matrices(keys, values, call)
        B, Hq, Tq, D = queries.shape
        H = keys.shape[1]
        prepared = queries.reshape(B, H, Hq // H * Tq, D) @ (prepare * scale)
        out, lse = decode_attend_streams(prepared, call, self.backend, dense=dense, raw_queries=queries,
                                         scale=scale, finish=finish)
        return out.reshape(B, Hq, Tq, out.shape[-1]), lse.reshape(B, Hq, Tq)

    def _bind_unchecked(self, queries, keys, values, scale, sink_keys, sink_values, window_keys, window_values,
                        ragged: bool = False):
        """A :func:`bind_streams` step for a cache's decode steps, unchecked (``None`` where not served, and for rows of
        different lengths, ``ragged``, which these kernels do not take)."""
        if ragged:
            return None
        call = self._served_call(queries, keys, values, None, dense=True)
        if call is None:
            return None
        prepare, finish = self._matrices(keys, values, call)
        return bind_streams(call, queries, scale, prepare, finish, self.backend, sink_keys, sink_values,
                            window_keys, window_values)
