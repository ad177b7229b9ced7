"""The benchmarker: every cuDNN algorithm of a kernel at every candidate micro-batch size.

Two APIs are timed (:class:`~mucudnn.engines.Api`): the legacy one, every algorithm and math type,
and the graph one, the engine configurations cuDNN's heuristics propose for each size
(:func:`mucudnn.cudnn.graph.candidate_configs`), stored under their engine names.

For each kernel the buffers are allocated once at its mini-batch size N and filled with random
normal data; a micro-batch of b samples is a pointer offset into them, and successive repetitions
rotate over the N // b disjoint slices, exactly as a plan's pieces run (so small micro-batches are
not timed on an L2-resident slice). Each (algorithm, math type) or engine configuration gets a
workspace of exactly the size cuDNN asks for. Results go to the store; a size whose rows of an API
are already there is not timed again in that API unless ``remeasure`` is set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from typing import Iterable, Sequence

from . import errors
from .engines import Api, api_of, is_transform_based
from .measurement import Measurement, Status
from .problem import ALGORITHMS, ConvProblem, DataType, Direction, Layout, MathType
from .timing import TimingMethod, do_bench

# Math types a kernel may be run with: the caller's (PyTorch sets the math type cuDNN's query
# reports back on its descriptor, so plans keep it), plus a second one where the caller allows it.
MATH_CANDIDATES: dict[MathType, tuple[MathType, ...]] = {
    MathType.FMA: (MathType.FMA,),
    MathType.DEFAULT: (MathType.DEFAULT,),
    MathType.TENSOR_OP: (MathType.TENSOR_OP,),
    MathType.TENSOR_OP_ALLOW_CONVERSION: (MathType.TENSOR_OP_ALLOW_CONVERSION, MathType.TENSOR_OP),
}


@dataclasses.dataclass(frozen=True)
class Environment:
    """Where measurements are valid: the GPU model and the cuDNN version."""

    gpu: str
    cudnn: int


def current_environment() -> Environment:
    """The GPU of the current CUDA device and the loaded cuDNN (raises if there is none)."""
    from .cudnn import get
    cupy = _cupy()
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"]
    return Environment(name.decode() if isinstance(name, bytes) else str(name), get().version)


def gpu_available() -> bool:
    try:
        cupy = _cupy()
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False


def _cupy():
    try:
        import cupy
    except ImportError:
        raise errors.LibraryNotFoundError(
            "CuPy is needed to benchmark on the GPU: pip install 'mucudnn[gpu]' (cupy-cuda13x)"
        ) from None
    return cupy


def random_buffer(cupy, count: int, dtype: DataType, rng):
    """Device buffer of ``count`` random normal values (never all zeros) of ``dtype``."""
    values = rng.standard_normal(count, dtype="float32")
    if dtype is DataType.FLOAT:
        return values
    if dtype is DataType.DOUBLE:
        return values.astype("float64")
    if dtype is DataType.HALF:
        return values.astype("float16")
    # bfloat16: the top 16 bits of the float32 pattern (CuPy has no bfloat16 dtype)
    return (values.view("uint32") >> 16).astype("uint16")


class KernelBuffers:
    """x, w, y (forward names) for ``problem`` at its N, as flat device arrays."""

    def __init__(self, problem: ConvProblem, x, w, y) -> None:
        self.problem = problem
        self.x_per_sample = _prod(problem.x_shape[1:])
        self.y_per_sample = _prod(problem.y_shape[1:])
        self.itemsize = problem.dtype.itemsize
        self.x, self.w, self.y = x, w, y

    @classmethod
    def random(cls, problem: ConvProblem, rng) -> "KernelBuffers":
        cupy = _cupy()
        return cls(problem,
                   random_buffer(cupy, problem.n * _prod(problem.x_shape[1:]), problem.dtype, rng),
                   random_buffer(cupy, _prod(problem.w_shape), problem.dtype, rng),
                   random_buffer(cupy, problem.n * _prod(problem.y_shape[1:]), problem.dtype, rng))

    def as_double(self) -> "KernelBuffers":
        """A float64 NCHW copy with the problem in double precision (cuDNN computes double only
        in NCHW): the reference for checks. :meth:`output_like` maps its output back."""
        p = self.problem
        problem = dataclasses.replace(p, dtype=DataType.DOUBLE, compute_type=DataType.DOUBLE,
                                      math=MathType.FMA, layout=Layout.NCHW)
        nchw = _to_nchw if p.layout is Layout.NHWC else (lambda flat, dims: flat)
        return KernelBuffers(problem, nchw(self.x.astype("float64"), p.x_shape),
                             nchw(self.w.astype("float64"), p.w_shape),
                             nchw(self.y.astype("float64"), p.y_shape))

    def output_like(self, reference: "KernelBuffers"):
        """``reference``'s output (an :meth:`as_double` copy) in this buffer's layout."""
        out = reference.output()
        if self.problem.layout is Layout.NHWC:
            dims = {Direction.FORWARD: self.problem.y_shape, Direction.BACKWARD_DATA:
                    self.problem.x_shape, Direction.BACKWARD_FILTER: self.problem.w_shape}
            out = _from_nchw(out, dims[self.problem.direction])
        return out

    def output(self):
        """The buffer the problem's direction writes."""
        return {Direction.FORWARD: self.y, Direction.BACKWARD_DATA: self.x,
                Direction.BACKWARD_FILTER: self.w}[self.problem.direction]

    def pointers(self, offset: int) -> tuple[int, int, int]:
        """(x, w, y) device pointers for a micro-batch starting at sample ``offset``."""
        return (self.x.data.ptr + offset * self.x_per_sample * self.itemsize,
                self.w.data.ptr,
                self.y.data.ptr + offset * self.y_per_sample * self.itemsize)


