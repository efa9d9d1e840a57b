"""Command line: argument parsing and dispatch only. Bad input exits with code 2 and one line, no traceback."""
from __future__ import annotations

import argparse
import json
import sys

from .spec import InputError, parse_batch, parse_dtype, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line instead of usage + message
        raise InputError(f"{message} (see {self.prog} --help)")


def _add_shape_args(p, sizes_default=("512x512",)):
    p.add_argument("--model", required=True, help="registry name (attnprof models), diffusers folder or hub id")
    p.add_argument("--size", action="append", metavar="WxH",
                   help=f"image size in pixels, repeatable (default {' '.join(sizes_default)})")
    p.add_argument("--batch", default="1", help="batch size (default 1)")
    p.add_argument("--dtype", default="float16", help="float16 | bfloat16 | float32 (default float16)")


def _shape(args, sizes_default=("512x512",)):
    sizes = [parse_size(s) for s in (args.size or sizes_default)]
    return sizes, parse_batch(args.batch), parse_dtype(args.dtype)


def cmd_plan(args) -> int:
    from .plan import format_plan, plan

    sizes, batch, dtype = _shape(args)
    options = _backend_options(args.option)
    if args.backend:
        from .backends import check_backend_name

        check_backend_name(args.backend)
    from . import models

    unet = models.build(args.model, weights="meta", dtype=dtype)
    plans = [plan(args.model, w, h, batch, dtype, backend=args.backend, backend_options=options, unet=unet)
             for w, h in sizes]
    if args.json:
        json.dump(plans, sys.stdout, indent=1)
        print()
    else:
        print("\n\n".join(format_plan(p) for p in plans))
    return 0


def cmd_models(args) -> int:
    from . import models

    for name, path in models.known_models().items():
        print(f"{name:12s} {models._read_yaml(path).config.get('block_out_channels')}  {path}")
    return 0


def _backend_options(pairs) -> dict:
    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InputError(f"backend option {pair!r} is not KEY=VALUE: e.g. --option slice_size=4")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnprof", description="Profile the attention blocks of Stable Diffusion U-Nets.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="per-block tokens, score tables, FLOPs and predicted peak; no GPU, no weights",
                       description="Per-block figures from a meta-device forward: no weights, no GPU.")
    _add_shape_args(p)
    p.add_argument("--backend", help="add each call's predicted peak memory for this backend (attnprof backends)")
    p.add_argument("--option", action="append", metavar="KEY=VALUE", help="backend option, e.g. slice_size=4")
    p.add_argument("--json", action="store_true", help="print a JSON array, one object per size")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("models", help="list the models in configs/models")
    p.set_defaults(func=cmd_models)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except InputError as e:
        print(f"attnprof: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("attnprof: interrupted", file=sys.stderr)
        return 130
