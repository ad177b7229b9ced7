"""What pruning dominated configurations saves a benchmark, estimated from stored times.

For every stored OK row of a recording's kernels: the GPU time the timing method (mucudnn.timing)
spends on it in full (warm-up, probe, repetitions), against what it spends with the cutoff that
``bench.Frontier`` sets: ``dominated_factor`` times the fastest other row of the same API and size
with no more workspace that is not FFT/Winograd (here the whole group counts, as if the faster
configuration were always timed first). Host time is not included.

    python -m benchmarks.prune_estimate benchmarks/results/raw/vgg16-legacy-tf32.record --store S
"""

from __future__ import annotations

import argparse
import collections

from mucudnn.engines import api_of, is_transform_based
from mucudnn.plan import read_recording
from mucudnn.timing import TimingMethod, calls_made
from mucudnn.tuner import open_measurements


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recordings", nargs="+")
    ap.add_argument("--store")
    args = ap.parse_args()
    method = TimingMethod()
    store, env = open_measurements(args.store)
    full = pruned = 0.0
    with store:
        for problem in read_recording(args.recordings):
            groups = collections.defaultdict(list)
            for row in store.get(env.gpu, env.cudnn, problem.key):
                if row.ok:
                    groups[(row.batch, api_of(row.algo))].append(row)
            for rows in groups.values():
                for row in rows:
                    faster = [o.time_ms for o in rows if o is not row and not is_transform_based(o)
                              and o.workspace <= row.workspace]
                    cutoff = method.dominated_factor * min(faster) if faster else None
                    full += calls_made(row.time_ms, method) * row.time_ms
                    pruned += calls_made(row.time_ms, method, cutoff) * row.time_ms
    print(f"GPU time in timed calls: {full / 1000:.0f} s in full, {pruned / 1000:.0f} s with "
          f"dominated configurations timed once ({1 - pruned / full:.0%} less)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
