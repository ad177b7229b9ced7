"""How close to uncapped can any micro-batch plan get under a workspace limit? (from the store)

For each kernel of a recording, from the stored measurements (``--policy``'s sizes: powerOfTwo, or
every stored size with fit):

- ``uncapped``: the fastest row at the kernel's N, any workspace (what an uncapped run can pick);
- ``plan``: the WR plan (of ``--policy``) the tuner computes at the limit (``--policy all``: from
  :func:`mucudnn.estimates.every_size`'s estimate of every size, since measuring 256 sizes per kernel is not done);
- ``fit``: an estimate of the best plan with *any* micro-batch size (policy ``all``;
  :func:`mucudnn.estimates.fit_estimate`): for every algorithm, the largest size whose workspace
  fits the limit (workspace grows linearly with the batch between measured sizes), its time per
  sample interpolated log-linearly between the measured sizes around it, times N. Per-sample time
  falls with the batch, so this is what ``all`` could reach without measuring 256 sizes per
  algorithm.

- ``borrow`` (``--borrow-output``): the plan ``tune --borrow-output`` computes: forward and
  backward-data pieces may also use the part of their output tensor that later pieces have not
  written yet as workspace (a piece of ``b`` samples with ``r`` samples still to run after it gets
  ``max(limit, r x output bytes per sample)``), with no memory beyond the limit.

Sums count each kernel as often as the network runs it (``--config``: the layer counts of a
shipped network config, matched by geometry; a recording lists each kernel once). They bound the
step time: ``uncapped step + (fit - uncapped)`` is roughly the best a plan at this limit can do,
whatever its sizes.

    python -m benchmarks.limit_bound benchmarks/results/raw/vgg16-legacy-tf32.record \
        --config vgg16 --limit 64MiB --store STORE [--uncapped-step-ms 179.6]
"""

from __future__ import annotations

import argparse
import collections

from mucudnn.config import load_config
from mucudnn.estimates import every_size, fit_estimate, geometry
from mucudnn.optimizer import Policy, best_plan
from mucudnn.plan import read_recording
from mucudnn.sizes import parse_size
from mucudnn.tuner import measurements, open_measurements


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--limit", default="64MiB")
    ap.add_argument("--store")
    ap.add_argument("--api", default="both")
    ap.add_argument("--config", help="network config whose layer counts weight the sums")
    ap.add_argument("--uncapped-step-ms", type=float)
    ap.add_argument("--policy", default="powerOfTwo", choices=("powerOfTwo", "fit", "all"),
                    help="stored sizes the plan (and --borrow-output) may use; all: every size, "
                         "estimated from the stored ones (every_size)")
    ap.add_argument("--borrow-output", action="store_true",
                    help="add the borrow column (module doc)")
    args = ap.parse_args()
    limit = parse_size(args.limit)
    store, env = open_measurements(args.store)
    counts = {}
    if args.config:
        counts = {geometry(p.key): w for p, w in load_config(args.config).kernels()}
    totals = collections.Counter()
    policy = Policy(args.policy)
    stored = Policy.FIT if policy is Policy.ALL else policy  # all: estimated from what fit stored
    columns = ["uncapped", "plan", "fit"] + (["borrow"] if args.borrow_output else [])
    print(f"{'kernel':54s} {'count':>5s} " + " ".join(f"{c + ('~' if c == 'fit' else ''):>9s}"
                                               for c in columns) + "  (ms, at N)")
    with store:
        for problem in read_recording(args.recordings):
            rows = measurements(store, env, problem, stored, args.api)
            ok = [r for r in rows if r.ok]
            if policy is Policy.ALL:
                rows = every_size(rows, problem.n)
            times = {"uncapped": min(r.time_ms for r in ok if r.batch == problem.n),
                     "plan": best_plan(rows, problem.n, limit, policy).time_ms,
                     "fit": fit_estimate(rows, problem.n, limit)}
            times["fit"] = min(times["fit"], times["plan"])
            if args.borrow_output:
                times["borrow"] = best_plan(rows, problem.n, limit, policy,
                                            borrow_sample_bytes=problem.written_sample_bytes).time_ms
            count = counts.get(geometry(problem.key), 1)
            totals.update({what: t * count for what, t in times.items()})
            name = (f"{problem.direction.value} c{problem.c} "
                    f"{'x'.join(map(str, problem.input_size))} k{problem.k} "
                    f"f{'x'.join(map(str, problem.filter_size))} s{problem.stride[0]}")
            print(f"{name:54s} {count:5d} " + " ".join(f"{times[c]:9.3f}" for c in columns))
    print(f"{'sum, each kernel as often as it runs':60s} "
          + " ".join(f"{totals[c]:9.2f}" for c in columns))
    if args.uncapped_step_ms:
        for what in columns[1:]:
            step = args.uncapped_step_ms + totals[what] - totals["uncapped"]
            print(f"step with the {what} kernels' extra time: {step:.1f} ms "
                  f"({step / args.uncapped_step_ms:.3f}x uncapped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
