"""Method declarations: parameter classes and bits-per-coordinate accounting.

A method is declared once, by the plugin that owns it, with :class:`Method`. Its parameters are a frozen,
validated ``attrs`` class that also answers two questions: ``accounting(head_dim)`` (what is stored per token,
and what is shared) and ``check_head_dim(head_dim)``.
"""

from __future__ import annotations

from typing import Any, Mapping

import attrs


@attrs.frozen
class BitsAccounting:
    """What a method stores, in bits, for one vector of ``head_dim`` coordinates.

    docs/DESIGN.md's rule ("Vocabulary"): everything stored per token (codes, norms, scales, outlier indices) counts
    towards bits per coordinate; constants shared by all tokens (codebooks, rotations) are reported apart, in bytes.

    :param head_dim: ``D``.
    :param per_token: field name -> bits stored per token and head for that field (e.g. ``{"codes": 512,
        "scales": 32, "biases": 32}`` for affine 4-bit, group 64, D 128).
    :param shared_bytes: bytes of constants shared by all tokens of one layer.
    """

    head_dim: int
    per_token: Mapping[str, float]
    shared_bytes: int = 0

    @property
    def bits_per_token(self) -> float:
        """Total bits stored per token and head."""
        return float(sum(self.per_token.values()))

    @property
    def bits_per_coordinate(self) -> float:
        """``bits_per_token / head_dim``: the number that compression claims must be quoted with."""
        return self.bits_per_token / self.head_dim

    def bytes_for(self, batch: int, num_kv_heads: int, num_tokens: int) -> float:
        """Bytes that ``num_tokens`` tokens occupy in ``batch * num_kv_heads`` heads (shared data excluded)."""
        return self.bits_per_token * batch * num_kv_heads * num_tokens / 8


@attrs.frozen
class Method:
    """Declaration of one compression method.

    :param name: the method name users type (``"affine"``).
    :param params_class: frozen attrs class of its parameters; it must define ``accounting(head_dim) ->
        BitsAccounting`` and ``check_head_dim(head_dim)`` (raising ``ValueError``), and a ``method`` class
        attribute equal to ``name``.
    :param description: one line for ``kvq list``.
    :param source: the paper or code it follows.
    :param needs_calibration: ``True`` when parameters come from calibration data (``kvq calibrate``).
    :param keys_only: ``True`` for a key method that cannot serve values (QJL's sign sketch estimates inner
        products, not vectors); a cache refuses it on the values' side.
    :param scale_keys: ``True`` where the key guard may scale key channels before this method quantizes keys
        (:func:`kvq.cache.guard.key_scales`): a method whose error is isotropic in the vector (TurboQuant, after its
        rotation), measured to gain from it.
    :param calibrate: how ``kvq calibrate --method NAME`` calibrates it: the import path of a module (or
        ``"module:attribute"``) that is imported only when that command runs and offers
        ``add_arguments(parser)`` (the method's own options, optional) and ``run(model, *, text, text_name,
        tokens, seq_len, seed, model_id, progress, **options) -> list[Path]`` (``options``: what
        ``add_arguments`` added, by ``dest``; returns the files written). ``None``: no calibration command.
    """

    name: str
    params_class: type
    description: str
    source: str = ""
    needs_calibration: bool = False
    keys_only: bool = False
    calibrate: str | None = None
    scale_keys: bool = False

    def make_params(self, **kwargs: Any):
        """Build validated parameters, naming the allowed parameters when one is unknown.

        Whole-valued floats (``bits=4.0``) of parameters annotated ``int`` are taken as ints.

        :raises TypeError: an unknown parameter name.
        :raises ValueError: a value out of range (raised by the parameter class's validators).
        """
        fields = [f.name for f in attrs.fields(self.params_class) if f.init]
        unknown = sorted(set(kwargs) - set(fields))
        if unknown:
            raise TypeError(
                f"unknown parameter(s) {', '.join(unknown)} for method {self.name!r}; "
                f"allowed: {', '.join(fields) or '(none)'}"
            )
        ints = {f.name for f in attrs.fields(self.params_class) if _whole_number_field(f)}
        return self.params_class(**{k: int(v) if k in ints and _whole_float(v) else v for k, v in kwargs.items()})


def _whole_float(value) -> bool:
    """A float with no fraction (``4.0``: what a JSON file or arithmetic may give for ``4``)."""
    return isinstance(value, float) and value.is_integer()


def _whole_number_field(field: attrs.Attribute) -> bool:
    """Whether a parameter holds whole numbers (annotated ``int`` or ``int | None``, not ``float``): its
    whole-valued floats are taken as ints, as :func:`kvq.make_config` takes ``bits=4.0``, so ``4.0`` is ``4``
    everywhere (a float reaching a code width had passed the range check and failed inside the quantizer)."""
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", repr(field.type))
    words = set(kind.replace("|", " ").replace(",", " ").replace("[", " ").replace("]", " ").split())
    return "int" in words and "float" not in words
