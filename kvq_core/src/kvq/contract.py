"""The kvq contract in one file: every attribute kvq reads from the objects that plugins hand it.

Three kinds of object cross the boundary (docs/DESIGN.md, "The contract (kvq.hookspecs)"):

* an entry-point module of group ``kvq``: :class:`EntryPoint`;
* an implementation object, one ``(method, backend)``: :class:`Implementation` (required), some of the op hooks
  :class:`Quantizes`, :class:`Dequantizes`, :class:`Attends`, :class:`Packs` (their arguments and results are
  documented with the pluggy specs in :mod:`kvq.hookspecs`), and the optional members below;
* a method's parameter object, an instance of ``Method.params_class``: :class:`Params` (required) and the
  optional members below. A method's calibration module is declared and documented with :class:`kvq.Method`
  (``calibrate=``).

``typing.Protocol`` cannot mark a member optional, so each optional member is a Protocol of its own, and kvq reads
it through :func:`optional_hook` (``optional_hook(params, ForLayer)`` is ``params.for_layer``, or ``None`` where the
object does not define it). kvq checks at registration only what :mod:`kvq.plugins` says (string ``method`` and
``backend``, callable ``supports``/``cost``, at least one op, hook argument names through pluggy);
``tests/test_contract.py`` checks every installed implementation and parameter class against these Protocols.

Shapes (docs/DESIGN.md, "Vocabulary"): keys and values ``[B, H_kv, T, D]``, queries ``[B, H_q, T_q, D]`` with
``H_q % H_kv == 0``. The block protocol works on grouped queries ``[B, H_kv, n_rep, T_q, D]``, ``n_rep = H_q /
H_kv`` (:func:`kvq.attention.split_heads`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, Sequence, runtime_checkable

import attrs

if TYPE_CHECKING:
    import mlx.core as mx

    from .encoded import Encoded
    from .declaration import BitsAccounting
    from .problem import Problem


# -- data crossing the boundary ----------------------------------------------------------------------------
@attrs.frozen
class DenseTokens:
    """Uncompressed tokens that a fused kernel attends together with compressed ones (a cache's sinks, the first
    tokens, and its residual window): ``[B, H_kv, T, D]`` keys and values in the model's dtype, views of the cache's
    buffers. Passed to an implementation's optional ``attend_dense`` (:class:`AttendsDense`); also importable as
    ``kvq.attention.DenseTokens``.

    :param sink_keys, sink_values: the first tokens, or ``None`` when the cache holds none.
    :param window_keys, window_values: the most recent tokens (at least one).
    """

    sink_keys: mx.array | None
    sink_values: mx.array | None
    window_keys: mx.array
    window_values: mx.array


# -- entry points ------------------------------------------------------------------------------------------------
@runtime_checkable
class EntryPoint(Protocol):
    """The module an entry point of group ``kvq`` names; kvq loads it on first use (:mod:`kvq.plugins`)."""

    def kvq_register(self, register: Callable[[Any], Any]) -> None:
        """:func:`kvq.hookspecs.kvq_register`: hand each :class:`kvq.Method` and implementation object to
        ``register``."""


# -- implementation objects: required ----------------------------------------------------------------------------
@runtime_checkable
class Implementation(Protocol):
    """What every implementation object has, besides at least one op (:data:`OP_PROTOCOLS`).

    :attr method: the method it serves (``"affine"``), or ``"*"`` for every method (bit packing).
    :attr backend: where it runs: ``"mlx"`` (pure MLX ops, any device) or a kernel back end (``"metal"``,
        ``"cuda"``); :func:`kvq.selection.is_kernel` is ``backend != "mlx"``.
    """

    method: str
    backend: str

    def supports(self, problem: Problem) -> bool:
        """Whether it serves ``problem`` (:class:`kvq.Problem`: method, op, shape, dtype, device, params, ``T_q``,
        ``H_q``). Called by :func:`kvq.select` once per problem; must not raise for a well-formed problem."""

    def cost(self, problem: Problem) -> float:
        """Estimated seconds for ``problem`` (called only where :meth:`supports` is true); the cheapest supporting
        implementation is chosen unless a measured crossover (``kvq autotune``) decides."""


# -- implementation objects: the op hooks (arguments, results and errors: kvq.hookspecs) ---------------------------
@runtime_checkable
class Quantizes(Protocol):
    """Op ``quantize``.

    Non-finite input, kvq's one policy for every method (issue #24): a vector (one token of one KV head) with a NaN
    or ±inf coordinate is stored so that it stays non-finite, as an fp16 cache propagates it, and nothing else
    changes. Never a finite value for it, never an exception or a warning, and no host synchronisation: the check
    is part of the lazy graph that encodes the block, so the decode hot path does not wait on it.

    * ``kvq_dequantize`` gives that vector non-finite coordinates: ``fp16`` exactly the ones given (NaN, ±inf);
      ``affine`` NaN in each group of ``group_size`` coordinates that holds one (its scale is stored as NaN);
      every other method (``turboquant``, ``turboquant_prod``, ``turboquant_rvq``, ``qjl``, ``vecinfer``) NaN in
      all ``head_dim`` coordinates (its norm is stored as NaN: the rotation or sketch mixes every coordinate;
      ``vecinfer``, which stores codes only, marks it with a reserved code pattern).
    * Attention: every query that attends such a key gets a NaN output (its score is NaN), as fp16 attention
      (``mx.fast.scaled_dot_product_attention``) gives for a NaN coordinate. (``fp16`` keeps an inf as given: its
      score is then ±inf, a NaN output where +inf, the key ignored where -inf.) Such a value makes the output
      coordinates it reaches non-finite for every query that attends it: all of them, ``affine`` its groups',
      ``fp16`` the coordinates given.
    * Every other vector is stored and decoded exactly as it would be without it. Where a method chooses shared
      state from a block (``qjl``'s outlier channels per group of tokens, ``turboquant``'s data-chosen channels),
      non-finite coordinates count as 0 in that choice.
    """

    def kvq_quantize(self, x: mx.array, params: Any) -> Encoded:
        """:func:`kvq.hookspecs.kvq_quantize`."""


@runtime_checkable
class Dequantizes(Protocol):
    """Op ``dequantize``."""

    def kvq_dequantize(self, encoded: Encoded, dtype: mx.Dtype) -> mx.array:
        """:func:`kvq.hookspecs.kvq_dequantize`."""


@runtime_checkable
class Attends(Protocol):
    """Op ``attend``."""

    def kvq_attend(self, queries: mx.array, keys: Encoded, values: Encoded, scale: float,
                   mask: Any) -> tuple[mx.array, mx.array]:
        """:func:`kvq.hookspecs.kvq_attend`."""


@runtime_checkable
class Packs(Protocol):
    """Op ``pack``: both hooks."""

    def kvq_pack(self, codes: mx.array, bits: int) -> mx.array:
        """:func:`kvq.hookspecs.kvq_pack`."""

    def kvq_unpack(self, packed: mx.array, bits: int, count: int) -> mx.array:
        """:func:`kvq.hookspecs.kvq_unpack`."""


#: op name -> the Protocol an implementation satisfies to serve it (:data:`kvq.plugins.OP_HOOKS` names the hooks).
OP_PROTOCOLS = {"quantize": Quantizes, "dequantize": Dequantizes, "attend": Attends, "pack": Packs}


# -- implementation objects: optional ----------------------------------------------------------------------------
@runtime_checkable
class Explains(Protocol):
    """Optional: a note on a problem, shown by ``kvq select`` and ``kvq bench ops`` next to the candidate."""

    def explain(self, problem: Problem) -> str:
        """Why it does (or does not) serve ``problem``, in a few words; ``""`` for nothing to add. Called for every
        candidate, supported or not (:func:`kvq.select`); must not raise."""


@runtime_checkable
class AttendsDense(Protocol):
    """Optional, on an implementation of ``attend``: decode attention over a cache's compressed tokens *and* its
    uncompressed ones (sinks and residual window) in one softmax (kvq_metal's fused kernels).

    :class:`kvq.cache.KVQCache` calls it instead of attending the parts and merging them, on the implementation
    :func:`kvq.select` chose for ``attend``, when one query per sequence arrives (``T_q == 1``), with no mask array
    and no attention-sink logits, and the cache holds both compressed and window tokens.
    """

    def attend_dense(self, queries: mx.array, keys: Encoded, values: Encoded, scale: float,
                     dense: DenseTokens) -> tuple[mx.array, mx.array] | None:
        """:param queries: ``[B, H_q, T_q, D]`` float, not yet scaled. :param keys, values: the compressed tokens
        (:class:`kvq.Encoded`). :param scale: as ``kvq_attend``. :param dense: :class:`kvq.attention.DenseTokens`,
        the uncompressed tokens in the model's dtype; every key precedes every query (no mask).

        :return: ``(out [B, H_q, T_q, D_v] float32, lse [B, H_q, T_q] float32)`` over all those tokens, as
            ``kvq_attend`` returns them; or ``None`` where it does not serve this call (the cache then attends the
            parts separately: the same result).
        """


@runtime_checkable
class BindsDense(Protocol):
    """Optional, on an implementation of ``attend`` that has :class:`AttendsDense`: the same attention bound once
    for a cache's decode steps, so that a step only appends its token and launches (issue #22: the decode hot path
    decided once per layer).

    :class:`kvq.cache.KVQCache` binds when it would call ``attend_dense`` and holds the binding while its
    compressed tokens (their view object), the queries' shape and dtype, the scale and the installed plugins stay
    the same; a window flush, a trim into the compressed tokens, a loaded file or a registered plugin make it bind
    again.
    """

    def bind_dense(self, queries: mx.array, keys: Encoded, values: Encoded, scale: float,
                   sink_keys: mx.array | None, sink_values: mx.array | None, window_keys: mx.array,
                   window_values: mx.array) -> Callable[[mx.array, mx.array, mx.array], mx.array] | None:
        """:param queries: ``[B, H_q, T_q, D]``, as every bound step passes them. :param keys, values: the compressed
        tokens. :param scale: as ``kvq_attend``. :param sink_keys, sink_values: ``[B, H_kv, n, D]`` uncompressed
        first tokens in the model's dtype, or ``None``. :param window_keys, window_values: the window as it is now
        (its dtype is bound, not its length).

        :return: ``step(queries, window_keys, window_values) -> out [B, H_q, T_q, D_v]`` in the queries' dtype, what
            ``attend_dense`` returns (cast) for the window passed; steps run in order. ``None`` where it does not
            serve (the cache then calls ``attend_dense``, or attends the parts: the same result).
        """


@runtime_checkable
class BindsRaggedDense(Protocol):
    """Optional, on an implementation of ``attend`` that has :class:`BindsDense`: the bound decode step for a batch
    whose rows hold different numbers of tokens (sequences of different lengths), in one launch for all rows
    (issue #22: batched decode in one launch). :class:`kvq.cache.BatchKVQCache` binds it over its packed rows
    (:mod:`kvq.cache.packed`) on the same terms as :class:`BindsDense`.
    """

    def bind_ragged_dense(self, queries: mx.array, keys: Encoded, values: Encoded, scale: float,
                          sink_keys: mx.array | None, sink_values: mx.array | None, window_keys: mx.array,
                          window_values: mx.array) -> Callable[..., mx.array] | None:
        """As :meth:`BindsDense.bind_dense`, with ``keys``/``values`` ``[B, H_kv, T, ...]`` of which row ``b`` holds
        its first ``lengths[b, 0]`` tokens, and every row's sinks whole.

        :return: ``step(queries, window_keys, window_values, lengths) -> out [B, H_q, T_q, D_v]`` in the queries'
            dtype, where ``lengths`` int32 ``[B, 2]`` holds each row's compressed tokens (``0 .. T``) and window
            tokens (``0 .. n`` of the window ``[B, H_kv, n, D]`` passed); each row's output is what
            :meth:`BindsDense.bind_dense`'s step gives for that row alone (up to float32 rounding). ``None`` where
            it does not serve (the cache then attends the rows' parts with masks: the same result).

        A step may outlive a window flush (issue #52: a batch's rows flush at different steps, most steps one of
        them): the batch writes the flushed rows' codes into the arrays of ``keys.data`` and ``values.data`` in
        place (MLX slice assignment) and keeps a step whose ``reads_in_place`` attribute is true, binding again
        only where it replaces the arrays (more capacity, rows taken out or added). Such a step reads those very
        arrays at each call, as kernel inputs, and keeps nothing derived from their contents at binding
        (:class:`kvq_metal.step.DecodeStep`); a step without the attribute is bound again after every flush.
        """


@runtime_checkable
class AttendsColumns(Protocol):
    """Optional, on a kernel implementation of a method: a prefill chunk's attention over the layer's columns
    laid side by side (sinks, the compressed tokens decoded, the uncompressed ones; 16-bit), each
    query row seeing its own column intervals, with no mask array (issue #51: MLX's attention with a mask runs
    cuDNN's bias kernel at 1.5-1.9x causal time). :func:`kvq.cache.prefill.attend_dequantized` calls it where
    mlx-lm passes no mask of its own, and attends with the mask where it returns ``None``.
    """

    def attend_columns(self, queries: mx.array, keys: mx.array, values: mx.array, intervals: mx.array,
                       scale: float, sink_logits: mx.array | None = None) -> mx.array | None:
        """:param queries: ``[B, H_q, T_q, D]`` (a centred or scaled layer's already transformed, as its keys).
        :param keys, values: ``[B, H_kv, N, D]`` columns in the queries' dtype. :param intervals: int32 ``[T_q, P,
        2]``: row ``r`` sees column ``c`` iff ``intervals[r, p, 0] <= c < intervals[r, p, 1]`` for some ``p``
        (:func:`kvq.cache.prefill.column_intervals`). :param scale: the softmax scale. :param sink_logits: ``[H_q]``
        learned sink logits joined to the softmax, or ``None``.

        :return: ``[B, H_q, T_q, D_v]`` in the queries' dtype (a row that sees nothing: zeros), what
            ``mx.fast.scaled_dot_product_attention`` gives with the intervals as an additive mask; ``None`` where it
            does not serve.
        """


@runtime_checkable
class DequantizesInto(Protocol):
    """Optional, on an implementation that dequantizes: decode into a wider buffer, leaving columns around the
    decoded tokens for the caller to write in place (a prefill chunk's sinks and window beside its decoded tokens:
    :func:`kvq.cache.prefill.columns`). Joining a decoded copy to them with ``mx.concatenate`` copied every
    decoded token once more: 0.14-0.38 ms per layer and chunk of 2,048 at 8K-32K held tokens on an H100 (issue
    #51, ``benchmarks/results/prefill/2026-12-06-h100-chunk-kernels``).
    """

    def dequantize_into(self, encoded: Encoded, dtype: Any, before: int, after: int) -> mx.array | None:
        """:param encoded: ``[B, H, T, D]`` tokens. :param dtype: the output's dtype. :param before, after: columns
        (>= 0) to leave ahead of and behind each row's decoded tokens.

        :return: a new array the caller owns and may write in place, ``[B, H, before + T + after, D]``: columns
            ``before .. before + T - 1`` the decoded tokens, within one rounding of ``dtype`` of what the method's
            ``kvq_dequantize`` gives (a kernel may round once where pure MLX rounds through the side data's dtype
            first), the others unwritten (any value until the caller writes them); ``None`` where it does not
            serve (the caller then joins ``kvq_dequantize``'s output).
        :raises ValueError: ``before`` or ``after`` negative.
        """


@runtime_checkable
class PreparesQueries(Protocol):
    """Optional, key side of the block protocol (:func:`kvq.attention.attend_encoded`): transform the query once."""

    def prepare_queries(self, q: mx.array, keys: Encoded) -> Any:
        """:param q: scaled float32 grouped queries ``[B, H_kv, n_rep, T_q, D]``. :param keys: the keys to attend.

        :return: what :meth:`ScoresKeys.scores` takes as ``q`` (an array, e.g. the rotated query ``[..., D_pad]``,
            or a structure of arrays). :raises ValueError: keys this implementation cannot read (naming why).
        """


@runtime_checkable
class ScoresKeys(Protocol):
    """Optional, key side of the block protocol: scores on one block of keys without decoding the whole cache.
    Without it, the keys are decoded one block at a time with ``kvq_dequantize``.

    Memory: everything it allocates must scale with the block (``stop - start`` tokens), never with the cache:
    :func:`kvq.attention.attend_encoded` runs one block at a time, so this working set, which the implementation
    states in its docstring as float32 copies of the block's keys, is what decode holds above the cache.
    """

    def scores(self, q: Any, keys: Encoded, start: int, stop: int) -> mx.array:
        """:param q: :meth:`PreparesQueries.prepare_queries`'s result where defined, else the scaled float32
        grouped queries ``[B, H_kv, n_rep, T_q, D]``. :param keys: all the keys; :param start, stop: the block.

        :return: float32 ``[B, H_kv, n_rep, T_q, stop - start]``, ``q · k`` (scale included through ``q``, not
            masked).
        """


@runtime_checkable
class WeightsValues(Protocol):
    """Optional, value side of the block protocol: probabilities times one block of values, without decoding the
    whole cache. Without it, the values are decoded one block at a time with ``kvq_dequantize``.

    Memory: as :class:`ScoresKeys`, a working set that scales with the block (stated as float32 copies of the
    block's values), never with the cache.
    """

    def weighted_values(self, p: mx.array, values: Encoded, start: int, stop: int) -> mx.array:
        """:param p: unnormalised probabilities, float32 ``[B, H_kv, n_rep, T_q, stop - start]``.
        :param values: all the values; :param start, stop: the block.

        :return: float32 ``[B, H_kv, n_rep, T_q, D']``, ``p @ V[start:stop]``, where ``D'`` is ``D_v`` or, with
            :meth:`FinishesValues.finish_values`, any width that it maps back (a rotated or padded domain).
        """


@runtime_checkable
class FinishesValues(Protocol):
    """Optional, value side of the block protocol: map the accumulated output back once, after normalisation."""

    def finish_values(self, out: mx.array, values: Encoded) -> mx.array:
        """:param out: the normalised sum of :meth:`WeightsValues.weighted_values`, float32 ``[B, H_kv, n_rep, T_q,
        D']``. :return: float32 ``[B, H_kv, n_rep, T_q, D_v]``. :raises ValueError: values it cannot read."""


@runtime_checkable
class ReportsSources(Protocol):
    """Optional, on an implementation object or an entry-point module: a hash of sources a measurement depends
    on (kernel text), recorded with benchmark results (:func:`kvq.provenance.sources_hashes`)."""

    def sources_hash(self) -> str:
        """A short stable hash (hex) of those sources. An exception is recorded as ``None``."""


# -- parameter objects: required ---------------------------------------------------------------------------------
@runtime_checkable
class Params(Protocol):
    """A method's parameters: a frozen, validated ``attrs`` class (``Method.params_class``).

    Besides these members: every field has a default (:func:`kvq.select` builds ``make_params()`` when given none);
    instances are hashable (selection and kernel checks key on them); ``attrs.asdict(params)`` is JSON-serialisable
    and ``Method.make_params(**that)`` rebuilds an equal object (prompt-cache files: :mod:`kvq.cache.state`); a bad
    value raises ``ValueError`` naming the field.

    :attr method: class attribute, the method's name (equal to ``Method.name``; checked at registration).
    """

    method: ClassVar[str]

    def accounting(self, head_dim: int) -> BitsAccounting:
        """What is stored per token and what is shared, for vectors of ``head_dim``
        (:class:`kvq.BitsAccounting`). :raises ValueError: a head_dim these parameters do not support."""

    def check_head_dim(self, head_dim: int) -> None:
        """:raises ValueError: ``head_dim`` not supported by these parameters (the message names it and why)."""


# -- parameter objects: optional ---------------------------------------------------------------------------------
@runtime_checkable
class SideDefaults(Protocol):
    """Optional, a static method of the parameter *class*: defaults that differ between the keys' and the values'
    parameters of one cache (VecInfer: ``role``). :func:`kvq.cache.make_config` applies them first, then the
    parameters shared by both sides, then the side's own (``key_params=``/``value_params=``)."""

    @staticmethod
    def side_defaults(side: str) -> dict[str, Any]:
        """:param side: ``"keys"`` or ``"values"``. :return: parameter name -> value."""


@runtime_checkable
class ChecksReady(Protocol):
    """Optional: fail at cache construction what the first compressed block would fail later (data on disk)."""

    def check_ready(self) -> None:
        """Called by :func:`kvq.make_prompt_cache` on both sides' parameters, and by :func:`kvq.select`, whose
        plan then says it is not ready (:attr:`kvq.Plan.not_ready`) and whose ``quantize`` raises the error.

        :raises ValueError: these parameters cannot encode yet (VecInfer: no calibration; the message names the
            command to run).
        """


@runtime_checkable
class ForLayer(Protocol):
    """Optional: per-layer state (VecInfer's codebooks). :meth:`kvq.cache.CacheConfig.for_layer` calls it, so
    each layer's cache gets its own parameters."""

    def for_layer(self, layer: int) -> Any:
        """:param layer: the layer's index in the whole model (under pipeline parallelism, this rank's first
        layer's index plus its position: :func:`kvq.distributed.first_layer`). :return: parameters of the same
        class bound to that layer. :raises ValueError: ``layer`` not an int >= 0."""


@runtime_checkable
class ForHeads(Protocol):
    """Optional: per-KV-head state (VecInfer's smoothing factors and per-head codebooks, TurboQuant's fitted
    outlier channels). Under tensor parallelism each rank's caches hold KV heads ``start:stop`` of the model
    (:func:`kvq.distributed.kv_head_range`) and :meth:`kvq.cache.CacheConfig.for_heads` calls it."""

    def for_heads(self, start: int, stop: int) -> Any:
        """:return: parameters of the same class for a cache holding KV heads ``start:stop`` of the model.
        :raises ValueError: a bad range."""


@runtime_checkable
class ForHeadDim(Protocol):
    """Optional: a parameter whose default depends on head_dim (``affine``'s ``group_size=None``: 64 where it
    divides head_dim, else 32). :func:`kvq.select` calls it with the shape's head_dim, after ``check_head_dim``,
    so a plan holds (and :meth:`kvq.Plan.explain` shows) the concrete parameters. A kvq cache learns its head_dim
    from its first block; a method that needs concrete parameters there also defines :class:`Fits`."""

    def for_head_dim(self, head_dim: int) -> Any:
        """:return: parameters of the same class with every head_dim-dependent default made concrete (``self``
        where there is none). :raises ValueError: a head_dim these parameters do not support."""


@runtime_checkable
class Fits(Protocol):
    """Optional: shared state chosen from data (TurboQuant's data-chosen outlier channels). A cache calls it once
    per layer, on the first block it compresses, and uses (and saves in prompt-cache files) what it returns.
    A method that fits should also define :class:`Unfits`."""

    def fit(self, block: mx.array) -> Any:
        """:param block: ``[B, H_kv, T, D]`` float, the keys (or values) about to be compressed.

        :return: fitted parameters of the same class; parameters already fitted (or that use no data) are returned
            unchanged. :raises ValueError: an empty block, or parameters that do not fit ``D``.
        """


@runtime_checkable
class Unfits(Protocol):
    """Optional: the parameters as the user asked for them, without fitted state; :func:`kvq.load_prompt_cache`
    compares files with ``expect=`` through it."""

    def unfitted(self) -> Any:
        """:return: parameters of the same class without fitted state (``self`` where there is none)."""


@runtime_checkable
class SpendsBudget(Protocol):
    """Optional: the parameter settings of this method a bits budget may choose from (TurboQuant's bits with a
    share of rotated coordinates at other bits: fractional bits per coordinate). :mod:`kvq.cache.budget` picks,
    per layer and side, one of them by its :meth:`accounting` at the layer's head_dim (``kvq.make_prompt_cache(
    model, "turboquant", bits=3.5)``, method string ``turboquant:3.5``)."""

    def budget_options(self, head_dim: int) -> Sequence[Any]:
        """:return: parameters of the same class (every field not about bits as in ``self``), each a setting the
            budget may pick at ``head_dim``; ``self``'s own bits need not be among them. :raises ValueError: a
            head_dim, or parameters (e.g. data-chosen outlier channels), that a budget cannot serve."""


@runtime_checkable
class EncodesBlocks(Protocol):
    """Optional: an encoding that depends on which tokens are encoded together (QJL chooses outlier channels per
    group of tokens). The cache then compresses only whole, aligned blocks: its flush becomes the least common
    multiple of the configured ``flush`` and both sides' ``block_tokens()``
    (:attr:`kvq.cache.CacheConfig.flush_tokens`), so a prompt gives the same stored bytes and the same attention
    whatever its chunking."""

    def block_tokens(self) -> int:
        """:return: tokens (>= 1) the method must encode together, counted from the first compressed token."""


#: The optional single-member Protocols of implementation objects (entry-point modules: :class:`ReportsSources`).
IMPLEMENTATION_OPTIONS = (Explains, AttendsColumns, DequantizesInto, AttendsDense, BindsDense, BindsRaggedDense,
                          PreparesQueries, ScoresKeys, WeightsValues, FinishesValues, ReportsSources)
#: The optional single-member Protocols of parameter objects (:class:`SideDefaults` is read from the class).
PARAMS_OPTIONS = (SideDefaults, ChecksReady, ForLayer, ForHeads, ForHeadDim, Fits, Unfits, SpendsBudget,
                  EncodesBlocks)


def member_name(protocol: type) -> str:
    """The name of the one member of an optional Protocol (``member_name(ForLayer) == "for_layer"``)."""
    (name,) = [n for n in vars(protocol) if not n.startswith("_")]
    return name


_MEMBER = {p: member_name(p) for p in IMPLEMENTATION_OPTIONS + PARAMS_OPTIONS}


def optional_hook(obj: object, protocol: type) -> Callable[..., Any] | None:
    """``obj``'s member of the optional ``protocol`` (bound), or ``None`` where ``obj`` does not define it.

    ``optional_hook(impl, ScoresKeys)`` is ``impl.scores`` or ``None``. A dictionary lookup and a ``getattr``: cheap
    enough for the decode hot path (an ``isinstance`` check against a runtime Protocol is not).

    :raises KeyError: ``protocol`` is not one of :data:`IMPLEMENTATION_OPTIONS` or :data:`PARAMS_OPTIONS`.
    """
    return getattr(obj, _MEMBER[protocol], None)


__all__ = ["AttendsColumns", "AttendsDense", "Attends", "BindsDense", "BindsRaggedDense", "ChecksReady",
           "Dequantizes", "DequantizesInto", "EntryPoint", "Explains", "FinishesValues", "Fits", "ForHeadDim",
           "ForHeads", "ForLayer", "IMPLEMENTATION_OPTIONS", "Implementation", "OP_PROTOCOLS", "PARAMS_OPTIONS",
           "EncodesBlocks", "Packs",
           "Params", "PreparesQueries", "Quantizes", "ReportsSources", "ScoresKeys", "SideDefaults", "SpendsBudget",
           "Unfits", "WeightsValues", "member_name", "optional_hook"]
