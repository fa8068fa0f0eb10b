"""The ``memory`` and ``simulate`` subcommands: parse, call one library function, render.

``lowbit.cli`` calls :func:`register` with its subparsers object.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path

from ..util.io import refuse_existing

__all__ = ["register"]


def register(subparsers) -> None:
    """Add ``memory`` and ``simulate`` to an argparse subparsers object."""
    m = subparsers.add_parser("memory", help="weights, KV per token, what fits and the decode-speed bound")
    m.add_argument("--model", required=True, help="built-in model name or a config.json path / folder")
    m.add_argument("--gpu", required=True, help="GPU key of the table (h100, a100, b200, ...)")
    m.add_argument("--quant", default="bf16", help="comma-separated plans, e.g. bf16,fp8,w4a16,fp8+kv-fp8")
    m.add_argument("--tp", default="1", help="comma-separated tensor-parallel sizes")
    m.add_argument("--context", type=int, default=8000, help="conversation length in tokens (default 8000)")
    m.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    m.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    m.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    m.set_defaults(func=_memory)

    s = subparsers.add_parser("simulate", help="serving simulation: low-load latency and max rate under an SLO")
    s.add_argument("--model", required=True, help="built-in model name or a config.json path / folder")
    s.add_argument("--gpu", required=True, help="GPU key (h100, a100, ...)")
    s.add_argument("--quant", default="bf16,fp8", help="comma-separated plans, e.g. bf16,w4a16,fp8,fp8+kv-fp8")
    s.add_argument("--prompt", default="1024", help="prompt tokens: N or LOW:HIGH")
    s.add_argument("--output", default="256", help="output tokens: N or LOW:HIGH")
    s.add_argument("--lengths-file", help="(prompt, output) pairs: JSON list or CSV; overrides --prompt/--output")
    s.add_argument("--requests", type=int, default=2000, help="requests per simulation (default 2000)")
    s.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of inter-arrivals (1 = Poisson)")
    s.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; the max rate is a range over them")
    s.add_argument("--ttft", type=float, default=1000.0, help="TTFT target, ms (default 1000)")
    s.add_argument("--tpot", type=float, default=40.0, help="TPOT target, ms (default 40)")
    s.add_argument("--percentile", type=float, default=99.0, help="SLO percentile (default 99)")
    s.add_argument("--goodput", type=float, metavar="FRACTION",
                   help="use the goodput form: this fraction of requests must meet every target")
    s.add_argument("--tp", type=int, default=1)
    s.add_argument("--max-num-batched-tokens", type=int, help="default: vLLM's for the GPU")
    s.add_argument("--max-num-seqs", type=int, help="default: vLLM's for the GPU")
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    s.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    s.add_argument("--force", action="store_true", help="overwrite an existing --json file")
    s.add_argument("--plot", metavar="FILE.png", help="draw TTFT/TPOT percentiles against request rate")
    s.set_defaults(func=_simulate)


def _csv(text: str, cast, what: str) -> list:
    try:
        items = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {what}: cannot parse {text!r}") from None
    if not items:
        raise SystemExit(f"error: {what}: empty list")
    return items


def _write_json(path: str, data, force: bool) -> None:
    from ..util.io import write_json

    write_json(Path(path), data, force=force)


def _console():
    from rich.console import Console

    return Console()


def _memory(args: argparse.Namespace) -> int:
    from ..sim.hardware import load_hardware
    from ..sim.memory import memory_report
    from ..sim.plans import parse_plan
    from ..report.capacity import memory_table
    from ..sim.shapes import get_model

    refuse_existing(args.json, args.force)
    model, gpu = get_model(args.model), load_hardware().gpu(args.gpu)
    reports = [memory_report(model, parse_plan(q), gpu, tp, args.context, args.gpu_memory_utilization)
               for q in _csv(args.quant, str, "--quant") for tp in _csv(args.tp, int, "--tp")]
    con = _console()
    con.print(memory_table(reports))
    if args.json:
        _write_json(args.json, [r.to_dict() for r in reports], args.force)
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from ..sim.capacity import capacity_table, latency_curves
    from ..sim.engine import EngineConfig
    from ..sim.hardware import load_hardware
    from ..sim.metrics import SLO
    from ..report.capacity import capacity_rich_table, plot_curves
    from ..sim.workload import Lengths, lengths_from_file

    refuse_existing(args.json, args.force)
    refuse_existing(args.plot, args.force)
    con = _console()
    if args.lengths_file:
        vals = lengths_from_file(args.lengths_file)
        prompt = Lengths("values", values=tuple(p for p, _ in vals))
        output = Lengths("values", values=tuple(o for _, o in vals))
    else:
        prompt, output = Lengths.parse(args.prompt), Lengths.parse(args.output)
    gpu = load_hardware().gpu(args.gpu)
    base = EngineConfig.vllm_defaults(gpu, args.tp)
    engine = EngineConfig(
        max_num_batched_tokens=args.max_num_batched_tokens or base.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs or base.max_num_seqs, block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization, tp=args.tp)
    slo = SLO(ttft=args.ttft / 1e3, tpot=args.tpot / 1e3, percentile=args.percentile,
              attainment=args.goodput if args.goodput is not None else 0.99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with con.status("simulating ..."):
            table = capacity_table(args.model, args.gpu, _csv(args.quant, str, "--quant"), prompt, output, slo,
                                   n_requests=args.requests, burstiness=args.burstiness, tp=args.tp,
                                   engine=engine, seeds=tuple(_csv(args.seeds, int, "--seeds")),
                                   form="goodput" if args.goodput is not None else "percentile")
    for w in caught:
        con.print(f"[yellow]warning:[/] {w.message}")
    con.print(capacity_rich_table(table))
    if args.json:
        _write_json(args.json, table.to_dict(), args.force)
    if args.plot:
        with con.status("sweeping request rates ..."):
            curves = latency_curves(table, prompt, output)
        path = plot_curves(curves, args.plot, title=f"{table.model} on {table.gpu} × {table.tp}")
        con.print(f"plot written to {path}")
    return 0
