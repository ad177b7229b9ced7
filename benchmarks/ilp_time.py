"""Time of the WD integer program (PuLP + bundled CBC) for a network's kernels, from stored
measurements (CPU only): Pareto fronts are built once, then ``solve_budget`` is timed at several
budgets (median of repeats).

    python -m benchmarks.ilp_time --config resnet50
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time

from mucudnn import find_config, load_config
from mucudnn.optimizer import Policy, network_workspace, pareto_plans, solve_budget
from mucudnn.sizes import parse_size
from mucudnn.tuner import measurements, open_measurements


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="resnet50")
    ap.add_argument("--store")
    ap.add_argument("--budgets", nargs="+", default=["256MiB", "512MiB", "1GiB", "2GiB"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(find_config(args.config))
    store, env = open_measurements(args.store)
    t0 = time.perf_counter()
    fronts, weights = {}, {}
    for problem, weight in cfg.kernels():
        label = f"{problem.key} {problem.n}"
        rows = measurements(store, env, problem, Policy.POWER_OF_TWO)
        fronts[label] = pareto_plans(rows, problem.n, Policy.POWER_OF_TWO)
        weights[label] = weight
    fronts_s = time.perf_counter() - t0
    options = sum(len(f) for f in fronts.values())
    print(f"{args.config}: {len(fronts)} kernels, {options} Pareto plans, fronts built in "
          f"{fronts_s:.2f} s; CPU: {platform.processor() or platform.machine()}")
    print("| budget | solve median s | min s | max s | plans' total workspace |")
    print("|---|---|---|---|---|")
    for text in args.budgets:
        budget = parse_size(text)
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            chosen = solve_budget(fronts, budget, weights=weights)
            times.append(time.perf_counter() - t0)
        print(f"| {text} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} | "
              f"{network_workspace(chosen) / 2**20:.1f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
