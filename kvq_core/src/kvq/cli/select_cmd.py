"""``kvq select METHOD --shape B,H,T,D``: the implementation chosen per op, and the reasons."""

from __future__ import annotations

import argparse
import json

import attrs

import mlx.core as mx

from ..hookspecs import OPS
from ..plugins import registry
from ..selection import KERNELS, select

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"1,8,4096,128"`` (or ``"1x8x4096x128"``) -> ``(1, 8, 4096, 128)``. :raises ValueError: not four
    non-negative ints."""
    try:
        shape = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 0:
        raise ValueError(f"--shape must be four non-negative integers B,H,T,D (e.g. 1,8,4096,128); got {text!r}")
    return shape


def parse_param(text: str) -> tuple[str, object]:
    """``"bits=3"`` -> ``("bits", 3)`` (ints, floats, true/false, else the string)."""
    if "=" not in text:
        raise ValueError(f"--param must look like NAME=VALUE; got {text!r}")
    name, raw = text.split("=", 1)
    for convert in (int, float):
        try:
            return name, convert(raw)
        except ValueError:
            pass
    return name, {"true": True, "false": False}.get(raw.lower(), raw)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvq select", description=__doc__)
    parser.add_argument("method", help="method name (see 'kvq list')")
    parser.add_argument("--shape", required=True, help="B,H_kv,T,D of the keys/values (or BxH_kvxTxD)")
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--op", choices=OPS, default=None, help="one op (default: all four)")
    parser.add_argument("--device", default=None, help="cpu, gpu, metal or cuda (default: MLX's default)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="method parameter, repeatable (e.g. --param bits=3)")
    parser.add_argument("--kernels", choices=KERNELS, default="auto",
                        help="auto (kernels and pure MLX ranked by cost; default), require (kernels only), off")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    params = registry().method(args.method).make_params(**dict(parse_param(p) for p in args.param))
    plan = select(args.method, parse_shape(args.shape), dtype=DTYPES[args.dtype], device=args.device,
                  op=args.op, params=params, kernels=args.kernels)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.explain())
    if not plan.ready and not args.json and "model_id" in attrs.fields_dict(type(params)):
        # the reason is worded for Python (model_id=...); here a parameter is given as --param NAME=VALUE
        print(f"  (from the command line: kvq select {args.method} --shape {args.shape} --param "
              f"model_id=<the model>, after 'kvq calibrate --model <the model>')")
    return 0
