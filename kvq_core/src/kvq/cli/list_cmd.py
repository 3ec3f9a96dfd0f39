"""``kvq list``: installed plugins, methods and backends, and which implementations run on this machine."""

from __future__ import annotations

import argparse
import json
from importlib.metadata import entry_points

import mlx.core as mx

from ..problem import Problem, device_kind
from ..plugins import GROUP, implemented_ops, registry


def _runs_here(impl, method, device: str) -> bool:
    """Whether ``impl`` supports a small default problem on ``device`` (a probe, not a promise)."""
    if method is None:
        return impl.supports(Problem(impl.method, "pack", (1, 1, 32, 64), mx.float16, device))
    params = method.make_params()
    head_dim = next((d for d in (128, 64, 256, 96, 80) if _accepts(params, d)), 128)
    op = implemented_ops(impl)[0]
    return bool(impl.supports(Problem(impl.method, op, (1, 8, 1024, head_dim), mx.float16, device, params)))


def _accepts(params, head_dim: int) -> bool:
    try:
        params.check_head_dim(head_dim)
        return True
    except ValueError:
        return False


def collect() -> dict:
    """Everything ``kvq list`` shows, as a JSON-ready dict."""
    reg = registry()
    device = device_kind()
    plugins = []
    for ep in sorted(entry_points(group=GROUP), key=lambda e: e.name):
        dist = ep.dist.name if ep.dist else "?"
        plugins.append({"entry_point": ep.name, "distribution": dist, "module": ep.value,
                        "loaded": ep.name not in reg.not_loaded, "error": reg.failures.get(ep.name)})
    methods = {name: {"description": m.description, "source": m.source, "origin": reg.origin[name],
                      "default_params": repr(m.make_params()), "needs_calibration": m.needs_calibration}
               for name, m in sorted(reg.methods.items())}
    impls = []
    for (method, backend), impl in sorted(reg.implementations.items()):
        declared = reg.methods.get(method)
        installed = method == "*" or declared is not None
        impls.append({"method": method, "backend": backend, "ops": list(implemented_ops(impl)),
                      "origin": reg.origin[(method, backend)], "method_installed": installed,
                      "runs_here": installed and _runs_here(impl, declared, device)})
    return {"device": device, "mlx": mx.__version__, "plugins": plugins, "methods": methods,
            "implementations": impls}


def render(info: dict) -> str:
    """The human-readable form of :func:`collect`."""
    out = [f"device: {info['device']} (MLX {info['mlx']})", "", "plugins (entry points, group 'kvq'):"]
    for p in info["plugins"]:
        status = (f"FAILED: {p['error']}" if p["error"] else "ok" if p["loaded"]
                  else "not loaded (KVQ_LOAD_PLUGINS)")
        out.append(f"  {p['entry_point']:<12} {p['distribution']:<26} {p['module']:<26} {status}")
    out += ["", "methods:"]
    for name, m in info["methods"].items():
        out.append(f"  {name:<16} {m['description']}  [{m['origin']}]")
        out.append(f"  {'':<16} defaults: {m['default_params']}")
    out += ["", "implementations:"]
    for i in info["implementations"]:
        here = "runs here" if i["runs_here"] else ("method not installed" if not i["method_installed"]
                                                  else "not on this machine")
        out.append(f"  {i['method'] + ':' + i['backend']:<22} ops={','.join(i['ops']):<32} {here}")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvq list", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0
