"""Method strings: one text naming what a kvq cache stores for keys and values and how it holds them, as the
command line (``kvq generate --method``, ``kvq eval --methods``, ``kvq bench``) and
:func:`kvq.make_prompt_cache` take it. Parsing only: :mod:`kvq.evaluation.spec` validates them against the
installed methods and builds the caches of a run.

Grammar (``METHODS`` is what ``--methods`` takes; commas inside ``[...]`` do not separate methods)::

    METHODS := SPEC { "," SPEC }
    SPEC    := SIDE [ "+" SIDE ]            keys "+" values: qjl+affine:2 = keys qjl, values affine 2-bit
    SIDE    := NAME [ ":" BITS ] [ "[" OPTIONS "]" ]
    BITS    := INT | "k" INT "v" INT         affine:k8v4 = keys 8-bit, values 4-bit (one NAME only)
             | DECIMAL                      turboquant:3.5 = a budget of 3.5 bits per coordinate, keys and
                                            values together: each layer's settings chosen for it
                                            (kvq.cache.budget)
    OPTIONS := KEY "=" VALUE { "," KEY "=" VALUE }
                                            method parameters (qjl[sketch_dim=64]); sinks=, window= and
                                            flush= set the cache's uncompressed first/last tokens and
                                            its flush block (kvq.cache.CacheConfig) instead
    NAME    := an installed method (affine, turboquant, ...) or mlx-affine: mlx-lm's own
               QuantizedKVCache (group_size 64 unless given), a baseline with no sinks and no window

The whole string ``kvcache`` (or ``fp16``, its older name) is the reference: mlx-lm's own caches in the model's
dtype (:data:`REFERENCE`); ``kvq-fp16`` is kvq's 16-bit cache (the ``fp16`` method, with sinks and window).

Examples: ``kvcache``, ``affine:4``, ``affine:k8v4``, ``turboquant:3[rotation=qr]``, ``qjl[sketch_dim=128]+affine:4``,
``affine:8[sinks=0,window=0,flush=1]``, ``mlx-affine:4[group_size=32]``, ``turboquant:3.5``.
"""

from __future__ import annotations

import re
from typing import Any

import attrs

#: The name of mlx-lm's own QuantizedKVCache in method strings.
MLX_AFFINE = "mlx-affine"
MLX_BITS = (2, 3, 4, 5, 6, 8)
MLX_GROUP_SIZES = (32, 64, 128)
CACHE_OPTIONS = ("sinks", "window", "flush")
#: The method string of the reference cache in every command: mlx-lm's own caches for the model (``KVCache``;
#: ``RotatingKVCache`` on sliding-window layers) in the model's dtype, which kvq does not touch.
REFERENCE = "kvcache"
#: Older names of the reference: accepted in method strings, and read from older result files (``kvq bench``
#: wrote ``fp16`` for mlx-lm's KVCache in the model's dtype).
REFERENCE_ALIASES = ("fp16",)
#: kvq's own 16-bit cache (the ``fp16`` method: KVQCache with 16-bit parts), as a method string.
KVQ_FP16 = "kvq-fp16"
_SIDE = re.compile(r"^(?P<name>[A-Za-z_][\w-]*)(?::(?P<bits>[^\[\]]+))?(?:\[(?P<options>[^\[\]]*)\])?$")
_SPLIT_BITS = re.compile(r"^k(\d+)v(\d+)$")
_BUDGET_BITS = re.compile(r"^\d*\.\d+$")


