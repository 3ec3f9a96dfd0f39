"""Convert a llama-, qwen2- or gemma3-architecture GGUF file into an mlx-lm model folder.

The folder holds `config.json`, `model.safetensors` (dequantized weights), `tokenizer.json` and
`tokenizer_config.json`. Tensors are dequantized with the `gguf` library's own numpy dequantizer (MLX's GGUF loader
decodes some formats, Q4_1 among them, wrongly), and what llama.cpp's converter (convert_hf_to_gguf.py) changed is
undone, so the weights are laid out as in the Hugging Face checkpoint: the row permutation of llama's Q and K
projections, and the 1 that it adds to every Gemma RMSNorm weight.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import mlx.core as mx
import numpy as np
from tqdm import tqdm

from . import CONVERSION_VERSION, ModelError
from .tokenizer import write_tokenizer

#: GGUF architectures converted, each to the mlx-lm model type of the same name (same parameter names; llama.cpp
#: permutes llama's Q/K rows for its interleaved rotary embedding, not qwen2's, which has biases on Q, K and V),
#: except gemma3, whose text-only model is mlx-lm's gemma3_text
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
MODEL_TYPES = {"gemma3": "gemma3_text"}

# GGUF tensor names -> mlx-lm llama parameter names
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma 3 normalises each sublayer's input and output, and Q and K per head (llama.cpp's gguf tensor_mapping.py)
GEMMA3_LAYER_TENSORS = LAYER_TENSORS | {
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
#: Gemma 3's RoPE base on its sliding-window layers: llama.cpp does not write it into the GGUF (it sets 10000 for
#: gemma3 in llama-model.cpp), and the Hugging Face configs give rope_local_base_freq 10000 for every size
GEMMA3_LOCAL_ROPE_BASE = 10000.0
#: One global layer after five sliding-window ones (llama.cpp's set_swa_pattern(6) for gemma3; Hugging Face's
#: sliding_window_pattern 6)
GEMMA3_SLIDING_WINDOW_PATTERN = 6


def _field_value(field: gguf.ReaderField) -> Any:
    """A reader field as a plain Python value (str, number, bool or list of them)."""
    main_type, last_type = field.types[0], field.types[-1]

    def item(index: int) -> Any:
        part = field.parts[index]
        return bytes(part).decode("utf-8") if last_type == gguf.GGUFValueType.STRING else part[0].item()

    if main_type == gguf.GGUFValueType.ARRAY:
        return [item(index) for index in field.data]
    return item(field.data[0])


def open_gguf(path: Path) -> tuple[gguf.GGUFReader, dict[str, Any]]:
    """Open a GGUF file and read its metadata.

    Args:
        path: the `.gguf` file.

    Returns:
        (reader, metadata): the `gguf.GGUFReader` (tensors memory-mapped) and its key/value metadata as plain values.

    Raises:
        ModelError: the file cannot be read, is not GGUF, or is truncated or corrupt.
    """
    try:
        reader = gguf.GGUFReader(path)
        metadata = {key: _field_value(field) for key, field in reader.fields.items()}
        for tensor in reader.tensors:
            # a truncated file memory-maps short tensors; the reader does not always notice
            if tensor.data.nbytes != tensor.n_bytes:
                raise ValueError(f"tensor {tensor.name} has {tensor.data.nbytes} of {tensor.n_bytes} bytes")
    except Exception as error:  # the reader raises ValueError, IndexError, OSError, struct errors...
        raise ModelError(f"cannot read GGUF file {path.name}: corrupt or truncated ({error})") from error
    return reader, metadata


def model_config(metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """The mlx-lm `config.json` for a llama-, qwen2- or gemma3-architecture GGUF.

    Args:
        metadata: GGUF metadata as plain values.
        tensor_names: names of the GGUF's tensors (to detect tied embeddings and attention biases).

    Returns:
        A JSON-serialisable config with `rope_theta` at the top level (mlx-lm silently uses 10000 without it).

    Raises:
        ModelError: the architecture is not supported, or it uses features this converter does not handle.
    """
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ModelError(f"unsupported GGUF architecture {architecture!r} (supported: {supported})")

    def key(name: str) -> str:
        return f"{architecture}.{name}"

    hidden_size = metadata[key("embedding_length")]
    num_heads = metadata[key("attention.head_count")]
    head_dim = metadata.get(key("attention.key_length"), hidden_size // num_heads)
    if metadata.get(key("rope.dimension_count"), head_dim) != head_dim:
        raise ModelError("unsupported GGUF: rotary embedding covers only part of each head")
    if metadata.get(key("rope.scaling.type"), "none") != "none" or "rope_freqs.weight" in tensor_names:
        raise ModelError("unsupported GGUF: rotary embedding scaling is not converted")
    config = {
        "model_type": MODEL_TYPES.get(architecture, architecture),
        "hidden_size": hidden_size,
        "num_hidden_layers": metadata[key("block_count")],
        "intermediate_size": metadata[key("feed_forward_length")],
        "num_attention_heads": num_heads,
        "num_key_value_heads": metadata.get(key("attention.head_count_kv"), num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": metadata[key("attention.layer_norm_rms_epsilon")],
        "vocab_size": metadata.get(key("vocab_size"), len(metadata["tokenizer.ggml.tokens"])),
        "max_position_embeddings": metadata[key("context_length")],
        "rope_theta": metadata.get(key("rope.freq_base"), 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": metadata.get("tokenizer.ggml.eos_token_id"),
        "kvq_conversion": {"source": metadata.get("general.name", ""), "version": CONVERSION_VERSION},
    }
    if architecture == "gemma3":
        config |= _gemma3_config(metadata, config)
    return {name: value for name, value in config.items() if value is not None}


def _gemma3_config(metadata: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm gemma3_text's extra settings: sliding window and its layer pattern, local RoPE base, query scale.

    Raises:
        ModelError: the GGUF's sliding-window layers do not follow a pattern of one global layer every n.
    """
    pattern = metadata.get("gemma3.attention.sliding_window_pattern", GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):  # one flag per layer, True for a sliding-window layer
        period = pattern.index(False) + 1 if False in pattern else len(pattern) + 1
        if pattern != [(i + 1) % period != 0 for i in range(len(pattern))]:
            raise ModelError("unsupported GGUF: sliding-window layers are not one global layer every n")
        pattern = period
    # llama.cpp scales queries by 1/sqrt(head_dim), except Gemma 3 27B (62 layers): 1/sqrt(hidden / heads)
    scalar = config["head_dim"]
    if config["num_hidden_layers"] == 62:
        scalar = config["hidden_size"] // config["num_attention_heads"]
    return {
        "sliding_window": metadata["gemma3.attention.sliding_window"],
        "sliding_window_pattern": pattern,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar,
        "attention_bias": None,
    }


