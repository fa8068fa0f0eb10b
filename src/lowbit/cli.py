"""``lowbit <command>``: each command parses its arguments and calls one library function.

The CLI is the only place that prints.  Errors that come from bad input (``ValueError``,
``KeyError``, ``FileNotFoundError``, ``FileExistsError``) are shown as one line and exit
with status 2; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

__all__ = ["main"]


def _write_json(path: str | None, data) -> None:
    if path:
        from .io import atomic_write_text

        atomic_write_text(Path(path), json.dumps(data, indent=2) + "\n")


def cmd_formats(args: argparse.Namespace) -> int:
    from . import lessons, render

    if args.error:
        w = lessons.synthetic_weight(args.rows, args.cols, args.seed)
        rows = lessons.scheme_errors(w)
        render.print_tables(render.errors_table(rows, (args.rows, args.cols)))
        _write_json(args.json, [r.to_dict() for r in rows])
        return 0
    facts = lessons.format_facts()
    render.print_tables(render.formats_table(facts), render.grids_table(facts), render.bit_layouts_table())
    _write_json(args.json, [f.to_dict() for f in facts])
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = argparse.ArgumentParser(prog="lowbit", description="Quantize, measure, plan and ship low-bit LLMs.")
    p.add_argument("--version", action="version", version=f"lowbit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    f = sub.add_parser("formats", help="the element formats, or (--error) what each scheme costs on a weight")
    f.add_argument("--error", action="store_true", help="quantize a synthetic weight with every preset")
    f.add_argument("--rows", type=int, default=1024)
    f.add_argument("--cols", type=int, default=4096)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    f.set_defaults(func=cmd_formats)

    from .sim.commands import register as register_sim

    register_sim(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, FileNotFoundError, FileExistsError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"lowbit {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