@attrs.frozen
class MethodSpec:
    """One parsed method string: what to store for keys and values, and how the cache holds them.

    :param label: the string as written (the row name in reports).
    :param key_method: method of the keys (``mlx-affine`` for mlx-lm's QuantizedKVCache).
    :param value_method: method of the values.
    :param key_params: keyword parameters of the keys' method (``{"bits": 4}``).
    :param value_params: keyword parameters of the values' method.
    :param cache_options: ``sinks``/``window``/``flush`` overrides of the run's defaults, and a budget ``bits``
        (``turboquant:3.5``; kvq caches only).
    """

    label: str
    key_method: str
    value_method: str
    key_params: dict = attrs.field(factory=dict)
    value_params: dict = attrs.field(factory=dict)
    cache_options: dict = attrs.field(factory=dict)

    @property
    def is_reference(self) -> bool:
        """True for the reference, mlx-lm's own caches in the model's dtype (:data:`REFERENCE`)."""
        return self.key_method == REFERENCE

    @property
    def is_mlx(self) -> bool:
        """True for mlx-lm's own QuantizedKVCache."""
        return self.key_method == MLX_AFFINE

    def mlx_settings(self) -> tuple[int, int]:
        """``(bits, group_size)`` of an ``mlx-affine`` spec (mlx-lm's defaults: 8 bits, group 64)."""
        return self.key_params.get("bits", 8), self.key_params.get("group_size", 64)

    def cache_kwargs(self, sinks: int, window: int, flush: int | None = None) -> dict:
        """Keyword arguments of :func:`kvq.make_prompt_cache` / :func:`kvq.cache.make_config` (kvq specs): the
        run's ``sinks``, ``window`` and ``flush`` (``None``: the cache's default) where the method string does not
        override them (``affine:4[flush=128]``)."""
        options = {"sinks": sinks, "window": window, **({} if flush is None else {"flush": flush}),
                   **self.cache_options}
        return dict(method=None, key_method=self.key_method, value_method=self.value_method,
                    key_params=dict(self.key_params), value_params=dict(self.value_params), **options)

    def sinks_window(self, sinks: int, window: int) -> tuple[int, int]:
        """Uncompressed first and last tokens of this spec's cache (0, 0 for mlx-lm's caches)."""
        if self.is_mlx or self.is_reference:
            return 0, 0
        options = {"sinks": sinks, "window": window, **self.cache_options}
        return options["sinks"], options["window"]