def mlx_name(gguf_name: str, model_type: str = "llama") -> str:
    """The mlx-lm parameter name of a GGUF tensor name.

    Example: blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight; for gemma3_text,
    blk.3.ffn_norm.weight -> model.layers.3.pre_feedforward_layernorm.weight.

    Raises:
        ModelError: the tensor name is not part of a model of this type.
    """
    layer_tensors = GEMMA3_LAYER_TENSORS if model_type == "gemma3_text" else LAYER_TENSORS
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    if base in MODEL_TENSORS:
        return f"{MODEL_TENSORS[base]}.{suffix}"
    raise ModelError(f"unexpected tensor {gguf_name!r} in a {model_type} GGUF")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`).

    llama.cpp stores each head's rows as (head_dim/2, 2) pairs for its interleaved rotary embedding; Hugging Face and
    mlx-lm use the (2, head_dim/2) half-split layout.

    Args:
        weight: [num_heads * head_dim, in_features] weight (or [num_heads * head_dim] bias).
        num_heads: attention heads for Q, key/value heads for K.

    Returns:
        The weight with rows in Hugging Face order, same shape.
    """
    rows = weight.shape[0]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, -1)
    return split.swapaxes(1, 2).reshape(weight.shape)


def tensor_array(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Dequantize one GGUF tensor to float32 in numpy order ([out_features, in_features] for a weight).

    GGUF lists dimensions fastest-first, so numpy's shape is the reverse of `tensor.shape`.
    """
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as error:
        raise ModelError(f"cannot dequantize {tensor.name}: {tensor.tensor_type.name} is not supported") from error
    return values.reshape(tuple(reversed(tensor.shape.tolist())))


def convert_tensors(reader: gguf.GGUFReader, config: dict[str, Any], dtype: mx.Dtype,
                    progress: bool) -> dict[str, mx.array]:
    """Dequantize, undo llama.cpp's changes (llama's Q/K row permutation, Gemma's norm weights + 1) and rename every
    tensor of a GGUF.

    Returns:
        mlx-lm parameter name -> array of `dtype`.
    """
    model_type = config["model_type"]
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    if model_type != "llama":
        heads = {}  # llama.cpp permutes only llama's Q/K rows (gemma3 uses NeoX RoPE, the Hugging Face layout)
    # Gemma's RMSNorm scales by (1 + weight); llama.cpp's plain RMSNorm scales by weight, so its converter stores
    # weight + 1 for every norm (q/k norms included), and mlx-lm's gemma3_text adds the 1 itself
    norm_shift = 1.0 if model_type == "gemma3_text" else 0.0
    weights = {}
    for tensor in tqdm(reader.tensors, desc="converting GGUF tensors", unit="tensor", disable=not progress):
        values = tensor_array(tensor)
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in heads:
            values = unpermute_rows(values, heads[kind])
        if norm_shift and tensor.name.endswith("norm.weight"):
            values = values - norm_shift
        weights[mlx_name(tensor.name, model_type)] = mx.array(values).astype(dtype)
    return weights


def _check_parameters(config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Fail early, naming the tensor, if the weights do not fit mlx-lm's model of the config's type."""
    import importlib

    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    weights = model.sanitize(dict(weights))  # as mlx_lm.load does: gemma3_text drops lm_head when tied here
    expected = {name: value.shape for name, value in tree_flatten(model.parameters())}
    mismatched = sorted(expected.keys() ^ weights.keys())
    if mismatched:
        name = mismatched[0]
        raise ModelError(f"GGUF does not fit mlx-lm's {config['model_type']}: "
                         f"{'missing' if name in expected else 'extra'} {name}")
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise ModelError(f"GGUF tensor {name} has shape {weights[name].shape}, expected {shape}")


def convert_gguf(gguf_path: Path, out_dir: Path, *, dtype: mx.Dtype = mx.float32, progress: bool = True) -> Path:
    """Convert a llama-, qwen2- or gemma3-architecture GGUF file into an mlx-lm model folder.

    Args:
        gguf_path: the `.gguf` file.
        out_dir: an existing folder to write into (config.json, model.safetensors, tokenizer files).
        dtype: dtype of the saved weights. float32 (the default) keeps the dequantized values exactly and is
            the fast dtype for MLX on CPU; float16 halves the file.
        progress: show a progress bar while converting tensors.

    Returns:
        `out_dir`.

    Raises:
        ModelError: the file is unreadable, truncated or corrupt, not a llama model, or uses an unsupported tensor
            type or tokenizer.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader, metadata = open_gguf(gguf_path)
    try:
        config = model_config(metadata, {tensor.name for tensor in reader.tensors})
        write_tokenizer(metadata, out_dir)
        weights = convert_tensors(reader, config, dtype, progress)
        _check_parameters(config, weights)
    except KeyError as error:
        raise ModelError(f"{gguf_path.name}: GGUF metadata lacks {error.args[0]!r}") from error
    except ModelError as error:
        raise ModelError(f"{gguf_path.name}: {error}") from error
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(out_dir / "config.json", "w", encoding="utf-8") as file:
        json.dump(config, file, indent=2)
    return out_dir