def _to_nchw(flat, dims: tuple[int, ...]):
    """Flat channels-last data of logical NC(D)HW ``dims`` -> flat channels-first."""
    last = flat.reshape(dims[0], *dims[2:], dims[1])
    return last.transpose(0, last.ndim - 1, *range(1, last.ndim - 1)).copy().ravel()


def _from_nchw(flat, dims: tuple[int, ...]):
    first = flat.reshape(dims)
    return first.transpose(0, *range(2, first.ndim), 1).copy().ravel()


def _prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def missing_apis(rows: Iterable[Measurement], batches: Sequence[int],
                 apis: Iterable[Api]) -> dict[int, frozenset[Api]]:
    """For each size of ``batches`` lacking stored ``rows`` of some of ``apis``: those APIs.

    A size counts as measured in an API once any row of that API exists for it, OK or not, so
    refused algorithms and engine configurations are not retried.
    """
    present = {(row.batch, api_of(row.algo)) for row in rows}
    missing = {}
    for b in batches:
        lacking = frozenset(api for api in apis if (b, api) not in present)
        if lacking:
            missing[b] = lacking
    return missing


def backward_filter_beta(problem: ConvProblem, full_n: int) -> float:
    """beta to time ``problem`` (a micro-batch of a kernel run at ``full_n``) with.

    In a plan, every backward-filter piece after the first accumulates (beta = 1), which can cost
    more than beta = 0: micro-batches are timed the way they will mostly run.
    """
    return 1.0 if problem.direction is Direction.BACKWARD_FILTER and problem.n < full_n else 0.0


CUT_SHORT_NOTE = "timed once: over {factor:g}x a configuration with no more workspace"


class Frontier:
    """What one micro-batch size of one kernel has timed so far in one API, and so the cutoff past
    which another configuration is dominated: slower than ``factor`` times one that needs no more
    workspace, it is never in a plan (the faster one fits every limit it fits), and its probe is
    enough. FFT/Winograd rows set no cutoff: ``tune --precise`` drops them, and what they would
    dominate must then stand on a full timing. ``factor`` None: time everything fully."""

    def __init__(self, factor: float | None) -> None:
        self.factor = factor
        self._timed: list[tuple[int, float]] = []  # (workspace, time_ms) of full timings

    def cutoff_ms(self, workspace: int) -> float | None:
        times = [t for w, t in self._timed if w <= workspace]
        return self.factor * min(times) if self.factor is not None and times else None

    def add(self, row: Measurement, timing) -> Measurement:
        """Count ``row``, just measured by ``timing``, as a possible dominator; returns it."""
        if not timing.cut_short and not is_transform_based(row):
            self._timed.append((row.workspace, row.time_ms))
        return row

    def note(self, timing, note: str = "") -> str:
        """``note`` plus the cut-short mark when ``timing`` stopped at the probe."""
        if not timing.cut_short:
            return note
        mark = CUT_SHORT_NOTE.format(factor=self.factor)
        return f"{note}; {mark}" if note else mark