def split_methods(text: str) -> list[str]:
    """``"a,b[x=1,y=2],c"`` -> ``["a", "b[x=1,y=2]", "c"]``. :raises ValueError: unbalanced brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0 or depth > 1:
            raise ValueError(f"--methods: unbalanced '[' or ']' in {text!r}")
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"--methods: unclosed '[' in {text!r}")
    parts.append(current.strip())
    if not any(parts) or not all(parts):
        raise ValueError(f"--methods: empty method in {text!r} (write e.g. kvcache,affine:4)")
    return parts


def _value(raw: str) -> Any:
    """``"3"`` -> 3, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``"none"`` -> None, else the string."""
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(raw.lower(), raw)


def _options(text: str | None, spec: str) -> dict:
    options = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise ValueError(f"method {spec!r}: option {item.strip()!r} must look like NAME=VALUE")
        options[key.strip()] = _value(raw.strip())
    return options


def _side(text: str, spec: str) -> tuple[str, dict, dict, dict]:
    """One SIDE -> ``(name, key_params, value_params, cache_options)``."""
    match = _SIDE.match(text.strip())
    if not match:
        raise ValueError(f"method {spec!r}: cannot parse {text.strip()!r}; expected NAME[:BITS][[NAME=VALUE,...]] "
                         "(e.g. affine:4, affine:k8v4, qjl[sketch_dim=64]+affine:4)")
    options = _options(match["options"], spec)
    cache = {k: options.pop(k) for k in CACHE_OPTIONS if k in options}
    if options:  # the method's parameters now; the cache's settings other than CACHE_OPTIONS cannot be set here
        from . import cache_settings

        settings = set(cache_settings())
        elsewhere = [k for k in options if k in settings]
        if elsewhere:
            raise ValueError(f"method {spec!r}: {', '.join(elsewhere)} is a setting of the cache that method strings "
                             f"do not carry (in brackets they take the method's parameters and the cache's "
                             f"{', '.join(CACHE_OPTIONS)}); give it to the command (kvq generate / kvq serve: "
                             f"--method NAME --param {elsewhere[0]}=VALUE, or its own option) or to "
                             f"kvq.make_prompt_cache({elsewhere[0]}=...)")
    key_params, value_params = dict(options), dict(options)
    bits = match["bits"]
    if bits is not None and "bits" in options:
        raise ValueError(f"method {spec!r}: bits given twice (':{bits}' and '[bits=...]')")
    if bits is not None:
        split = _SPLIT_BITS.match(bits)
        if split:
            key_params["bits"], value_params["bits"] = int(split[1]), int(split[2])
        elif bits.isdigit():
            key_params["bits"] = value_params["bits"] = int(bits)
        elif _BUDGET_BITS.match(bits) and float(bits) > 0:
            if float(bits).is_integer():
                key_params["bits"] = value_params["bits"] = int(float(bits))
            else:
                cache["bits"] = float(bits)  # a budget: kvq.cache.make_config's bits=3.5
        else:
            raise ValueError(f"method {spec!r}: bits {bits!r} must be an integer (affine:4), kNvM (affine:k8v4) or "
                             "a budget in bits per coordinate (turboquant:3.5)")
    return match["name"], key_params, value_params, cache


def is_method_string(method) -> bool:
    """Whether ``method`` is a method string rather than a method's name: it has a ``:``, ``+`` or ``[``, or it is
    one of the whole strings :data:`REFERENCE` (``kvcache``), :data:`KVQ_FP16` and :data:`MLX_AFFINE`. ``fp16``
    alone is the method's name, kvq's 16-bit cache; as a ``--methods`` entry of ``kvq eval`` and ``kvq bench``,
    which read every entry as a method string, it is the reference's older name."""
    return isinstance(method, str) and (any(c in method for c in ":+[")
                                        or method.strip() in (REFERENCE, KVQ_FP16, MLX_AFFINE))


def parse_method(spec: str) -> MethodSpec:
    """Parse one method string (see the module docstring); syntax only, no registry look-up.

    :raises ValueError: the string does not follow the grammar (the message quotes it and shows the form).
    """
    if spec.strip() in (REFERENCE, *REFERENCE_ALIASES):
        return MethodSpec(REFERENCE, REFERENCE, REFERENCE)
    if spec == KVQ_FP16 or spec.startswith(KVQ_FP16 + "["):
        return attrs.evolve(_parse_sides("fp16" + spec[len(KVQ_FP16):]), label=spec)
    return _parse_sides(spec)


def _parse_sides(spec: str) -> MethodSpec:
    """:func:`parse_method` of a string naming methods (not the reference)."""
    sides = spec.split("+")
    if len(sides) > 2:
        raise ValueError(f"method {spec!r}: at most one '+' (keys+values)")
    parsed = [_side(side, spec) for side in sides]
    if len(parsed) == 1:
        name, kp, vp, cache = parsed[0]
        return MethodSpec(spec, name, name, kp, vp, cache)
    (k_name, kp, kvp, k_cache), (v_name, vkp, vp, v_cache) = parsed
    if kp != kvp or vkp != vp:
        raise ValueError(f"method {spec!r}: kNvM bits are for one method on both sides; with '+' give each side "
                         "its own bits (qjl+affine:4)")
    if MLX_AFFINE in (k_name, v_name):
        raise ValueError(f"method {spec!r}: {MLX_AFFINE} is mlx-lm's cache for keys and values together; it cannot "
                         "be combined with '+'")
    clash = {k for k in k_cache.keys() & v_cache.keys() if k_cache[k] != v_cache[k]}
    if clash:
        raise ValueError(f"method {spec!r}: the two sides set {', '.join(sorted(clash))} differently")
    return MethodSpec(spec, k_name, v_name, kp, vp, {**k_cache, **v_cache})
