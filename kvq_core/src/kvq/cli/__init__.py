"""``kvq``: a short dispatcher; each subcommand lives in its own module with its own parser and ``main``."""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "list": ("kvq.cli.list_cmd", "plugins, methods, backends, and what runs on this machine"),
    "select": ("kvq.cli.select_cmd", "the implementation chosen per op for a shape, and why"),
    "eval": ("kvq.cli.eval_cmd", "perplexity, KL, attention error, needle retrieval and memory per method"),
    "generate": ("kvq.cli.generate_cmd", "generate with a real model and a compressed cache; speed, bytes, vs mlx-lm's KVCache"),
    "demo": ("kvq.cli.demo_cmd", "the main job, no arguments: questions about a document, kvq's recommended and ~3-bit caches against mlx-lm's KVCache"),
    "calibrate": ("kvq.cli.calibrate_cmd", "codebooks and smoothing factors from a model's keys/values (vecinfer)"),
    "bench": ("kvq.cli.bench_cmd", "benchmarks: e2e (decode), prefill, batch (BatchGenerator), capacity, ops (each op); JSON + PNG"),
    "fit": ("kvq.cli.fit_cmd", "the longest context and the most sequences that fit in memory per cache (predicted)"),
    "autotune": ("kvq.cli.autotune_cmd", "measure kernel vs pure-MLX crossovers on this device; selection uses them"),
    "serve": ("kvq.cli.serve_cmd", "mlx-lm's HTTP server with kvq caches (also under mlx.launch)"),
}


#: Commands that run a model (on a Linux CPU without an optimised BLAS they say how to get one first).
MODEL_COMMANDS = ("eval", "generate", "demo", "calibrate", "bench", "serve")


def _usage() -> str:
    lines = ["usage: kvq COMMAND [options]    (kvq --version: the installed kvq distributions)", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvq COMMAND --help' for a command's options."]
    return "\n".join(lines)


def version_text() -> str:
    """``kvq --version``: kvq's version, then each installed kvq distribution (``kvq-*`` and the packages that
    declare plugins in the ``kvq`` entry-point group) with its version, and MLX's version and default device."""
    import mlx.core as mx

    from .. import __version__
    from ..provenance import distributions

    lines = [f"kvq {__version__}"] + [f"  {name} {version}" for name, version in distributions().items()]
    lines.append(f"  mlx {mx.__version__} (default device: {mx.default_device()})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``kvq`` script. Returns the exit code (2 for usage errors, 1 for bad input)."""
    try:
        return _dispatch(sys.argv[1:] if argv is None else argv)
    except BrokenPipeError:  # the reader stopped early (kvq select --json | head): not an error of kvq's
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(version_text())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kvq: unknown command {name!r}; choose one of {', '.join(COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    from ..install_hints import arm_blas_note

    arm_blas_note(name in MODEL_COMMANDS)  # printed where model work starts: not before a usage error
    if name in MODEL_COMMANDS:  # mlx-lm code these commands run (its server, its loader) finds kvq's caches
        from ..cache import register_with_mlx_lm

        register_with_mlx_lm()
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return module.main(rest) or 0
    except (ValueError, TypeError) as exc:
        # kvq bench's benches are commands of their own to a user: "kvq bench e2e: error: ..."
        label = f"{name} {rest[0]}" if name == "bench" and rest and not rest[0].startswith("-") else name
        print(f"kvq {label}: error: {exc}", file=sys.stderr)
        return 1
