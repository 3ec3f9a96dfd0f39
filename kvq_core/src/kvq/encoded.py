"""The stored form of a block of tokens: packed codes plus side data, as MLX arrays."""

from __future__ import annotations

from typing import Any, Mapping

import attrs
import mlx.core as mx


@attrs.frozen
class Encoded:
    """Compressed keys or values of ``T`` tokens, as produced by a method's ``quantize``.

    Every array in ``data`` has shape ``[B, H_kv, T, ...]`` (token axis 2), so the cache slices,
    preallocates and concatenates encodings without knowing the method.

    :param params: the method's frozen parameter object; ``params.method`` names the method.
    :param data: field name -> ``mx.array`` (e.g. ``codes`` uint32, ``scales`` float16, ``norms`` float32).
    :param head_dim: ``D`` of the original vectors (codes may be padded; this is the logical size).
    """

    params: Any
    data: Mapping[str, mx.array]
    head_dim: int

    @property
    def method(self) -> str:
        """Name of the method that encoded this block."""
        return self.params.method

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Logical ``(B, H_kv, T, D)`` of the encoded vectors."""
        B, H, T = next(iter(self.data.values())).shape[:3]
        return (B, H, T, self.head_dim)

    @property
    def num_tokens(self) -> int:
        """``T``, the number of encoded tokens."""
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays of this encoding (codes and side data)."""
        return sum(a.nbytes for a in self.data.values())

    def tokens(self, start: int, stop: int) -> "Encoded":
        """The encoding of tokens ``start:stop`` (a slice along axis 2 of every field)."""
        return attrs.evolve(self, data={k: v[:, :, start:stop] for k, v in self.data.items()})

    def map(self, fn) -> "Encoded":
        """A new Encoded whose every field is ``fn(array)``; ``fn`` must keep axis 2 the token axis."""
        return attrs.evolve(self, data={k: fn(v) for k, v in self.data.items()})
