"""Would running a plan's pieces as one CUDA graph save GPU time? (GPU, one call)

A micro-batch plan turns one convolution into many small calls, each several kernels (VGG-16's
plan: about 3,000 GPU activities per step against 330 uncapped), and the GPU spends about a
microsecond between any two kernels. A profile of the training step shows those gaps and nothing
else: 4.4 ms per step of idle GPU with no gap over 5 µs. CUDA graphs launch their kernels with
shorter gaps. For each divided kernel of PLAN this times its pieces run back to back as the shim
runs them (eager) and the same calls captured once into a CUDA graph and replayed (CuPy stream
capture), on the same buffers, and prints the saving per step (kernels weighted by ``--config``).

    python -m benchmarks.graph_capture_probe PLAN --config vgg16 [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from mucudnn.bench import Benchmarker, KernelBuffers
from mucudnn.config import load_config
from mucudnn.estimates import geometry
from mucudnn.cudnn import ConvolutionCall
from mucudnn.cudnn.graph import ConvolutionGraph
from mucudnn.engines import Api, api_of, parse_engine_name
from mucudnn.plan import read_plan

from mucudnn.problem import ALGORITHMS, Direction



class _NullStore:
    def get(self, *a, **k):
        return []


def piece_runners(bench, entry, buffers, stack):
    """One callable per piece of ``entry``, in plan order, as the shim runs them: consecutive
    slices, the first backward-filter piece with beta 0 and the others with beta 1, one workspace
    as large as the largest piece needs (borrowing pieces included: the probe times, it does not
    save memory). Returns (runners, workspace)."""
    problem = entry.problem
    steps, offset, plans = [], 0, {}
    for i, piece in enumerate(entry.pieces):
        sub = problem.with_n(piece.batch)
        beta = 1.0 if problem.direction is Direction.BACKWARD_FILTER and i > 0 else 0.0
        if api_of(piece.algo) is Api.GRAPH:
            key = (piece.batch, beta, piece.algo)
            if key not in plans:
                graph = ConvolutionGraph(bench.cudnn, bench.handle, sub, beta=beta)
                stack.append(graph)
                plans[key] = graph.plan_from_name(parse_engine_name(piece.algo))
                stack.append(plans[key])
            steps.append((offset, beta, plans[key], None, plans[key].workspace_size))
        else:
            call = ConvolutionCall(bench.cudnn, sub, piece.math)
            algo = ALGORITHMS[problem.direction].index(piece.algo)
            steps.append((offset, beta, call, algo, call.workspace_size(bench.handle, algo)))
        offset += piece.batch
    workspace = bench.cupy.empty(max(1, *(size for *_, size in steps)), dtype="uint8")
    ws = workspace.data.ptr
    runners = []
    for offset, beta, runner, algo, size in steps:
        x, w, y = buffers.pointers(offset)
        if algo is None:
            pack = runner.variant_pack(x, w, y, ws)
            stack.append(pack)
            runners.append(lambda plan=runner, pack=pack: plan.execute(pack))
        else:
            runners.append(lambda call=runner, algo=algo, x=x, w=w, y=y, size=size, beta=beta:
                           call.run(bench.handle, algo, x, w, y, ws, size, beta=beta))
    return runners, workspace


def median_ms(cupy, stream, fn, reps: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("--config")
    ap.add_argument("--out")
    args = ap.parse_args()
    plan = read_plan(args.plan)
    counts = {geometry(p.key): w for p, w in load_config(args.config).kernels()} if args.config else {}
    bench = Benchmarker(_NullStore(), progress=False)
    cupy, stream = bench.cupy, bench.stream
    rows, totals, t0 = [], {"eager": 0.0, "graph": 0.0}, time.time()
    with stream:
        for entry in plan:
            if not entry.is_divided:
                continue
            weight = counts.get(geometry(entry.key), 1)
            buffers = KernelBuffers.random(entry.problem, bench.rng)
            stack: list = []
            workspace = None
            try:
                runners, workspace = piece_runners(bench, entry, buffers, stack)

                def eager():
                    for run in runners:
                        run()

                eager_ms = median_ms(cupy, stream, eager)
                try:
                    stream.begin_capture()
                    try:
                        eager()
                    finally:
                        graph = stream.end_capture()
                    graph_ms = median_ms(cupy, stream, lambda: graph.launch(stream))
                except Exception as exc:  # noqa: BLE001 - a kernel cuDNN cannot capture: say so
                    print(f"  capture failed: {exc}", flush=True)
                    graph_ms = eager_ms
            finally:
                stream.synchronize()
                for item in reversed(stack):
                    item.close()
                del buffers, workspace
                cupy.get_default_memory_pool().free_all_blocks()
            p = entry.problem
            name = f"{p.direction.value} c{p.c} {'x'.join(map(str, p.input_size))} k{p.k}"
            rows.append({"kernel": name, "weight": weight, "pieces": len(entry.pieces),
                         "planned_ms": entry.time_ms, "eager_ms": eager_ms, "graph_ms": graph_ms})
            totals["eager"] += eager_ms * weight
            totals["graph"] += graph_ms * weight
            print(f"{name:32s} x{weight} {len(entry.pieces):4d} pieces  planned {entry.time_ms:7.3f}"
                  f"  eager {eager_ms:7.3f}  graph {graph_ms:7.3f} ms", flush=True)
    print(f"per step: eager {totals['eager']:.2f} ms, graph {totals['graph']:.2f} ms, saving "
          f"{totals['eager'] - totals['graph']:.2f} ms ({time.time() - t0:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"kernels": rows, "totals": totals}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
