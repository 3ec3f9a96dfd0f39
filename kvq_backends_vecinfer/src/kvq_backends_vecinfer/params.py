"""Parameters and bits accounting of ``vecinfer`` (Yao et al., VecInfer, arXiv 2510.06175).

Each key or value vector is split into ``head_dim / sub_dim`` sub-vectors; each sub-vector is stored as the index
of its nearest centroid in a k-means codebook of ``2**code_bits`` entries. Nothing else is stored per token (no
norms, no scales), so the cost is the packed codes: ``code_bits / sub_dim`` bits per coordinate, rounded up to
whole uint32 words per token. Codebooks (and, for keys, the smoothing factors) are constants of one layer,
computed by ``kvq calibrate`` for one model and reported apart (``shared_bytes``).

The parameters name *which* calibration to use (model, role, sub_dim, code_bits, per_head), never the arrays, so
they stay small, hashable and JSON-serialisable (prompt-cache files store them). The layer is part of the
parameters: :meth:`VecInferParams.for_layer` gives each layer's cache its own parameters.
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import kvq
from kvq.packing import packed_words
from kvq.validate import attrs_one_of

from . import hadamard, storage

SUB_DIMS = (2, 4, 8)
CODE_BITS = tuple(range(4, 13))
ROLES = ("keys", "values")


def _model_id(value):
    return storage.DEFAULT_MODEL_ID if value == "default" else value


def _check_model_id(instance, attribute, value):
    if value is not None and (not isinstance(value, str) or not value.strip()):
        raise ValueError(f"model_id must be a non-empty string (the model given to 'kvq calibrate') or None; "
                         f"got {value!r}")


def _check_layer(instance, attribute, value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"layer must be an int >= 0 or None; got {value!r}")


def _heads(value):
    return tuple(value) if isinstance(value, list) else value  # JSON (prompt-cache files) gives a list


def _check_heads(instance, attribute, value):
    ints = isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value)
    if value is not None and not (ints and 0 <= value[0] < value[1]):
        raise ValueError(f"heads must be None or (start, stop) with 0 <= start < stop, the KV heads of the "
                         f"calibration this cache holds; got {value!r}")


def _check_bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False; got {value!r}")


@attrs.frozen(cache_hash=True)  # hashed on every decode step (selection and kernel-check keys)
class VecInferParams:
    """Parameters of ``vecinfer`` (VecInfer, arXiv 2510.06175): product vector quantization with calibrated codebooks.

    :param model_id: the model whose calibration to use, by the id ``kvq calibrate --model M`` stored it under
        (:func:`~kvq_backends_vecinfer.storage.model_id_for`: a Hub id as given, a folder's name, a .gguf file's
        stem; ``"default"`` is ``SmolLM2-135M-Instruct``); kvq's commands that run a model set it from ``--model``.
        ``None`` (the default) allows structural checks only: the parameters are not ready (:meth:`check_ready`).
    :param role: ``"keys"`` (per-channel smoothing, then Hadamard; queries are transformed inversely) or
        ``"values"`` (Hadamard only). Use ``role="values"`` for the values' parameters.
    :param sub_dim: coordinates per sub-vector, one of 2, 4, 8; must divide head_dim.
    :param code_bits: bits per sub-vector code, 4..12 (a codebook of ``2**code_bits`` centroids).
    :param per_head: one codebook per KV head (``True``) or one per layer shared by all heads (``False``, default).
    :param layer: index in ``model.layers`` whose codebook to use; set per layer by :meth:`for_layer` (the cache
        calls it), ``None`` until then.
    :param heads: ``(start, stop)``: the cache holds only KV heads ``start:stop`` of the calibrated model, and
        uses their smoothing factors and (``per_head``) codebooks; set by :meth:`for_heads` under tensor
        parallelism (:func:`kvq.make_prompt_cache` on a sharded model); ``None`` (default): all heads.
    :raises ValueError: any value outside those ranges (the message names the parameter and what is allowed).
    """

    method: ClassVar[str] = "vecinfer"
    model_id: str | None = attrs.field(default=None, converter=_model_id, validator=_check_model_id)
    role: str = attrs.field(default="keys", validator=attrs_one_of(ROLES))
    sub_dim: int = attrs.field(default=4, validator=attrs_one_of(SUB_DIMS))
    code_bits: int = attrs.field(default=8, validator=attrs_one_of(CODE_BITS))
    per_head: bool = attrs.field(default=False, validator=_check_bool)
    layer: int | None = attrs.field(default=None, validator=_check_layer)
    heads: tuple[int, int] | None = attrs.field(default=None, converter=_heads, validator=_check_heads)

    def for_layer(self, layer: int) -> VecInferParams:
        """These parameters bound to ``layer`` (its index in the whole model): the cache of that layer uses them
        (:class:`kvq.contract.ForLayer`).

        :raises ValueError: ``layer`` not an int >= 0.
        """
        return attrs.evolve(self, layer=layer)

    @staticmethod
    def side_defaults(side: str) -> dict:
        """Defaults for the keys' or the values' parameters in a cache (:class:`kvq.contract.SideDefaults`): the
        values use the values' codebooks (``role="values"``) unless a role is given."""
        return {"role": side}

    def check_ready(self) -> None:
        """Raise now, at cache construction, what the first compressed block would raise later
        (:class:`kvq.contract.ChecksReady`; :func:`kvq.select` reports it in its plan, whose ``quantize`` raises it).

        :raises CalibrationError: no ``model_id``, or its calibration is missing or unreadable (the message names
            the ``kvq calibrate`` command to run).
        """
        storage.calibration_for(self)

    def for_heads(self, start: int, stop: int) -> VecInferParams:
        """These parameters for a cache holding KV heads ``start:stop`` of the calibrated model (one tensor-parallel
        rank's slice; :func:`kvq.make_prompt_cache` calls it on a sharded model: :class:`kvq.contract.ForHeads`).
        :raises ValueError: a bad range."""
        return attrs.evolve(self, heads=(start, stop))

    @property
    def smoothed(self) -> bool:
        """Whether vectors are divided by per-channel smoothing factors before the Hadamard (keys only)."""
        return self.role == "keys"

    def sub_vectors(self, head_dim: int) -> int:
        """``M = head_dim / sub_dim``, the codes stored per vector."""
        return head_dim // self.sub_dim

    def check_head_dim(self, head_dim: int) -> None:
        """Structural checks, and with a ``model_id`` also the calibration's head_dim.

        :raises ValueError: ``sub_dim`` does not divide ``head_dim``, ``head_dim`` is not a Hadamard size
            (``m · 2^k``, ``m`` in 1, 12, 20, 28), or the calibration is missing, unreadable, or for another
            head_dim (:class:`~kvq_backends_vecinfer.storage.CalibrationError`, naming the command to run).
        """
        if not isinstance(head_dim, int) or head_dim < 1 or head_dim % self.sub_dim:
            raise ValueError(f"vecinfer: head_dim {head_dim!r} is not supported: it must be a multiple of "
                             f"sub_dim={self.sub_dim}")
        hadamard.check(head_dim)
        if self.model_id is not None:
            storage.calibration_for(self).check_head_dim(head_dim)

    def accounting(self, head_dim: int) -> kvq.BitsAccounting:
        """Per token: ``head_dim / sub_dim`` codes of ``code_bits`` bits, packed in whole uint32 words (nothing else).

        Shared per layer: the codebooks (float32 ``[G, 2**code_bits, sub_dim]``, ``G`` = 1 or the KV heads) and,
        for keys, the smoothing factors (float32 ``[H_kv, head_dim]``); taken from the calibration when
        ``model_id`` is set, else counted for one head.

        :raises ValueError: as :meth:`check_head_dim`.
        """
        self.check_head_dim(head_dim)
        codes = 32 * packed_words(self.sub_vectors(head_dim), self.code_bits)
        if self.model_id is None:
            heads = 1
        else:
            heads = storage.calibration_for(self).num_kv_heads
        if self.heads is not None:
            heads = self.heads[1] - self.heads[0]
        groups = heads if self.per_head else 1
        shared = 4 * (groups * 2**self.code_bits * self.sub_dim + (heads * head_dim if self.smoothed else 0))
        return kvq.BitsAccounting(head_dim, {"codes": codes}, shared)
