"""GPU validation of the tuner (issue 2): execute plans through the bindings and compare with
what the optimizer predicted, and with a float64 reference.

For each network and WR limit: every kernel's plan runs as micro-batches in sequence on one stream;
its median time (timing.do_bench) is compared with the predicted time (sum of the pieces' stored
medians), and its output with a float64 cuDNN reference on fresh random inputs, next to the error of
the same algorithms run undivided. TF32 is off (configs use math=fma).

    python -m benchmarks.validate_tuner --store S --networks alexnet resnet50 --limits 8MiB 64MiB 512MiB --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from mucudnn import find_config, load_config
from mucudnn.bench import KernelBuffers, current_environment
from mucudnn.cudnn import ConvolutionCall, get
from mucudnn.execute import PlanExecutor, double_reference
from mucudnn.problem import Direction, algorithm_value
from mucudnn.sizes import format_size, parse_size
from mucudnn.store import open_store
from mucudnn.timing import TimingMethod, do_bench
from mucudnn.tuner import optimize

class Checker:
    def __init__(self, seed: int = 1) -> None:
        import cupy
        self.cupy = cupy
        self.cudnn = get()
        self.stream = cupy.cuda.Stream()
        self.stream.use()  # CuPy's fills run in order with cuDNN's work
        self.handle = self.cudnn.handle(self.stream.ptr)
        self.rng = cupy.random.default_rng(seed)

    def workspace(self, nbytes: int):
        return self.cupy.empty(max(nbytes, 1), dtype="uint8")

    def reference(self, buffers: KernelBuffers, alpha: float, beta: float, prior):
        """float64 alpha * conv + beta * prior (conv computed by cuDNN in double precision)."""
        conv = double_reference(self.cudnn, self.handle, buffers, self.stream)
        return alpha * conv + beta * prior.astype("float64")

    def error(self, got, ref) -> float:
        got64 = got.astype("float64")
        if not bool(self.cupy.isfinite(got64).all()):
            return float("nan")
        return float(self.cupy.linalg.norm(got64 - ref) / self.cupy.linalg.norm(ref))

    def check_entry(self, entry, alpha=1.0, beta=0.0) -> dict:
        """Plan vs float64 reference, and each of the plan's algorithms undivided vs the same."""
        problem = entry.problem
        buffers = KernelBuffers.random(problem, self.rng)     # fresh random inputs
        out = buffers.output()
        prior = out.copy()
        ref = self.reference(buffers, alpha, beta, prior)
        ws = self.workspace(entry.workspace)
        if beta == 0.0:
            out.fill(float("nan"))                            # every element must be written
        else:
            out[...] = prior
        PlanExecutor(self.cudnn, self.handle, entry).run(buffers, ws.data.ptr, alpha, beta)
        self.stream.synchronize()
        result = {"plan_error": self.error(out, ref), "undivided_error": {}}
        del ws
        for piece_algo, piece_math in {(p.algo, p.math) for p in entry.pieces}:
            call = ConvolutionCall(self.cudnn, problem, piece_math)
            algo = algorithm_value(problem.direction, piece_algo)
            try:
                ws_size = call.workspace_size(self.handle, algo)
                ws = self.workspace(ws_size)
                out[...] = prior
                call.run(self.handle, algo, *buffers.pointers(0), ws.data.ptr, ws_size,
                         beta=beta, alpha=alpha)
                self.stream.synchronize()
                result["undivided_error"][piece_algo] = self.error(out, ref)
                del ws
            except Exception as exc:  # e.g. the undivided workspace does not fit the GPU
                result["undivided_error"][piece_algo] = f"not run: {exc}"
        self.cupy.get_default_memory_pool().free_all_blocks()
        return result

    def time_entry(self, entry) -> float:
        buffers = KernelBuffers.random(entry.problem, self.rng)
        ws = self.workspace(entry.workspace)
        executor = PlanExecutor(self.cudnn, self.handle, entry)
        timing = do_bench(lambda i: executor.run(buffers, ws.data.ptr), self.stream,
                          TimingMethod(min_reps=5, max_reps=30, budget_ms=100.0))
        ws = buffers = None  # noqa: F841 - free before the next kernel
        self.cupy.get_default_memory_pool().free_all_blocks()
        return timing.median_ms


def accuracy_ok(check: dict) -> bool:
    undivided = [e for e in check["undivided_error"].values() if isinstance(e, float)]
    plan_error = check["plan_error"]
    if not np.isfinite(plan_error):
        return False
    if undivided:
        return plan_error <= 2.0 * max(undivided) + 1e-7
    return plan_error < 1e-4


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", required=True)
    ap.add_argument("--networks", nargs="+", default=["alexnet", "resnet50"])
    ap.add_argument("--limits", nargs="+", default=["8MiB", "64MiB", "512MiB"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    env = current_environment()
    checker = Checker()
    results = {"gpu": env.gpu, "cudnn": env.cudnn, "kernels": []}
    checked: dict[tuple, dict] = {}
    store = open_store(args.store)
    for network in args.networks:
        cfg = load_config(find_config(network))
        for limit_text in args.limits:
            limit = parse_size(limit_text)
            plan = optimize(cfg, workspace_limit=limit, store=store, env=env)
            for entry in plan:
                t0 = time.perf_counter()
                measured = checker.time_entry(entry)
                signature = (entry.key, entry.pieces)
                if signature not in checked:
                    checked[signature] = checker.check_entry(entry)
                    if entry.problem.direction is Direction.BACKWARD_FILTER:
                        checked[signature]["alpha_beta"] = checker.check_entry(entry, 0.7, 0.3)
                check = checked[signature]
                ok = accuracy_ok(check) and accuracy_ok(check.get("alpha_beta", check))
                row = {"network": network, "limit": limit, "key": entry.key, "n": entry.n,
                       "pieces": " ".join(map(str, entry.pieces)), "workspace": entry.workspace,
                       "predicted_ms": entry.time_ms, "measured_ms": measured,
                       "ratio": measured / entry.time_ms, **check, "accuracy_ok": ok,
                       "seconds": time.perf_counter() - t0}
                results["kernels"].append(row)
                print(f"{network:9s} {format_size(limit):>9s} {entry.problem.direction.value:10s} "
                      f"pieces={len(entry.pieces):3d} pred={entry.time_ms:9.3f} "
                      f"meas={measured:9.3f} ratio={row['ratio']:.3f} "
                      f"err={check['plan_error']:.2e} ok={ok}", flush=True)
    rows = results["kernels"]
    within = sum(1 for r in rows if abs(r["ratio"] - 1) <= 0.10)
    accurate = sum(1 for r in rows if r["accuracy_ok"])
    results["summary"] = {"kernels": len(rows), "time_within_10pct": within,
                          "accuracy_ok": accurate,
                          "worst_ratio": max((r["ratio"] for r in rows), default=None)}
    with open(args.out, "w") as fh:
        json.dump(results, fh, indent=1, default=str)
    print(json.dumps(results["summary"]))
    return 0 if accurate == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
