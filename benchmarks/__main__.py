"""``python -m benchmarks [--quick] [--runs N] [--out PATH] [--only NAME,...]``: run the suite, print a
table, write JSON.

``--quick`` is the CI smoke run (tiny counts, a 2 s CPU window, 2 processes): it checks that every
benchmark runs and reports, and asserts nothing about timing. ``--runs N`` repeats the whole suite and
reports each metric's median over the runs with their min-max (docs/performance.md is made this way;
``--markdown PATH`` also writes the table as Markdown). The exit status is 1 if a benchmark failed to
run (an error, not a missed target).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from benchmarks import (
    SCHEMA_VERSION,
    e2e,
    idle,
    ms_store,
    notify,
    resubscribe,
    scale,
    store_scale,
    timeline,
    verify,
)
from benchmarks._common import (
    RESULTS_DIR,
    BenchResult,
    Settings,
    combine_runs,
    machine,
    quiet_logging,
    render_markdown,
    render_table,
)

# name -> (runner, names of the results it produces)
SUITE: dict[str, tuple[Callable[[Settings], BenchResult | list[BenchResult]], tuple[str, ...]]] = {
    "idle": (idle.run, ("idle",)),
    "notify": (notify.run, ("notify_to_hook",)),
    "resubscribe": (resubscribe.run, ("resubscribe",)),
    "e2e": (e2e.run, ("e2e_switch", "scale_coordination", "pause_alignment")),
    "e2e_probe": (verify.run, ("e2e_probe",)),
    "scale": (scale.run, ("scale_list",)),
    "store_scale": (store_scale.run, ("store_scale",)),
    "store_scale_node": (store_scale.run_node, ("store_scale_node",)),
    "store_scale_group": (store_scale.run_group, ("store_scale_group",)),
    "timeline": (timeline.run, ("timeline",)),
    "ms_store": (ms_store.run, ("ms_store",)),  # skipped, with the reason, without torch and MindSpore
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks",
                                     description="Run the nicswitch-agent benchmark suite: print a table, write JSON.")
    parser.add_argument("--quick", action="store_true", help="CI smoke run: tiny counts, no timing asserted")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "results.json", help="JSON output path")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(SUITE)}")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--runs", type=int, default=1, help="repeat the suite; report the median of the runs")
    parser.add_argument("--markdown", type=Path, help="also write the table as Markdown here")
    args = parser.parse_args(argv)
    selected = [s for s in args.only.split(",") if s] or list(SUITE)
    unknown = sorted(set(selected) - set(SUITE))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    settings = Settings(quick=args.quick, seed=args.seed)
    quiet_logging()
    started_wall = datetime.datetime.now(datetime.timezone.utc)
    started = time.monotonic()
    host = machine()
    runs: list[list[BenchResult]] = []
    loads = []
    for run_index in range(max(1, args.runs)):
        if args.runs > 1:
            print(f"== run {run_index + 1} of {args.runs}", file=sys.stderr, flush=True)
        loads.append(machine()["load_average"])
        runs.append(run_suite(selected, Settings(quick=args.quick, seed=args.seed + run_index)))
    results = runs[0] if len(runs) == 1 else combine_runs(runs)
    host["load_average_end"] = machine()["load_average"]
    document = {
        "schema": SCHEMA_VERSION,
        "mode": "quick" if settings.quick else "full",
        "started": started_wall.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": host,
        "command": " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])]),
        "runs": len(runs),
        "load_average_per_run": loads,
        "benchmarks": {r.name: r.as_dict() for r in results},
    }
    if len(runs) > 1:
        document["per_run"] = [{r.name: r.as_dict() for r in run} for run in runs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    print(render_table(results))
    if args.markdown is not None:
        args.markdown.write_text(render_markdown(results) + "\n", encoding="utf-8")
    print(f"\n{document['mode']} run x{len(runs)}, {document['duration_s']} s on {host['nproc']} CPU(s) "
          f"({host['cpu_model']}); load average {host['load_average']} -> {host['load_average_end']}; "
          f"JSON: {args.out}")
    return 1 if any(r.error for r in results) else 0


def run_suite(selected: list[str], settings: Settings) -> list[BenchResult]:
    results: list[BenchResult] = []
    for name in selected:
        runner, names = SUITE[name]
        print(f"== {name} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            produced = runner(settings)
            batch = produced if isinstance(produced, list) else [produced]
        except Exception as exc:  # report, go on with the next benchmark
            traceback.print_exc()
            batch = [BenchResult(n, n, error=f"{type(exc).__name__}: {exc}") for n in names]
        for result in batch:
            if not result.duration_s:
                result.duration_s = (time.monotonic() - t0) / len(batch)
        results += batch
        print(f"   {name}: {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    sys.exit(main())
