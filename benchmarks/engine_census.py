"""Do more engine configurations than the benchmarker times find faster pieces? (GPU, one call)

The benchmarker times, per micro-batch size, the first ``max_engine_configs`` (8) usable
configurations of cuDNN's heuristics mode A and every fallback one. This script times, for the
pieces a plan runs, *every* configuration modes A, B and fallback propose, and prints per kernel
and piece size: how many configurations each way, the fastest within the piece's room (the plan's
limit, or the borrowed room for ``:out`` pieces) each way, and what the whole plan would save per
step if every piece took the faster one (each kernel weighted by ``--config``'s layer counts).

    python -m benchmarks.engine_census PLAN --config vgg16 [--directions bwd_filter] --out JSON
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time

from mucudnn.bench import Benchmarker
from mucudnn.config import load_config
from mucudnn.estimates import geometry
from mucudnn.engines import Api, api_of
from mucudnn.cudnn import graph as graph_mod
from mucudnn.plan import read_plan
from mucudnn.timing import TimingMethod



def every_config(graph, max_heuristic=None):
    """Every usable configuration of heuristics modes A, B and fallback, each name once."""
    chosen = {}
    for mode in (graph_mod.HeurMode.A, graph_mod.HeurMode.B, graph_mod.HeurMode.FALLBACK):
        try:
            found = graph.heuristics(mode)
        except Exception as exc:  # noqa: BLE001 - a mode cuDNN refuses contributes nothing
            print(f"    mode {mode.name} refused: {exc}", file=sys.stderr)
            continue
        for candidate in found:
            if graph_mod.is_usable(candidate, graph.problem):
                chosen.setdefault(candidate.name, candidate)
    return list(chosen.values())


class _NullStore:
    def get(self, *a, **k):
        return []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--config", help="network config whose layer counts weight the sums")
    ap.add_argument("--directions", nargs="+", default=["fwd", "bwd_data", "bwd_filter"])
    ap.add_argument("--out")
    args = ap.parse_args()
    plan = read_plan(args.plan)
    counts = {geometry(p.key): w for p, w in load_config(args.config).kernels()} if args.config else {}
    # timing without pruning: every configuration gets a full timing
    bench = Benchmarker(_NullStore(), TimingMethod(dominated_factor=None), progress=False)
    original = graph_mod.candidate_configs
    report, saved_total = [], 0.0
    t0 = time.time()
    for entry in plan:
        problem = entry.problem
        if problem.direction.value not in args.directions or not entry.is_divided:
            continue
        weight = counts.get(geometry(entry.key), 1)
        sample_bytes = problem.written_sample_bytes
        rooms = collections.defaultdict(list)  # size -> room of each piece of that size
        left = entry.n
        for piece in entry.pieces:
            left -= piece.batch
            rooms[piece.batch].append(max(plan.limit, left * sample_bytes) if piece.borrow
                                      else plan.limit)
        rows = {}
        for size in sorted(rooms):
            default_names: set[str] = set()

            def census(graph, max_heuristic=8):
                default_names.update(c.name for c in original(graph, max_heuristic))
                return every_config(graph)

            graph_mod.candidate_configs = census
            try:
                measured = [m for m in bench.measure(problem.with_n(entry.n), [size])
                            if m.ok and m.batch == size]
            finally:
                graph_mod.candidate_configs = original
            rows[(size, "every")] = measured
            rows[(size, "default")] = [m for m in measured if api_of(m.algo) is Api.LEGACY
                                       or m.algo in default_names]
        kernel = {"key": entry.key, "weight": weight, "sizes": []}
        plan_saving = 0.0
        for size, piece_rooms in sorted(rooms.items()):
            line = {"size": size, "pieces": len(piece_rooms)}
            for label in ("default", "every"):
                line[f"{label}_configs"] = len(rows[(size, label)])
            for i, room in enumerate(piece_rooms):
                best = {label: min((m for m in rows[(size, label)] if m.workspace <= room),
                                   key=lambda m: m.time_ms, default=None)
                        for label in ("default", "every")}
                if best["default"] and best["every"]:
                    plan_saving += best["default"].time_ms - best["every"].time_ms
                if i == 0:
                    for label, m in best.items():
                        line[f"{label}_best"] = (m.algo, round(m.time_ms, 4), m.workspace) if m else None
            kernel["sizes"].append(line)
            print(f"{problem.direction.value:10s} c{problem.c:<4d} {'x'.join(map(str, problem.input_size)):8s} "
                  f"b={size:<4d} x{len(piece_rooms):<3d} configs {line['default_configs']:3d} -> "
                  f"{line['every_configs']:3d}  best {line['default_best']} -> {line['every_best']}",
                  flush=True)
        kernel["saving_ms_per_call"] = plan_saving
        saved_total += plan_saving * weight
        report.append(kernel)
    print(f"plan pieces: every configuration would save {saved_total:.3f} ms per step "
          f"(weighted), census took {time.time() - t0:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kernels": report, "saved_ms_per_step": saved_total}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
