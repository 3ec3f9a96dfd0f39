"""``kvq calibrate``: compute a method's calibration (codebooks, smoothing factors) from a model's real keys/values.

Today one method needs calibration, ``vecinfer`` (plugin ``kvq-backends-vecinfer``); the work is done by that
plugin, which is imported here only when this command runs.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

PLUGINS = {"vecinfer": ("kvq_backends_vecinfer.calibrate", "kvq-backends-vecinfer")}


def _plugin(method: str):
    module, distribution = PLUGINS[method]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ValueError(f"calibrating {method!r} needs the {distribution} package ({exc}); "
                         f"install it: pip install {distribution}") from None


def parser() -> argparse.ArgumentParser:
    """The argument parser of ``kvq calibrate``."""
    p = argparse.ArgumentParser(prog="kvq calibrate", description=__doc__)
    p.add_argument("--method", choices=sorted(PLUGINS), default="vecinfer")
    p.add_argument("--model", default=None, help="model name, folder, .gguf file or Hub id (default: "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--model-id", default=None, help="store under this id (default: derived from --model)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file to calibrate on (default: the first "
                   "half of the Python language reference)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text to use (default 4096)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per forward pass (default 512)")
    p.add_argument("--sub-dim", type=int, nargs="+", default=[4, 8], help="sub-vector sizes (default 4 8)")
    p.add_argument("--code-bits", type=int, nargs="+", default=[8], help="bits per code (default 8)")
    p.add_argument("--role", choices=("keys", "values"), nargs="+", default=["keys", "values"])
    p.add_argument("--per-head", action="store_true", help="one codebook per KV head (default: one per layer)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smooth-alpha", type=float, default=0.5, help="key smoothing factor max|K|**alpha (0.5)")
    p.add_argument("--iterations", type=int, default=20, help="k-means iterations at most (default 20)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def main(argv: list[str]) -> int:
    """Run ``kvq calibrate`` with ``argv``; prints the files written. Returns 0.

    :raises ValueError: bad settings, an unreadable ``--text``, a model that cannot be loaded, the plugin missing.
    """
    args = parser().parse_args(argv)
    plugin = _plugin(args.method)
    text = None
    if args.text is not None:
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--text {args.text}: cannot read it as UTF-8 text ({exc})") from None
    paths = plugin.run(args.model, text=text, text_name=None if text is None else str(args.text),
                       tokens=args.tokens, seq_len=args.seq_len, sub_dims=tuple(args.sub_dim),
                       code_bits=tuple(args.code_bits), roles=tuple(args.role), per_head=args.per_head,
                       seed=args.seed, smooth_alpha=args.smooth_alpha, iterations=args.iterations,
                       model_id=args.model_id, progress=not args.quiet)
    for path in paths:
        print(path)
    return 0