class Benchmarker:
    """Measures kernels into a store. One instance per process and device.

    ``max_engine_configs`` caps the graph-API configurations taken from heuristics mode A at each
    size (the fallback ones are all timed).
    """

    def __init__(self, store, method: TimingMethod = TimingMethod(), seed: int = 0,
                 progress: bool = True, max_engine_configs: int = 8) -> None:
        from .cudnn import get
        cupy = _cupy()
        self.cupy = cupy
        self.store = store
        self.method = method
        self.progress = progress
        self.max_engine_configs = max_engine_configs
        self.cudnn = get()
        self.env = current_environment()
        # CuPy's fills and frees run on this stream too (see measure), in order with cuDNN's work
        self.stream = cupy.cuda.Stream()
        self.handle = self.cudnn.handle(self.stream.ptr)
        self.rng = cupy.random.default_rng(seed)

    def missing(self, problem: ConvProblem, batches: Sequence[int],
                apis: Iterable[Api]) -> dict[int, frozenset[Api]]:
        """The sizes of ``batches`` the store lacks in some of ``apis``, with those APIs."""
        rows = self.store.get(self.env.gpu, self.env.cudnn, problem.key, batches=batches)
        return missing_apis(rows, batches, apis)

    def benchmark(self, problems: Sequence[tuple[ConvProblem, Sequence[int]]],
                  remeasure: bool = False, apis: Iterable[Api] = frozenset(Api)) -> int:
        """Measure each (problem at its N, micro-batch sizes) in ``apis``; returns how many sizes
        were timed."""
        apis = frozenset(apis)
        todo = []
        for problem, batches in problems:
            wanted = {b: apis for b in batches} if remeasure else \
                self.missing(problem, batches, apis)
            if wanted:
                todo.append((problem, wanted))
        total = sum(len(wanted) for _, wanted in todo)
        bar = _progress(total, self.progress)
        for problem, wanted in todo:
            by_apis: dict[frozenset[Api], list[int]] = {}
            for b, lacking in wanted.items():
                by_apis.setdefault(lacking, []).append(b)
            for lacking, sizes in by_apis.items():
                rows = self.measure(problem, sizes, bar, lacking)
                self.store.put(self.env.gpu, self.env.cudnn, rows)
        bar.close()
        return total

    def measure(self, problem: ConvProblem, batches: Sequence[int], bar=None,
                apis: Iterable[Api] = frozenset(Api)) -> list[Measurement]:
        """Measurements of ``problem`` at each size in ``batches`` (≤ problem.n): every algorithm
        and math type of the legacy API, the engine configurations worth timing of the graph API,
        as ``apis`` asks."""
        with self.stream:
            return self._measure(problem, batches, bar, frozenset(apis))

    def _measure(self, problem: ConvProblem, batches: Sequence[int], bar,
                 apis: frozenset[Api]) -> list[Measurement]:
        # At the kernel's N, whichever sizes are missing: slices and beta are those of its plans.
        buffers = KernelBuffers.random(problem.with_n(max(problem.n, *batches)), self.rng)
        rows: list[Measurement] = []
        try:
            for b in sorted(batches):
                # each API's rows are pruned by its own: `tune --api legacy` must not lack any
                frontiers = {api: Frontier(self.method.dominated_factor) for api in Api}
                if bar is not None:
                    bar.set_postfix_str(f"{problem.direction.value} c={problem.c} "
                                        f"k={problem.k} in={problem.input_size} b={b}")
                if Api.LEGACY in apis:
                    for math in MATH_CANDIDATES[problem.math]:
                        rows.extend(self._measure_size(problem.with_n(b), math, buffers,
                                                       frontiers[Api.LEGACY]))
                if Api.GRAPH in apis:
                    rows.extend(self._measure_engines(problem.with_n(b), buffers,
                                                      frontiers[Api.GRAPH]))
                if bar is not None:
                    bar.update(1)
        finally:
            del buffers
            self.stream.synchronize()
            self.cupy.get_default_memory_pool().free_all_blocks()
        return rows

    def _measure_size(self, problem: ConvProblem, math: MathType, buffers: KernelBuffers,
                      frontier: Frontier) -> list[Measurement]:
        from .cudnn import ConvolutionCall
        call = ConvolutionCall(self.cudnn, problem, math)
        slices = max(1, buffers.problem.n // problem.n)
        beta = backward_filter_beta(problem, buffers.problem.n)
        rows = []
        for algo_value, algo in enumerate(ALGORITHMS[problem.direction]):
            def row(status: Status, time_ms: float = 0.0, workspace: int = 0, note: str = ""):
                return Measurement(problem.key, problem.n, algo, math, time_ms, workspace,
                                   status, note)
            try:
                ws_size = call.workspace_size(self.handle, algo_value)
            except errors.CudnnNotSupportedError as exc:
                rows.append(row(Status.NOT_SUPPORTED, note=exc.text))
                continue
            except errors.CudnnError as exc:
                rows.append(row(Status.FAILED, note=str(exc)))
                continue
            try:
                workspace = self.cupy.empty(max(ws_size, 1), dtype="uint8")
            except self.cupy.cuda.memory.OutOfMemoryError:
                rows.append(row(Status.FAILED, workspace=ws_size, note="out of GPU memory"))
                continue

            def run(i: int) -> None:
                x, w, y = buffers.pointers((i % slices) * problem.n)
                call.run(self.handle, algo_value, x, w, y, workspace.data.ptr, ws_size, beta=beta)

            try:
                timing = do_bench(run, self.stream, self.method, frontier.cutoff_ms(ws_size))
            except errors.CudnnNotSupportedError as exc:
                rows.append(row(Status.NOT_SUPPORTED, workspace=ws_size, note=exc.text))
            except errors.CudnnError as exc:
                rows.append(row(Status.FAILED, workspace=ws_size, note=str(exc)))
            else:
                rows.append(frontier.add(
                    row(Status.OK, timing.median_ms, ws_size, frontier.note(timing)), timing))
            finally:
                workspace = None  # noqa: F841 - return the block to the pool before the next
        return rows

    def _measure_engines(self, problem: ConvProblem, buffers: KernelBuffers,
                         frontier: Frontier) -> list[Measurement]:
        """The graph API's engine configurations worth timing at ``problem.n``, one row each."""
        from .cudnn.graph import ConvolutionGraph, byte_alignment, candidate_configs
        slices = max(1, buffers.problem.n // problem.n)
        # The graph declares its tensors' alignment: the one every slice's pointers have.
        pointers = [p for i in range(slices) for p in buffers.pointers(i * problem.n)]
        try:
            graph = ConvolutionGraph(self.cudnn, self.handle, problem,
                                     beta=backward_filter_beta(problem, buffers.problem.n),
                                     alignment=byte_alignment(*pointers))
        except errors.CudnnError as exc:
            warnings.warn(f"{problem.key} b={problem.n}: cuDNN's graph API refuses the "
                          f"convolution ({exc}); no engine configurations timed", stacklevel=2)
            return []
        with graph:
            try:
                candidates = candidate_configs(graph, self.max_engine_configs)
            except errors.CudnnError as exc:
                warnings.warn(f"{problem.key} b={problem.n}: no engine configurations from "
                              f"cuDNN's heuristics ({exc})", stacklevel=2)
                return []
            return [self._time_engine(graph, candidate, buffers, slices, frontier)
                    for candidate in candidates]

    def _time_engine(self, graph, candidate, buffers: KernelBuffers, slices: int,
                     frontier: Frontier) -> Measurement:
        problem = graph.problem

        def row(status: Status, time_ms: float = 0.0, workspace: int = 0,
                note: str = "") -> Measurement:
            return Measurement(problem.key, problem.n, candidate.name, problem.math, time_ms,
                               workspace, status, note)

        try:  # from the name, as a plan's engine piece will be built
            plan = graph.plan_from_name(candidate.config)
        except errors.CudnnError as exc:
            return row(Status.NOT_SUPPORTED, note=str(exc))
        with plan, contextlib.ExitStack() as packs:
            try:
                workspace = self.cupy.empty(max(plan.workspace_size, 1), dtype="uint8")
            except self.cupy.cuda.memory.OutOfMemoryError:
                return row(Status.FAILED, workspace=plan.workspace_size, note="out of GPU memory")
            try:
                # one variant pack per slice, built before timing as the legacy calls need none
                slice_packs = [packs.enter_context(plan.variant_pack(
                    *buffers.pointers(i * problem.n), workspace.data.ptr)) for i in range(slices)]
                timing = do_bench(lambda i: plan.execute(slice_packs[i % slices]), self.stream,
                                  self.method, frontier.cutoff_ms(plan.workspace_size))
            except errors.CudnnNotSupportedError as exc:
                return row(Status.NOT_SUPPORTED, workspace=plan.workspace_size, note=exc.text)
            except errors.CudnnError as exc:
                return row(Status.FAILED, workspace=plan.workspace_size, note=str(exc))
            return frontier.add(row(Status.OK, timing.median_ms, plan.workspace_size,
                                    frontier.note(timing, candidate.note_text)), timing)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, unit="size", desc="benchmark", disable=not enabled or total == 0,
                file=sys.stderr, dynamic_ncols=True)
