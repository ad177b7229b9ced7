"""GPU tests (skipped without a GPU): bindings, benchmarker and plan execution against references."""

from __future__ import annotations

import pytest

from mucudnn.engines import Api, api_of
from mucudnn.plan import PlanEntry, PlanPiece
from mucudnn.problem import ALGORITHMS, ConvProblem, Direction, Layout, MathType

pytestmark = pytest.mark.gpu

SMALL = dict(c=16, input_size=(12, 12), k=24, filter_size=(3, 3), padding=(1, 1), stride=(1, 1),
             dilation=(1, 1), n=8)


def _problem(direction, **over):
    return ConvProblem(direction=direction, **{**SMALL, **over})


def _run(gpu, problem, buffers, algo, math=MathType.FMA, alpha=1.0, beta=0.0):
    from mucudnn.cudnn import ConvolutionCall
    cupy, cudnn, stream, handle = gpu
    call = ConvolutionCall(cudnn, problem, math)
    value = ALGORITHMS[problem.direction].index(algo)
    size = call.workspace_size(handle, value)
    ws = cupy.empty(max(size, 1), dtype="uint8")
    call.run(handle, value, *buffers.pointers(0), ws.data.ptr, size, beta=beta, alpha=alpha)
    stream.synchronize()


def _rel_error(cupy, got, ref):
    return float(cupy.linalg.norm(got.astype("float64") - ref) / cupy.linalg.norm(ref))


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("layout", [Layout.NCHW, Layout.NHWC])
def test_every_algorithm_matches_double_reference(gpu, direction, layout):
    """The bindings run each supported algorithm right (NCHW and NHWC, groups)."""
    from mucudnn.bench import KernelBuffers
    from mucudnn.errors import CudnnNotSupportedError
    from mucudnn.execute import double_reference
    cupy, cudnn, stream, handle = gpu
    problem = _problem(direction, layout=layout, groups=2)
    buffers = KernelBuffers.random(problem, cupy.random.default_rng(1))
    reference = double_reference(cudnn, handle, buffers, stream)
    ran = 0
    for algo in ALGORITHMS[direction]:
        buffers.output().fill(float("nan"))
        try:
            _run(gpu, problem, buffers, algo)
        except CudnnNotSupportedError:
            continue
        ran += 1
        assert _rel_error(cupy, buffers.output(), reference) < 1e-5, algo
    assert ran >= 2


def test_benchmarker_stores_every_algorithm(gpu, tmp_path):
    from mucudnn.bench import Benchmarker
    from mucudnn.store import open_store
    from mucudnn.timing import TimingMethod
    problem = _problem(Direction.FORWARD)
    with open_store(tmp_path / "s.sqlite") as store:
        bench = Benchmarker(store, TimingMethod(min_reps=3, max_reps=5), progress=False)
        assert bench.benchmark([(problem, [1, 2, 4, 8])]) == 4
        rows = store.get(bench.env.gpu, bench.env.cudnn, problem.key)
        assert {r.batch for r in rows} == {1, 2, 4, 8}
        legacy = {r.algo for r in rows if api_of(r.algo) is Api.LEGACY}
        assert legacy == set(ALGORITHMS[Direction.FORWARD])
        assert len(legacy) < len({r.algo for r in rows})  # engine configurations too
        ok = [r for r in rows if r.ok]
        assert ok and all(r.time_ms > 0 for r in ok)
        # a second run reuses the stored rows
        assert bench.benchmark([(problem, [1, 2, 4, 8])]) == 0


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("alpha,beta", [(1.0, 0.0), (0.5, 0.75), (2.0, 1.0)])
def test_micro_batched_plan_equals_undivided(gpu, direction, alpha, beta):
    """Plan pieces of mixed sizes and algorithms give the undivided result, for any alpha/beta."""
    from mucudnn.bench import KernelBuffers
    from mucudnn.execute import PlanExecutor, double_reference
    cupy, cudnn, stream, handle = gpu
    problem = _problem(direction)
    algos = {Direction.FORWARD: ("implicit_gemm", "implicit_precomp_gemm"),
             Direction.BACKWARD_DATA: ("algo_0", "algo_1"),
             Direction.BACKWARD_FILTER: ("algo_1", "algo_0")}[direction]
    pieces = (PlanPiece(4, algos[0], MathType.FMA), PlanPiece(1, algos[1], MathType.FMA),
              PlanPiece(3, algos[1], MathType.FMA))
    entry = PlanEntry(problem.key, problem.n, 64 << 20, 0.0, pieces)
    buffers = KernelBuffers.random(problem, cupy.random.default_rng(2))  # fresh inputs
    prior = buffers.output().astype("float64")
    reference = alpha * double_reference(cudnn, handle, buffers, stream) + beta * prior
    # the same algorithm undivided, with the same alpha/beta, as a second witness
    undivided = KernelBuffers(problem, buffers.x.copy(), buffers.w.copy(), buffers.y.copy())
    _run(gpu, problem, undivided, algos[1], alpha=alpha, beta=beta)
    undivided_error = _rel_error(cupy, undivided.output(), reference)
    ws = cupy.empty(entry.workspace, dtype="uint8")
    if beta == 0.0:
        buffers.output().fill(float("nan"))
    PlanExecutor(cudnn, handle, entry).run(buffers, ws.data.ptr, alpha=alpha, beta=beta)
    stream.synchronize()
    assert bool(cupy.isfinite(buffers.output()).all())
    plan_error = _rel_error(cupy, buffers.output(), reference)
    assert plan_error < 1e-5 and undivided_error < 1e-5, \
        f"plan error {plan_error:.3g}, undivided error {undivided_error:.3g}"
