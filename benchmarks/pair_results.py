"""Pair the sides of two vs_peers / vs_llmcompressor JSON files over their evaluation windows (issue 18).

Each ``--a`` side is ``a`` and each ``--b`` side ``b`` of :func:`lowbit.evaluation.metrics.paired_difference`
(a ratio below 1 means ``b``'s KL or perplexity is lower on these windows), for rows of the same name.
Both files must have evaluated the same windows (same model, ``--windows``, seed); the script refuses
pairs whose window token counts differ.  For comparing runs made in different invocations — two runs of
one recipe, or a side against a peer measured earlier on the same machine.

    PYTHONPATH=src .venv/bin/python benchmarks/pair_results.py --a RUN1.json --b RUN2.json \\
        [--a-side autoround:default] [--b-side lowbit:...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from vs_peers import evaluated, paired_rows  # noqa: E402  (this script's folder is on sys.path)


def _sides(path: Path, side: str | None) -> list[dict]:
    return [r for r in evaluated(json.loads(path.read_text())["results"]) if side is None or r["side"] == side]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", type=Path, required=True, help="JSON whose sides are the reference (a)")
    ap.add_argument("--b", type=Path, required=True, help="JSON whose sides are compared with them (b)")
    ap.add_argument("--a-side", help="only this side of --a (default: every side)")
    ap.add_argument("--b-side", help="only this side of --b (default: every side)")
    args = ap.parse_args(argv)
    a_rows, b_rows = _sides(args.a, args.a_side), _sides(args.b, args.b_side)
    if not a_rows or not b_rows:
        ap.error("no evaluated side with per-window results matched in one of the files")
    n = 0
    for ra in a_rows:
        for rb in (r for r in b_rows if r["row"] == ra["row"]):
            if list(ra["result"]["window_tokens"]) != list(rb["result"]["window_tokens"]):
                print(f"{ra['row']}: {ra['side']} and {rb['side']} were evaluated on different windows; skipped")
                continue
            p = paired_rows(ra, rb)
            print(f"{ra['row']}: {args.b.name}:{rb['side']} / {args.a.name}:{ra['side']}: KL ratio {p['kl_ratio']:.3f} "
                  f"[{p['kl_ratio_ci'][0]:.3f}, {p['kl_ratio_ci'][1]:.3f}], PPL ratio {p['ppl_ratio']:.4f} "
                  f"[{p['ppl_ratio_ci'][0]:.4f}, {p['ppl_ratio_ci'][1]:.4f}]")
            n += 1
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
