"""The bound decode step both decode-attention families replay, and the input rules they share.

A cache's decode is decided once per layer and replayed each step (docs/DESIGN.md, "The cache"): a family plans
its launch once (:func:`kvq_metal.attend.bind_decode`, :func:`kvq_metal.streams.bind_streams`) and hands a
:class:`DecodeStep` the kernel objects, templates, grids and the arrays fixed at binding; each step then only
passes the queries and the window. Both families' kernels take their inputs in one order::

    rows, codes..., middle, window_keys, window_values, sink_keys, sink_values, extra...

``rows`` are the kernel's query rows: the queries themselves for one code stream (:mod:`kvq_metal.attend`), or the
queries prepared by a matrix for code streams (:mod:`kvq_metal.streams`, whose ``middle`` input then holds the raw
queries, which attend the sinks and window). For one stream ``middle`` holds the split counters each launch
zeroes for the next (so the steps of one binding run in order), and its launch merges its own splits; code
streams merge in a second launch that applies the method's linear finish.
"""

from __future__ import annotations

from typing import Any, Sequence

import attrs
import mlx.core as mx


@attrs.frozen(eq=False)
class KernelCall:
    """One kernel launch fixed at binding: ``call`` a kernel object (:meth:`kvq_metal.dialect.Kernel.bound`'s)
    with its ``template``, ``grid`` and ``threadgroup`` (threads), and its outputs' ``shapes`` and ``dtypes``."""

    call: Any
    template: list
    grid: tuple
    threadgroup: tuple
    shapes: list
    dtypes: list


def dense_inputs(window_keys: mx.array, window_values: mx.array, sink_keys: mx.array | None,
                 sink_values: mx.array | None) -> list:
    """The kernels' ``wk, wv, sk, sv`` inputs: a cache's window ``[B, H_kv, n, D]`` and sinks ``[B, H_kv, s, D]``;
    without sinks (``None``) the window's arrays stand in for them (never read: the launch's ``SINKS`` is false,
    and :func:`aliases` then reads them through the window's)."""
    if sink_keys is None:
        return [window_keys, window_values, window_keys, window_values]
    return [window_keys, window_values, sink_keys, sink_values]


def aliases(names: Sequence[str], inputs: Sequence[mx.array], per_step: Sequence[str] = ()) -> dict[str, str]:
    """The inputs a launch need not pass: each input (named by ``names``, in order) that is the same array as an
    earlier one maps to that earlier input's name (:meth:`kvq_metal.dialect.Kernel.bound` reads it through it).
    The stand-ins a family passes for absent inputs (a side without a second code stream or biases, absent sinks:
    :func:`dense_inputs`, placeholders) are found this way. Inputs named in ``per_step`` (a bound step passes them
    anew each call) are never left out.

    :raises ValueError: ``names`` and ``inputs`` of different lengths."""
    if len(names) != len(inputs):
        raise ValueError(f"{len(names)} input names for {len(inputs)} inputs")
    first: dict[int, int] = {}
    found = {}
    for i, array in enumerate(inputs):
        j = first.setdefault(id(array), i)
        if j < i and names[i] not in per_step:
            found[names[i]] = names[j]
    return found


