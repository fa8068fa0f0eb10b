"""Wall time, stage times and peak memory of `lowbit compare` on a cold cache (issue 3).

A fresh cache folder gets links to the converted models, corpora and token streams of the
normal cache, so the reference predictions and the calibration statistics are computed
as on a first run, but nothing is downloaded or converted.  Memory is the proportional set
size (PSS) summed over the `lowbit` process and its forked workers, sampled every second:
PSS counts pages the workers share with their parent once, which a sum of RSS would not.
CPU time (user + system of the process and its workers) and the load average are printed
beside the wall time: on a shared machine the wall time alone says little.

    .venv/bin/python benchmarks/compare_time.py                # the default job
    .venv/bin/python benchmarks/compare_time.py --keep-json rows.json   # and keep its table's JSON
    .venv/bin/python benchmarks/compare_time.py -- --windows 8 --recipes fp8-dynamic
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINKED = ("models", "corpora", "tokens", "gguf")


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            out += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
    except OSError:
        pass
    return out


def _tree(pid: int) -> list[int]:
    todo, out = [pid], []
    while todo:
        p = todo.pop()
        out.append(p)
        todo += _children(p)
    return out


def _pss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cache", type=Path, default=Path(os.environ.get("LOWBIT_CACHE", "~/.cache/lowbit")).expanduser(),
                    help="the warm cache whose models and corpora are linked in")
    ap.add_argument("--keep-json", type=Path, help="also copy the run's `lowbit compare --json` result here")
    ap.add_argument("extra", nargs="*", help="more `lowbit compare` arguments (after --)")
    a = ap.parse_args()
    if not Path("/proc/self/smaps_rollup").exists():
        ap.error("needs Linux /proc to measure memory")
    with tempfile.TemporaryDirectory(prefix="lowbit-cold-") as tmp:
        cold = Path(tmp)
        for name in LINKED:
            if (a.cache / name).exists():
                (cold / name).symlink_to(a.cache / name)
        out = cold / "result.json"
        lowbit = Path(sys.executable).with_name("lowbit")
        cmd = [str(lowbit), "compare", a.model, "--cache", str(cold), "--json", str(out), *a.extra]
        print("running:", " ".join(cmd), flush=True)
        t0 = time.perf_counter()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        load0 = os.getloadavg()[0]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, sum(_pss_kib(p) for p in _tree(proc.pid)))
            time.sleep(1.0)
        wall = time.perf_counter() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        load1 = os.getloadavg()[0]
        if proc.returncode:
            print(f"lowbit compare failed (exit {proc.returncode})", file=sys.stderr)
            return proc.returncode
        stages = json.loads(out.read_text())["stage_seconds"]
        if a.keep_json:
            a.keep_json.write_bytes(out.read_bytes())
    print(f"{a.model}: wall {wall:.0f} s ({wall / 60:.1f} min), CPU {cpu:.0f} s (process and workers), "
          f"peak PSS {peak / 2**20:.2f} GiB; load average {load0:.1f} at the start, {load1:.1f} at the end")
    for k, v in stages.items():
        print(f"  {k:<28} {v:7.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
