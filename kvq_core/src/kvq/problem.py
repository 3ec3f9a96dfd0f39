"""What selection is asked about: one op of one method on one shape, dtype and device (its kind and name)."""

from __future__ import annotations

from typing import Any

import attrs
import mlx.core as mx

from .hookspecs import OPS


def _check_shape(instance, attribute, value):
    if len(value) != 4 or any((not isinstance(v, int)) or v < 0 for v in value):
        raise ValueError(f"shape must be four non-negative ints (B, H, T, D), got {value!r}")
    if value[3] < 1:
        raise ValueError(f"shape: head_dim (D, the last entry) must be >= 1, got {value[3]}")


def _check_op(instance, attribute, value):
    if value not in OPS:
        raise ValueError(f"op must be one of {', '.join(OPS)}; got {value!r}")


def device_kind(device: mx.Device | str | None = None) -> str:
    """The kvq device kind for an MLX device: ``"cpu"``, ``"metal"`` or ``"cuda"``.

    :param device: an ``mx.Device``, one of those strings, ``"gpu"``, or ``None`` (MLX's default device).
    :raises ValueError: for any other string, or ``"gpu"`` on a machine without a GPU back end.
    """
    if device is None:
        device = mx.default_device()
    if isinstance(device, str):
        if device in ("cpu", "metal", "cuda"):
            return device
        if device != "gpu":
            raise ValueError(f"device must be one of cpu, gpu, metal, cuda; got {device!r}")
        if mx.metal.is_available():
            return "metal"
        if getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            return "cuda"
        raise ValueError("device 'gpu': this machine has no Metal or CUDA device for MLX; name the one to plan "
                         "for ('metal' or 'cuda') or use 'cpu'")
    if device.type == mx.DeviceType.cpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "cuda"


def device_name(device: Any = None) -> str:
    """The name of an MLX device (``mx.device_info()["device_name"]`` where MLX has it, e.g. ``"NVIDIA H200"``),
    else ``str(device)``. :param device: ``mx.Device``, ``"cpu"``/``"gpu"``/``"metal"``/``"cuda"`` or ``None``."""
    kind = device_kind(device)
    target = mx.cpu if kind == "cpu" else mx.gpu
    info = getattr(mx, "device_info", None)
    try:
        name = info(target).get("device_name") if info else None
    except Exception:  # noqa: BLE001 - older MLX, or a back end without the query
        name = None
    return str(name) if name else str(mx.Device(target))


@attrs.frozen
class Problem:
    """One op on one shape: what ``supports`` and ``cost`` of an implementation are asked about.

    :param method: method name (``"affine"``, ``"turboquant"``, ...).
    :param op: one of ``quantize``, ``dequantize``, ``attend``, ``pack``.
    :param shape: ``(B, H_kv, T, D)`` of the keys/values (for ``attend``, ``T`` is the context length).
    :param dtype: dtype of the uncompressed data.
    :param device: ``"cpu"``, ``"metal"`` or ``"cuda"``.
    :param params: the method's parameter object, or ``None`` when selection is asked without one.
    :param num_queries: ``T_q`` for ``attend`` (1 in decode).
    :param num_q_heads: ``H_q`` for ``attend`` (``H_kv`` when not given).
    """

    method: str
    op: str = attrs.field(validator=_check_op)
    shape: tuple[int, int, int, int] = attrs.field(converter=tuple, validator=_check_shape)
    dtype: Any = mx.float16
    device: str = "cpu"
    params: Any = None
    num_queries: int = 1
    num_q_heads: int | None = None

    @property
    def num_elements(self) -> int:
        """``B * H * T * D``."""
        B, H, T, D = self.shape
        return B * H * T * D

    @property
    def head_dim(self) -> int:
        return self.shape[3]
