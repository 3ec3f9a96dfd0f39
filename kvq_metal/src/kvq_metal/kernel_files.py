"""Kernel files: kvq's kernel text lives in files, one kernel per file, read by :func:`load`.

A kernel file holds the body of one kernel function: MLX writes the function's signature itself, from the names
and dtypes of the inputs and outputs and the template arguments (``mx.fast.metal_kernel``, ``mx.fast.cuda_kernel``;
``tests/test_metal_syntax.py`` writes it as MLX does and parses the result). File types:

==========  =====================================================================================================
``.kvq``    a kernel, or a fragment of one, in kvq's dialect (:mod:`kvq_metal.dialect`): built for Metal and CUDA
``.cu``     a CUDA-only kernel (it may use the dialect's tokens: it is translated for CUDA)
``.cuh``    the header a ``.cu`` kernel is built with (device functions and macros, placed before its signature)
==========  =====================================================================================================

:func:`load` applies two rules before the dialect is translated:

* Preamble: a file's leading ``//`` lines document it: what it computes, how threads map to data, its template
  arguments, ``// Reference: <dotted name>`` (the pure-MLX function it must agree with) and ``// Launcher: <dotted
  name>`` (the Python function that launches it); a fragment or header names instead the kernel files that use it
  (``// Used by: decode_attend.kvq, decode_attend_tc.cu``). They are dropped from the text, so documentation
  edits rename no kernel (MLX caches compiled kernels by name, and :func:`kvq_metal.dialect.kernel` names them by
  a hash of their text).
* Includes: a line ``#include "name"`` is replaced by the text of the file ``name`` (its preamble dropped, its own
  includes expanded), found beside the including file or else among kvq_metal's shared fragments
  (:data:`KERNELS`: ``split_index.kvq``, ``load_queries.kvq``, ``hadamard_rows.kvq``, ``warp_hadamard.kvq``).
  MLX compiles a kernel from one string, without an include path, so includes are expanded here.

Every loaded kernel is registered by name (:data:`LOADED`, :data:`TEMPLATES`): :func:`sources_hash` hashes them
all, kvq_metal's own and those its plugins load, and ``tests/test_metal_syntax.py`` parses every one
built for Metal.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Sequence

import attrs

from .dialect import BACKENDS, PRELUDES, Kernel, kernel

#: kvq_metal's kernel files and shared fragments.
KERNELS = Path(__file__).parent / "kernels"

_INCLUDE = re.compile(r'^[ \t]*#include "([^"]+)"[ \t]*\n?', re.MULTILINE)
_KEY = re.compile(r"^//\s*(Reference|Launcher):\s*(\S+)")


@attrs.frozen
class KernelSource:
    """A kernel read from its file (:func:`load`).

    :param name: the file's stem (kernel names are built from it: ``kvq_<name>_<hash>``).
    :param source: the kernel body and ``header`` the text placed before its signature (includes expanded,
        dialect tokens not yet translated).
    :param backends: the back ends it is built for (``.cu``: CUDA only).
    :param reference: the dotted name of its pure-MLX reference; ``launcher`` of the function that launches it.
    """

    name: str
    source: str
    header: str
    backends: tuple[str, ...]
    reference: str
    launcher: str
    path: str

    def kernel(self, backend: str, input_names: tuple[str, ...], output_names: tuple[str, ...],
               ensure_row_contiguous: bool = True) -> Kernel:
        """The :class:`~kvq_metal.dialect.Kernel` for ``backend``, built once per process.

        :raises ValueError: ``backend`` is not one this kernel is built for.
        """
        if backend not in self.backends:
            raise ValueError(f"kernel {self.name} is built for {', '.join(self.backends)}; got {backend!r}")
        return kernel(self.name, backend, input_names, output_names, self.source, self.header,
                      ensure_row_contiguous)


#: Every kernel loaded in this process, by name.
LOADED: dict[str, KernelSource] = {}
#: Template text by kernel name (header + body, untranslated), for :func:`sources_hash`.
TEMPLATES: dict[str, str] = {}
#: Back ends a template is built for, where not both (a ``.cu`` kernel: CUDA only).
TEMPLATE_BACKENDS: dict[str, tuple[str, ...]] = {}


def _split_preamble(text: str) -> tuple[list[str], str]:
    """The leading ``//`` lines of ``text`` and the rest."""
    lines = text.splitlines(keepends=True)
    n = 0
    while n < len(lines) and lines[n].startswith("//"):
        n += 1
    return lines[:n], "".join(lines[n:])


