"""Out-of-bounds and input-modification check: run each plan entry of a plan file through the bindings with guard bands
of NaN before and after every buffer (x, w, y, workspace) and report entries that touch them.

    python -m benchmarks.guard_check PLAN [--direction bwd_filter]
"""

from __future__ import annotations

import argparse
import sys

import cupy

from mucudnn.bench import KernelBuffers
from mucudnn.cudnn import get
from mucudnn.execute import PlanExecutor
from mucudnn.plan import read_plan

GUARD = 1 << 16  # elements on each side


def guarded(n: int, dtype="float32"):
    base = cupy.full(n + 2 * GUARD, cupy.nan, dtype=dtype)
    return base, base[GUARD:GUARD + n]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("plan")
    ap.add_argument("--direction")
    args = ap.parse_args()
    stream = cupy.cuda.Stream()
    stream.use()
    cudnn = get()
    handle = cudnn.handle(stream.ptr)
    rng = cupy.random.default_rng(0)
    bad = 0
    for entry in read_plan(args.plan):
        p = entry.problem
        if args.direction and p.direction.value != args.direction:
            continue
        fresh = KernelBuffers.random(p, rng)
        bases, views = zip(*(guarded(a.size) for a in (fresh.x, fresh.w, fresh.y)))
        for view, src in zip(views, (fresh.x, fresh.w, fresh.y)):
            view[...] = src
        buffers = KernelBuffers(p, *views)
        ws_base, ws = guarded(max(entry.workspace // 4 + 1, 1))
        ws_base_u8 = ws_base.view("uint8")
        PlanExecutor(cudnn, handle, entry).run(buffers, ws.data.ptr)
        stream.synchronize()
        touched = []
        for name, base in zip("xwy", bases):
            if not bool(cupy.isnan(base[:GUARD]).all() and cupy.isnan(base[-GUARD:]).all()):
                touched.append(name)
        # the inputs of the direction must come back unchanged
        inputs = {"fwd": "xw", "bwd_data": "wy", "bwd_filter": "xy"}[p.direction.value]
        for name, view, src in zip("xwy", views, (fresh.x, fresh.w, fresh.y)):
            if name in inputs and not bool((view == src).all()):
                touched.append(f"input {name} modified")
        if not bool(cupy.isnan(ws_base[-GUARD:]).all()):
            touched.append("workspace end")
        del ws_base_u8
        status = "TOUCHED " + ",".join(touched) if touched else "ok"
        bad += bool(touched)
        print(f"{p.direction.value:10s} c={p.c} in={p.input_size} k={p.k} "
              f"pieces={' '.join(map(str, entry.pieces[:2]))}... ws={entry.workspace}: {status}",
              flush=True)
    print(f"{bad} entries wrote outside their buffers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
