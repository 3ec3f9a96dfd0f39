"""``kvq fit``: how long a context, and how many sequences, fit in a given memory with each cache, predicted from
the model's shape and each method's bits accounting, without loading the model or allocating a cache.

The prediction, in bytes, for ``batch`` sequences of ``tokens`` tokens each:

    weights + fixed + batch * (resident(tokens) + transient(tokens))

- ``weights``: the model's weight files (safetensors sizes), or for ``random:PRESET`` models its parameter count
  times the dtype's size.
- ``fixed``: constants every cache shares (codebooks, rotations: ``BitsAccounting.shared_bytes`` per layer and
  side) plus :data:`FIXED_OVERHEAD`.
- ``resident``: what one sequence's caches hold (``nbytes``), layer by layer: mlx-lm's ``KVCache`` holds its tokens
  in the model's dtype in steps of 256 tokens; a kvq cache holds its sinks and its window buffer (``window + flush -
  1`` tokens) in 16 bits and its compressed tokens (those that left the window in blocks of ``flush``) at the
  method's bits per token (:meth:`kvq.BitsAccounting.bytes_for`), in steps of the store's ``step`` tokens.
  Sliding-window layers (``layer_types`` or ``sliding_window_pattern`` in the model's config) hold at most
  ``sliding_window`` tokens.
- ``transient``: what storing a chunk of ``chunk`` tokens in one layer adds on top for a moment: the chunk's keys
  and values as they arrive and the cache's copy of them (model dtype), the work of encoding them (kvq caches:
  :data:`ENCODE_WORK`), and the copy of that layer's buffer that growing it makes (mlx-lm's ``KVCache`` and kvq's
  store both grow by concatenation).

``safety`` is :class:`kvq.bench.capacity.CapacitySettings`' fraction: the caches may use that fraction of what is
left after the weights and the fixed term, so ``kvq fit`` answers what ``kvq bench capacity`` measures.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import attrs

from .e2e import DENSE_BITS
from .rows import REFERENCE

#: Bytes counted once whatever the caches hold, beyond the weights and the methods' shared constants: an allowance
#: for the decode step's batch-1 activations, RoPE frequencies and kernels' first-use check inputs (the H200
#: capacity runs measured 3 KiB above the weights before any cache existed: this is a margin, not a measurement).
FIXED_OVERHEAD = 2**20
#: Tokens per growth step of mlx-lm's ``KVCache`` (``KVCache.step``).
MLX_LM_STEP = 256
#: Work of encoding a chunk, bytes per coordinate of its keys and values (``CacheCost.work``), above the chunk and
#: its copy, per device and method (``None``: any other method): the CPU's pure-MLX encoders hold float32
#: intermediates (measured on a 2-core x86-64 CPU, head_dim 64, float32 model: 20-28 for TurboQuant, 8 for affine;
#: tests/test_fit.py), a GPU's fused encoders about a float32 copy (4; the H200 capacity runs' fill peaks were
#: 115 MB per sequence above the caches for turboquant:3, this predicts 93 MB).
ENCODE_WORK = {"cpu": {"affine": 8, None: 24}, "gpu": {None: 4}}
#: Tokens per cache update assumed for the transient term (``kvq bench``'s fill chunk).
DEFAULT_CHUNK = 4096
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}  # safetensors' dtype names


@attrs.frozen
class ModelShape:
    """What the prediction needs of a model.

    :param name: as given on the command line. :param layers: decoder layers with a KV cache.
    :param kv_heads: ``num_key_value_heads``. :param head_dim: ``D``.
    :param dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``: the keys' and values' dtype (mlx-lm's KVCache).
    :param weight_bytes: bytes of the weights in memory.
    :param max_context: ``max_position_embeddings`` (tokens), or ``None``.
    :param sliding: per layer, its sliding window in tokens, or ``None`` for a full-attention layer.
    """

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    weight_bytes: int
    max_context: int | None = None
    sliding: tuple[int | None, ...] = ()

    @property
    def dtype_bytes(self) -> int:
        """Bytes per coordinate of the model's keys and values."""
        return _DTYPE_BYTES[self.dtype]

    def layer_tokens(self, tokens: int) -> list[int]:
        """Tokens each layer holds when a sequence holds ``tokens`` (a sliding layer at most its window)."""
        windows = self.sliding or (None,) * self.layers
        return [tokens if w is None else min(tokens, w) for w in windows]


def llama_parameters(config: dict) -> int:
    """Parameters of a llama-family model from its config (embedding, attention, MLP, norms, untied head)."""
    hidden, vocab, inter = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    q_heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // q_heads
    attention = 2 * hidden * q_heads * head_dim + 2 * hidden * kv_heads * head_dim
    layer = attention + 3 * hidden * inter + 2 * hidden
    head = 0 if config.get("tie_word_embeddings", True) else vocab * hidden
    return vocab * hidden + config["num_hidden_layers"] * layer + hidden + head


def safetensors_info(folder: Path) -> tuple[int, str | None]:
    """``(bytes, dtype)`` of a model folder's ``*.safetensors`` files: their sizes summed (headers included, a few
    KiB) and the dtype the keys are computed in: the first key projection's weight, or its scales for a quantized
    model (``None`` if neither is found)."""
    total, dtype = 0, None
    for path in sorted(Path(folder).glob("*.safetensors")):
        total += path.stat().st_size
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if dtype is None and name.endswith(("k_proj.weight", "k_proj.scales")) and entry["dtype"] in _NAMES:
                dtype = _NAMES[entry["dtype"]]
    return total, dtype


def _sliding(config: dict) -> tuple[int | None, ...]:
    """Per layer, its sliding window (``config["sliding_window"]`` tokens) or ``None`` (full attention), from the
    config's ``layer_types`` (Hugging Face's list) or else its ``sliding_window_pattern`` ``p`` (gemma-3's and
    cohere2's configs, kvq's GGUF conversion of gemma-3: every ``p``-th layer full, the rest sliding, as mlx-lm's
    ``gemma3_text`` and ``cohere2`` build them); ``()`` where neither says (every layer full)."""
    types, window = config.get("layer_types"), config.get("sliding_window")
    pattern = config.get("sliding_window_pattern")
    if not window or not (types or pattern):
        return ()
    if types:
        return tuple(window if "sliding" in kind else None for kind in types)
    return tuple(None if (i + 1) % pattern == 0 else window for i in range(config["num_hidden_layers"]))


def model_shape(name: str, config: dict, path: Path | None, dtype: str | None) -> ModelShape:
    """The :class:`ModelShape` of a model from its config (``path``: its folder, ``None`` for ``random:PRESET``).

    :param dtype: the dtype it runs in (an unquantized model's weights are scaled to it); ``None``: as stored
        (random models: float32).
    :raises ValueError: a real model folder without safetensors files.
    """
    q_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // q_heads
    if path is None:
        dtype = dtype or "float32"
        weight_bytes = llama_parameters(config) * _DTYPE_BYTES[dtype]
    else:
        stored_bytes, stored = safetensors_info(path)
        if not stored_bytes:
            raise ValueError(f"--model {name}: no .safetensors files in {path} to read the weights' size from")
        stored = stored or "float32"
        dtype = dtype or stored
        # a quantized model's weights keep their width whatever dtype its activations run in
        scale = 1 if "quantization" in config else _DTYPE_BYTES[dtype] / _DTYPE_BYTES[stored]
        weight_bytes = int(stored_bytes * scale)
    return ModelShape(name, config["num_hidden_layers"], config.get("num_key_value_heads", q_heads), head_dim,
                      dtype, weight_bytes, config.get("max_position_embeddings"), _sliding(config))


@attrs.frozen
class CacheCost:
    """The bytes one cache kind costs per layer of one sequence (see the module's docstring).

    :param label: the method string (``kvcache`` is mlx-lm's KVCache). :param kind: ``"mlx-lm"`` or ``"kvq"``.
    :param bits_per_token: compressed bits per token and KV head, keys plus values (mlx-lm: the dtype's or
        QuantizedKVCache's). :param sinks, window, flush, step: kvq caches' layout (tokens; 0 for mlx-lm's).
    :param shared_bytes: constants per layer, both sides (bytes).
    :param work: bytes of encoding work per coordinate of a chunk's keys and values (:data:`ENCODE_WORK`).
    """

    label: str
    kind: str
    bits_per_token: float
    sinks: int = 0
    window: int = 0
    flush: int = 1
    step: int = MLX_LM_STEP
    shared_bytes: int = 0
    work: int = 0

    def coded_tokens(self, tokens: int) -> int:
        """Tokens a layer holding ``tokens`` keeps at ``bits_per_token``: every token for mlx-lm's caches; for kvq's,
        those that left the window in blocks of ``flush`` (the window holds ``window`` to ``window + flush - 1``)."""
        if self.kind != "kvq":
            return tokens
        from ..cache.schedule import leaving

        return leaving(max(0, tokens - self.sinks), 0, self.window, self.flush)

    def store_bytes(self, tokens: int, kv_heads: int) -> int:
        """Bytes of one layer's coded tokens at ``tokens`` tokens, allocated in steps of ``step`` tokens."""
        allocated = -(-self.coded_tokens(tokens) // self.step) * self.step
        return math.ceil(self.bits_per_token * kv_heads * allocated / 8)

    def resident(self, tokens: int, kv_heads: int, head_dim: int) -> int:
        """Bytes one layer's cache of one sequence holds at ``tokens`` tokens (``nbytes``): the coded tokens, and
        for kvq's caches the sinks' and the window's buffers (16 bits, allocated whole at their first token)."""
        if tokens <= 0:
            return 0
        dense = 0
        if self.kind == "kvq":
            from ..cache.schedule import most_held

            dense = self.sinks + (most_held(self.window, self.flush) if tokens > self.sinks else 0)
        return self.store_bytes(tokens, kv_heads) + 2 * kv_heads * dense * head_dim * DENSE_BITS // 8

    def transient(self, tokens: int, chunk: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
        """Bytes storing the last ``min(chunk, tokens)`` tokens adds for a moment in one layer of one sequence:
        the chunk as given and the cache's copy (model dtype), the encoding work (``work`` per coordinate), and
        the copy of the layer's coded tokens that growing their buffer makes."""
        n = min(chunk, tokens)
        chunk_bytes = 2 * kv_heads * n * head_dim * dtype_bytes
        work = 2 * kv_heads * n * head_dim * self.work
        return 2 * chunk_bytes + work + self.store_bytes(tokens, kv_heads)


def cache_cost(spec, shape: ModelShape, sinks: int, window: int, flush: int | None, device: str = "gpu") -> CacheCost:
    """The :class:`CacheCost` of a method spec (:func:`kvq.cache.method_string.parse_method`) on ``shape``, from the
    methods' bits accounting (``accounting(head_dim)``) and kvq's cache configuration (sinks, window, flush);
    ``device`` (``"cpu"`` or ``"gpu"``) chooses the encoding work (:data:`ENCODE_WORK`)."""
    D = shape.head_dim
    if spec.label == REFERENCE:
        return CacheCost(f"{REFERENCE} ({shape.dtype})", "mlx-lm", 2 * D * shape.dtype_bytes * 8)
    if spec.is_mlx:
        bits, group_size = spec.mlx_settings()
        return CacheCost(spec.label, "mlx-lm", 2 * D * (bits + 2 * shape.dtype_bytes * 8 / group_size))
    from ..cache import make_config

    config = make_config(**spec.cache_kwargs(sinks, window, flush)).within_budget(D, D)  # kvq.cache.budget
    key, value = config.key_params.accounting(D), config.value_params.accounting(D)
    work = ENCODE_WORK[device]
    work = max(work.get(p.method, work[None]) for p in (config.key_params, config.value_params))
    return CacheCost(spec.label, "kvq", key.bits_per_token + value.bits_per_token, config.sinks, config.window,
                     config.flush_tokens, config.step, key.shared_bytes + value.shared_bytes, work)


@attrs.frozen
class Budget:
    """Where the memory goes: ``memory`` bytes in all, of which the caches may use ``safety`` of what is left after
    ``shape``'s weights and the fixed term; ``chunk`` tokens per cache update (the transient term)."""

    shape: ModelShape
    memory: int
    safety: float = 1.0
    chunk: int = DEFAULT_CHUNK

    def fixed(self, cost: CacheCost) -> int:
        """Bytes held whatever the sequences: weights, the cache's shared constants, :data:`FIXED_OVERHEAD`."""
        return self.shape.weight_bytes + self.shape.layers * cost.shared_bytes + FIXED_OVERHEAD

    def per_sequence(self, cost: CacheCost, tokens: int) -> int:
        """Bytes one sequence of ``tokens`` tokens needs: every layer's resident bytes, plus the largest layer's
        transient."""
        s = self.shape
        layers = s.layer_tokens(tokens)
        resident = sum(cost.resident(t, s.kv_heads, s.head_dim) for t in layers)
        return resident + max(cost.transient(t, self.chunk, s.kv_heads, s.head_dim, s.dtype_bytes) for t in layers)

    def predicted(self, cost: CacheCost, tokens: int, batch: int = 1) -> int:
        """Bytes ``batch`` sequences of ``tokens`` tokens need in all (weights and fixed term included)."""
        return self.fixed(cost) + batch * self.per_sequence(cost, tokens)

    def room(self, cost: CacheCost) -> float:
        """Bytes the caches may use: ``safety`` times what the fixed term leaves (negative: nothing fits)."""
        return self.safety * (self.memory - self.fixed(cost))

    def sequences(self, cost: CacheCost, tokens: int) -> int:
        """The most sequences of ``tokens`` tokens that fit (0: not one)."""
        return max(0, int(self.room(cost) // self.per_sequence(cost, tokens)))

    def longest(self, cost: CacheCost, batch: int = 1, limit: int = 2**40) -> int:
        """The longest context (tokens) whose ``batch`` sequences fit (0: not one token; at most ``limit``)."""
        room = self.room(cost)
        if batch * self.per_sequence(cost, 1) > room:
            return 0
        low, high = 1, limit
        while low < high:  # bytes grow with tokens: the last length that fits
            mid = (low + high + 1) // 2
            low, high = (mid, high) if batch * self.per_sequence(cost, mid) <= room else (low, mid - 1)
        return low