class DecodeStep:
    """One layer's decode attention, bound once and launched each step (:class:`kvq.contract.BindsDense`,
    :class:`kvq.contract.BindsRaggedDense`). Everything but the queries and the window is fixed at binding (the
    compressed tokens and their count, the sinks, the scale, the queries' shape and dtype, the window's dtype); a
    cache binds again when any of them changes, and the steps of one binding run in order. The code arrays are
    passed to each launch as the objects bound, so a ragged step reads what a batch has written into them in place
    since (its flushes; their counts come with each step).

    Call it as ``step(queries, window_keys, window_values, *extra) -> out``: ``queries [B, H_q, T_q, D]`` of the
    bound shape and dtype, the window ``[B, H_kv, n, D]`` (``n >= 1``, the bound dtype), ``extra`` the inputs a
    launch takes per step after the sinks (a ragged step, :attr:`ragged`: int32 ``[B, 2]``, each row's compressed
    and window token counts); ``out [B, H_q, T_q, D_v]`` in the queries' dtype.

    :param main: the attention launch. :param codes: the inputs between the rows and ``middle`` (the compressed
        tokens, fixed). :param sinks: the inputs after the window that are fixed (the sinks, a placeholder);
        ``None``: the step's window stands in for absent sinks (a launch that keeps every input, on Metal).
    :param counter: one stream: int32 split counters, the first ``middle``; each launch's output 4 is the next
        one's, and output 2 is ``out``. :param prepare: code streams: float32 ``[G, D, DQ]`` (scale included) that
        makes the rows from the queries (``rows_shape`` = ``(B, H_kv, R, D)``); with ``merge`` (its inputs the
        main launch's two outputs and ``finish``), whose output 0 is ``out`` in ``out_shape``.
    :param template_args: the launch plan's template arguments (written into the kernel's text on CUDA).
    :param tensor_cores: whether ``main`` is a tensor-core kernel.
    """

    #: the code arrays are passed to each launch as the objects bound, so a batch's in-place writes are read
    #: (:class:`kvq.contract.BindsRaggedDense`: the packed rows keep the step across their flushes)
    reads_in_place = True

    __slots__ = ("_main", "_codes", "_sinks", "_counter", "_prepare", "_rows", "_flat", "_merge", "_finish",
                 "_out_shape", "ragged", "template_args", "tensor_cores")

    def __init__(self, main: KernelCall, codes: list, sinks: list | None, *, counter: mx.array | None = None,
                 prepare: mx.array | None = None, rows_shape: tuple = (), merge: KernelCall | None = None,
                 finish: mx.array | None = None, out_shape: tuple = (), ragged: bool = False,
                 template_args: Sequence = (), tensor_cores: bool = True) -> None:
        self._main, self._codes, self._sinks, self._counter = main, codes, sinks, counter
        self._prepare, self._rows, self._merge, self._finish = prepare, rows_shape, merge, finish
        self._flat = () if prepare is None else (rows_shape[0] * rows_shape[1], rows_shape[2], prepare.shape[-1])
        self._out_shape = out_shape
        #: whether each step passes the rows' token counts (``extra``: rows of different lengths)
        self.ragged = ragged
        #: the launch plan's template arguments (written into the kernel's text on CUDA, passed elsewhere)
        self.template_args = tuple(template_args)
        #: whether the attention launch runs a tensor-core kernel (else the SIMT kernel)
        self.tensor_cores = tensor_cores

    @property
    def launches(self) -> tuple[KernelCall, KernelCall | None]:
        """``(main, merge)``: the attention launch and the merge launch (``None``: the main launch merges)."""
        return self._main, self._merge

    def __call__(self, queries: mx.array, window_keys: mx.array, window_values: mx.array, *extra) -> mx.array:
        # the decode hot path: one frame, no helper
        if self._prepare is None:  # one stream: the queries are the rows; the counters the last launch zeroed
            rows, middle = queries, self._counter
        else:  # code streams: the prepared rows; the raw queries attend the sinks and window
            rows, middle = (queries.reshape(self._rows) @ self._prepare).reshape(self._flat), queries
        m = self._main
        sinks = (window_keys, window_values) if self._sinks is None else self._sinks
        outs = m.call(inputs=[rows, *self._codes, middle, window_keys, window_values, *sinks, *extra],
                      template=m.template, grid=m.grid, threadgroup=m.threadgroup, output_shapes=m.shapes,
                      output_dtypes=m.dtypes)
        if self._merge is None:
            self._counter = outs[4]
            return outs[2]
        g = self._merge
        out = g.call(inputs=[outs[0], outs[1], self._finish], template=g.template, grid=g.grid,
                     threadgroup=g.threadgroup, output_shapes=g.shapes, output_dtypes=g.dtypes)[0]
        return out.reshape(self._out_shape)
