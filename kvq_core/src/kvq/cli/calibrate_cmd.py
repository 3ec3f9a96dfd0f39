"""``kvq calibrate``: compute a method's calibration (codebooks, smoothing factors) from a model's real keys/values.

Today that is VecInfer's (kvq-backends-vecinfer): for the model named by --model (the default model, a folder, a
GGUF file or a Hub id), one file per setting under the user data dir (~/.local/share/kvq/calibration/MODEL_ID/ on
Linux; $KVQ_DATA_DIR moves it), replacing an earlier file of the same settings. kvq generate, eval and serve then
use it for that model (--method vecinfer; eval and bench take [model_id=...] to name another). The work is done by
the plugin that declares the method (a calibration module its kvq.Method names, imported only when this command
runs); this command reads the options every calibration shares and adds the method's own.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from ..declaration import Method
from ..plugins import registry

#: ``dest`` of the options every calibration shares; the others are the method's own (passed on by name).
COMMON = ("method", "model", "model_id", "text", "tokens", "seq_len", "seed", "quiet")


def calibrated_methods() -> dict[str, Method]:
    """Installed methods that declare a calibration (``Method.calibrate``), by name."""
    return {name: m for name, m in sorted(registry().methods.items()) if m.calibrate}


def calibration(method: Method):
    """The calibration module (or object) ``method`` declares, imported now.

    :raises ValueError: it does not import (the message names it and the plugin that declared it).
    """
    module, _, attribute = method.calibrate.partition(":")
    try:
        found = importlib.import_module(module)
        return getattr(found, attribute) if attribute else found
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"calibrating {method.name!r}: {method.calibrate} (declared by "
                         f"{registry().origin.get(method.name, 'its plugin')}) does not import: {exc}") from None


def _method_name(argv: list[str]) -> str | None:
    """``--method`` of ``argv`` (before the method's own options are known), or ``None``."""
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--method")
    return first.parse_known_args(argv)[0].method


def parser(method: str | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``kvq calibrate`` with ``method``'s own options (default: the only installed method
    that declares a calibration; with several, ``--method`` is required)."""
    methods = calibrated_methods()
    default = next(iter(methods)) if len(methods) == 1 else None
    p = argparse.ArgumentParser(prog="kvq calibrate", description=__doc__)
    p.add_argument("--method", choices=sorted(methods), default=default, required=default is None,
                   help=f"the method to calibrate (default: {default})" if default else "the method to calibrate")
    p.add_argument("--model", default=None, help="model name, folder, .gguf file or Hub id (default: "
                   "SmolLM2-135M-Instruct)")
    p.add_argument("--model-id", default=None, help="store under this id (default: derived from --model)")
    p.add_argument("--text", type=Path, default=None, help="UTF-8 text file to calibrate on (default: the first "
                   "half of the Python language reference)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the text to use (default 4096)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per forward pass (default 512)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the calibration (default 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    chosen = methods.get(method or default)
    add_arguments = getattr(calibration(chosen), "add_arguments", None) if chosen else None
    if add_arguments is not None:
        add_arguments(p.add_argument_group(f"{chosen.name} options"))
    return p


def main(argv: list[str]) -> int:
    """Run ``kvq calibrate`` with ``argv``; prints the files written. Returns 0.

    :raises ValueError: no installed method declares a calibration, bad settings, an unreadable ``--text``, a
        model that cannot be loaded, a calibration module that does not import.
    """
    if not calibrated_methods():
        from ..install_hints import method_hint

        raise ValueError(f"no installed method declares a calibration: {method_hint('vecinfer')} (a third-party "
                         "plugin declares one with kvq.Method(..., calibrate='package.module'))")
    args = parser(_method_name(argv)).parse_args(argv)
    run = calibration(calibrated_methods()[args.method]).run
    text = None
    if args.text is not None:
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--text {args.text}: cannot read it as UTF-8 text ({exc})") from None
    options = {name: value for name, value in vars(args).items() if name not in COMMON}
    paths = run(args.model, text=text, text_name=None if text is None else str(args.text), tokens=args.tokens,
                seq_len=args.seq_len, seed=args.seed, model_id=args.model_id, progress=not args.quiet, **options)
    for path in paths:
        print(path)
    return 0