def _expand(path: Path, stack: Sequence[Path] = ()) -> tuple[list[str], str]:
    """The preamble of ``path`` and its text with every ``#include`` expanded (see the module docstring).

    :raises FileNotFoundError: an included file found neither beside ``path`` nor in :data:`KERNELS`.
    :raises ValueError: a file that includes itself, directly or not.
    """
    if path in stack:
        raise ValueError(f"kernel file {path} includes itself: {' -> '.join(p.name for p in (*stack, path))}")
    preamble, text = _split_preamble(path.read_text())

    def include(match: re.Match) -> str:
        name = match.group(1)
        found = next((d / name for d in (path.parent, KERNELS) if (d / name).is_file()), None)
        if found is None:
            raise FileNotFoundError(f"{path.name}: included file {name!r} is neither beside it nor in {KERNELS}")
        body = _expand(found, (*stack, path))[1]
        return body if body.endswith("\n") else body + "\n"

    return preamble, _INCLUDE.sub(include, text)


def read(path: str | Path, header: str | Path | None = None) -> KernelSource:
    """The kernel in file ``path``, built with ``header`` (a file, or none), as :func:`load` reads it, without
    registering it. :raises FileNotFoundError, ValueError: as :func:`_expand`."""
    path = Path(path)
    preamble, source = _expand(path)
    head = _expand(Path(header))[1] if header is not None else ""
    keys = dict(m.groups() for m in map(_KEY.match, preamble) if m)
    backends = ("cuda",) if path.suffix == ".cu" else BACKENDS
    return KernelSource(path.stem, source, head, backends, keys.get("Reference", ""), keys.get("Launcher", ""),
                        str(path))


def load(path: str | Path, header: str | Path | None = None) -> KernelSource:
    """:func:`read` the kernel in file ``path`` and register it by name (:data:`LOADED`, :data:`TEMPLATES`).

    :raises ValueError: another kernel of the same name, with other text, is registered already; or as :func:`read`.
    :raises FileNotFoundError: as :func:`read`.
    """
    found = read(path, header)
    known = LOADED.get(found.name)
    if known is not None and (known.source, known.header) != (found.source, found.header):
        raise ValueError(f"two kernels named {found.name}: {known.path} and {found.path}")
    LOADED[found.name] = found
    TEMPLATES[found.name] = found.header + found.source
    if found.backends != BACKENDS:
        TEMPLATE_BACKENDS[found.name] = found.backends
    return found


def templates() -> dict[str, KernelSource]:
    """Every kernel loaded once kvq's plugins have registered (a method's plugin loads its kernels then)."""
    from kvq.plugins import registry

    registry()
    return dict(LOADED)


def sources_hash(sources: Sequence[str] = ()) -> str:
    """SHA-256 (first 16 hex digits) of the kernel sources and both preludes: benchmark results record it, so
    results can be matched to the kernels that produced them. By default it hashes every kernel template loaded
    once kvq's plugins have registered (:func:`templates`: kvq_metal's own and the methods' plugins'), whether
    built in this process or not."""
    if not sources:
        templates()
        sources = [TEMPLATES[k] for k in sorted(TEMPLATES)]
    h = hashlib.sha256()
    for text in (*PRELUDES.values(), *sources):
        h.update(text.encode())
    return h.hexdigest()[:16]
