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

Sizes are timed largest first, and at each size every configuration's workspace is asked before
any is timed. A :class:`Pruning` leaves untimed what cannot change a plan within a workspace limit
(exact), and with ``quick`` the sizes that cannot beat the larger ones under the model that a
kernel's best per-sample time never improves as the micro-batch shrinks (docs/store.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from typing import Iterable, Sequence

from . import errors
from .engines import Api, api_of, is_transform_based
from .environment import (Environment, cupy_module as _cupy, current_environment,  # noqa: F401
                          gpu_available)
from .measurement import (NOT_TIMED, OVER_LIMIT, OVER_LIMIT_NOTE, QUICK, QUICK_NOTE,  # noqa: F401
                          Measurement, Status, is_not_timed)
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


def missing_apis(rows: Iterable[Measurement], batches: Sequence[int], apis: Iterable[Api],
                 problem: ConvProblem | None = None,
                 pruning: "Pruning | None" = None) -> dict[int, frozenset[Api]]:
    """For each size of ``batches`` lacking stored ``rows`` of some of ``apis``: those APIs.

    A size counts as measured in an API once any row of that API exists for it, OK or not, so
    refused algorithms and engine configurations are not retried; except where rows a bench under
    another :class:`Pruning` left untimed are needed now (see :meth:`Pruning.still_valid`).
    """
    pruning = pruning or Pruning()
    groups: dict[tuple[int, Api], list[Measurement]] = {}
    for row in rows:
        groups.setdefault((row.batch, api_of(row.algo)), []).append(row)
    missing = {}
    for b in batches:
        lacking = frozenset(api for api in apis if (b, api) not in groups
                            or not pruning.still_valid(groups[(b, api)], problem))
        if lacking:
            missing[b] = lacking
    return missing




@dataclasses.dataclass(frozen=True)
class Pruning:
    """What a bench leaves untimed, for plans made by ``tune`` with the same limit.

    ``limit`` (bytes, None: none): a configuration needing more workspace than a piece of its size
    may use in a WR plan within ``limit`` is never timed (exact: ``best_plan`` and the plan's
    Pareto front within ``limit`` read only pieces within it). With ``borrow_output`` a piece of
    ``b`` samples may use ``max(limit, (N - b) * written_sample_bytes)`` (``best_plan``'s
    borrowing), so that is its bound.

    ``quick``: sizes are timed from N downward, and a kernel's smaller sizes are skipped in an API
    once :meth:`SizeGate.stop` holds: exact when a kernel's best per-sample time (over its
    configurations, no limit) never improves as the micro-batch shrinks, which is the usual case
    and not guaranteed.
    """

    limit: int | None = None
    borrow_output: bool = False
    quick: bool = False

    def usable_workspace(self, problem: ConvProblem, b: int) -> int | None:
        """The most workspace a piece of ``b`` samples of ``problem`` (at its N) may need in a
        plan within the limit; None: any."""
        if self.limit is None:
            return None
        if self.borrow_output:
            return max(self.limit, (problem.n - b) * problem.written_sample_bytes)
        return self.limit

    def fits(self, problem: ConvProblem, row: Measurement) -> bool:
        """Whether ``row`` (of ``problem``) may be a piece of a plan within the limit."""
        bound = self.usable_workspace(problem, row.batch)
        return bound is None or row.workspace <= bound

    @property
    def request(self) -> str:
        limit = "no limit" if self.limit is None else f"limit {self.limit} bytes"
        return limit + (", borrowing output" if self.borrow_output else "")

    def still_valid(self, group: Sequence[Measurement], problem: ConvProblem | None) -> bool:
        """Whether the stored rows of one size and API serve this bench: not when a row over the
        limit of an earlier bench fits this one's, nor when quick skipped the size and this bench
        is not quick with the same limit."""
        if all(row.note.startswith(QUICK) for row in group):
            return self.quick and all(row.note.endswith(f"({self.request})") for row in group)
        for row in group:
            if row.note.startswith(OVER_LIMIT):
                bound = None if problem is None else self.usable_workspace(problem, row.batch)
                if bound is None or row.workspace <= bound:
                    return False
        return True


class SizeGate:
    """What one size ``b`` of a kernel in one API asks of each configuration, once its workspace
    is known: whether to time it (:meth:`skip`, then :meth:`skip_late` just before its turn), in
    what order (:meth:`fits` first), whether a probe is all it needs (:meth:`probe_only`); and,
    for quick, whether the kernel's smaller sizes can be skipped (:meth:`stop`). ``rows``: the
    API's rows of the kernel at larger sizes (up to N).

    Quick's rule (exact when a kernel's best per-sample time, over all its configurations and no
    limit, never improves as the micro-batch shrinks). Any plan takes at least N times the
    smallest per-sample time of its pieces. Pieces of the sizes timed so far that fit give at
    least P, the best per-sample time among them (``best``); pieces below ``b`` at least, by the
    model, B, the best per-sample time of any configuration at ``b``. So once the best plan of the
    sizes timed is as fast as N * P and B >= P, smaller sizes cannot beat it (equal time at best).
    Configurations within the limit at ``b`` are all >= P per sample; those over it are probed
    (one call after warm-up, cut off at P * b) only to learn whether one is faster, and only where
    the plan already is as fast as N * P; none is stored as a timing (their rows are over-limit
    markers, as without quick), and after the first one faster the others are not probed.
    """

    def __init__(self, problem: ConvProblem, b: int, pruning: Pruning,
                 rows: Sequence[Measurement] = ()) -> None:
        self.problem, self.b, self.pruning = problem, b, pruning
        self.bound = pruning.usable_workspace(problem, b)
        self.rows = list(rows)
        fitting = [row.time_ms / row.batch for row in self.rows
                   if row.ok and pruning.fits(problem, row)]
        self.best = min(fitting, default=None)
        self.faster_over_limit = False
        self._plan_fast: bool | None = None

    @property
    def over_limit_note(self) -> str:
        return OVER_LIMIT_NOTE.format(bound=self.bound)

    def fits(self, workspace: int) -> bool:
        return self.bound is None or workspace <= self.bound

    def probe_only(self, workspace: int) -> bool:
        return self.pruning.quick and not self.fits(workspace)

    def skip(self, workspace: int) -> str:
        """Empty to time a configuration needing ``workspace`` bytes, else the note of its row."""
        if self.pruning.quick or self.fits(workspace):
            return ""
        return self.over_limit_note

    def skip_late(self, workspace: int) -> str:
        """:meth:`skip`, asked again once every configuration within the limit at ``b`` is
        timed: quick probes those over it only where they can decide :meth:`stop`."""
        if self.probe_only(workspace) and (self.faster_over_limit or not self._fast_plan()):
            return self.over_limit_note
        return self.skip(workspace)

    def cutoff_ms(self, workspace: int) -> float | None:
        """Quick's cutoff for a configuration over the limit: P * b (see the class doc)."""
        if self.probe_only(workspace) and self.best is not None:
            return self.best * self.b
        return None

    def probed(self, time_ms: float) -> None:
        """Count the probe of a configuration over the limit, taking ``time_ms``."""
        if self.best is None or time_ms <= self.best * self.b:
            self.faster_over_limit = True

    def add(self, row: Measurement) -> Measurement:
        """Count ``row``, just timed at this size; returns it."""
        self.rows.append(row)
        self._plan_fast = None
        if row.ok and self.fits(row.workspace):
            per_sample = row.time_ms / self.b
            self.best = per_sample if self.best is None else min(self.best, per_sample)
        return row

    def _fast_plan(self) -> bool:
        """Whether the best plan within the limit of the sizes timed (>= ``b``) takes N * P."""
        if self._plan_fast is None:
            from .errors import MucudnnError
            from .optimizer import Policy, best_plan
            pruning, problem = self.pruning, self.problem
            try:
                plan_ms = best_plan(self.rows, problem.n, pruning.limit, Policy.ALL,
                                    problem.written_sample_bytes if pruning.borrow_output else 0
                                    ).time_ms
            except (MucudnnError, ValueError):  # nothing fits yet, or unusable times
                plan_ms = None
            # the sums of a plan round
            self._plan_fast = plan_ms is not None and self.best is not None and \
                plan_ms <= problem.n * self.best * (1 + 1e-9)
        return self._plan_fast

    def stop(self) -> bool:
        """Quick, once every configuration at ``b`` had its turn: whether no size below ``b``
        can make a faster plan within the limit (under the model of the class doc)."""
        return self.pruning.quick and not self.faster_over_limit and self._fast_plan()


def measure_kernel(problem: ConvProblem, wanted: dict[int, frozenset[Api]],
                   stored: Sequence[Measurement], pruning: Pruning, time_size,
                   done=lambda b: None) -> tuple[list[Measurement], int]:
    """Rows of ``problem`` (at its N) for each size of ``wanted`` in its APIs, largest first, and
    how many sizes were timed.

    ``time_size(b, api, gate)`` measures size ``b`` in ``api`` as its :class:`SizeGate` says:
    each configuration's workspace first, then those that fit timed first, each timed row passed
    to ``gate.add``; one that ``gate.skip`` (or, just before its turn, ``gate.skip_late``) names
    gets an untimed row with that note, as does one that ``gate.probe_only`` names after its
    probe (``gate.probed``). ``stored`` are the kernel's rows already in the store (quick reads
    them too). ``done(b)`` follows each size.
    """
    rows: list[Measurement] = []
    stopped: dict[Api, tuple[int, Measurement]] = {}  # api -> (size, fastest row there)
    timed = 0

    def gate(b: int, api: Api) -> SizeGate:
        larger = [row for row in [*stored, *rows]
                  if api_of(row.algo) is api and b < row.batch <= problem.n]
        return SizeGate(problem, b, pruning, larger)

    for b in sorted(wanted, reverse=True):
        any_timed = False
        gates = {}
        for api in sorted(wanted[b]):
            if api in stopped:
                size, fastest = stopped[api]
                rows.append(Measurement(problem.key, b, fastest.algo, fastest.math, 0.0, 0,
                                        Status.NOT_SUPPORTED,
                                        QUICK_NOTE.format(size=size, request=pruning.request)))
            else:
                gates[api] = gate(b, api)
                rows.extend(time_size(b, api, gates[api]))
                any_timed = True
        timed += any_timed
        done(b)
        for api, done_gate in gates.items():
            if done_gate.stop():
                at_b = [row for row in rows if row.batch == b and api_of(row.algo) is api
                        and row.ok]
                stopped[api] = (b, min(at_b, key=lambda row: (row.time_ms, row.algo)))
    return rows, timed


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
    size (the fallback ones are all timed). ``pruning`` says what is left untimed (a workspace
    limit, ``quick``). ``events(name, value)``, if given, hears of the work as it goes:
    ``("todo", sizes)`` when :meth:`benchmark` knows how many sizes it will measure, ``("size",
    key)`` after each, ``("kernel", problem)`` once a kernel's rows are committed to the store
    (how a worker of :mod:`mucudnn.multigpu` reports to the one progress display).
    """

    def __init__(self, store, method: TimingMethod = TimingMethod(), seed: int = 0,
                 progress: bool = True, max_engine_configs: int = 8,
                 pruning: Pruning = Pruning(), events=None) -> None:
        from .cudnn import get
        cupy = _cupy()
        self.cupy = cupy
        self.store = store
        self.method = method
        self.progress = progress
        self.max_engine_configs = max_engine_configs
        self.pruning = pruning
        self.events = events or (lambda name, value: None)
        # do_bench calls, all sizes and kernels: timings, and probes (quick, over the limit)
        self.timings = self.probes = 0
        # the interquartile range of each row of the last measure_kernel that was timed more
        # than once (keyed by the row; the store keeps it beside the median)
        self.spreads: dict[Measurement, float | None] = {}
        self.cudnn = get()
        self.env = current_environment()
        # CuPy's fills and frees run on this stream too (see measure), in order with cuDNN's work
        self.stream = cupy.cuda.Stream()
        self.handle = self.cudnn.handle(self.stream.ptr)
        self.rng = cupy.random.default_rng(seed)

    def stored(self, problem: ConvProblem, batches: Sequence[int]) -> list[Measurement]:
        return self.store.get(self.env.gpu, self.env.cudnn, problem.key, batches=batches)

    def missing(self, problem: ConvProblem, batches: Sequence[int],
                apis: Iterable[Api]) -> dict[int, frozenset[Api]]:
        """The sizes of ``batches`` the store lacks in some of ``apis``, with those APIs."""
        return missing_apis(self.stored(problem, batches), batches, apis, problem, self.pruning)

    def benchmark(self, problems: Sequence[tuple[ConvProblem, Sequence[int]]],
                  remeasure: bool = False, apis: Iterable[Api] = frozenset(Api)) -> int:
        """Measure each (problem at its N, micro-batch sizes) in ``apis``; returns how many sizes
        were timed."""
        apis = frozenset(apis)
        todo = []
        for problem, batches in problems:
            stored = [] if remeasure else self.stored(problem, batches)
            wanted = {b: apis for b in batches} if remeasure else \
                missing_apis(stored, batches, apis, problem, self.pruning)
            if wanted:
                todo.append((problem, wanted, stored))
        sizes = sum(len(wanted) for _, wanted, _ in todo)
        self.events("todo", sizes)
        bar = _progress(sizes, self.progress)
        timed = 0
        for problem, wanted, stored in todo:
            rows, count = self.measure_kernel(problem, wanted, stored, bar)
            spreads = {row: self.spreads.pop(row) for row in rows if row in self.spreads}
            # one write per kernel: a process killed while measuring loses that kernel only
            self.store.put(self.env.gpu, self.env.cudnn, rows, iqr_ms=spreads)
            self.events("kernel", problem)
            timed += count
        bar.close()
        return timed

    def measure(self, problem: ConvProblem, batches: Sequence[int], bar=None,
                apis: Iterable[Api] = frozenset(Api)) -> list[Measurement]:
        """Measurements of ``problem`` at each size in ``batches`` (≤ problem.n): every algorithm
        and math type of the legacy API, the engine configurations worth timing of the graph API,
        as ``apis`` asks."""
        return self.measure_kernel(problem, {b: frozenset(apis) for b in batches}, [], bar)[0]

    def measure_kernel(self, problem: ConvProblem, wanted: dict[int, frozenset[Api]],
                       stored: Sequence[Measurement] = (),
                       bar=None) -> tuple[list[Measurement], int]:
        """:func:`measure_kernel` on this GPU: rows for each size of ``wanted`` in its APIs, and
        how many sizes were timed."""
        self.spreads = {}
        with self.stream:
            # At the kernel's N, whichever sizes are missing: slices and beta are its plans'.
            buffers = KernelBuffers.random(problem.with_n(max(problem.n, *wanted)), self.rng)
            try:
                def time_size(b: int, api: Api, gate: SizeGate) -> list[Measurement]:
                    # each API's rows are pruned by its own: `tune --api legacy` must not lack any
                    frontier = Frontier(self.method.dominated_factor)
                    if bar is not None:
                        bar.set_postfix_str(f"{problem.direction.value} c={problem.c} "
                                            f"k={problem.k} in={problem.input_size} b={b}")
                    if api is Api.GRAPH:
                        return self._measure_engines(problem.with_n(b), buffers, frontier, gate)
                    return self._measure_size(problem.with_n(b), buffers, frontier, gate)

                def done(b: int) -> None:
                    if bar is not None:
                        bar.update(1)
                    self.events("size", problem.key)

                return measure_kernel(problem, wanted, stored, self.pruning, time_size, done)
            finally:
                del buffers
                self.stream.synchronize()
                self.cupy.get_default_memory_pool().free_all_blocks()

    def _measure_size(self, problem: ConvProblem, buffers: KernelBuffers, frontier: Frontier,
                      gate: SizeGate | None = None) -> list[Measurement]:
        """Every legacy algorithm and math type at ``problem.n``: workspaces first, then the
        timings, those within the limit first (``gate``)."""
        from .cudnn import ConvolutionCall
        gate = gate or SizeGate(problem, problem.n, Pruning())
        slices = max(1, buffers.problem.n // problem.n)
        beta = backward_filter_beta(problem, buffers.problem.n)
        rows, queried = [], []
        for math in MATH_CANDIDATES[problem.math]:
            call = ConvolutionCall(self.cudnn, problem, math)
            for algo_value, algo in enumerate(ALGORITHMS[problem.direction]):
                def row(status: Status, time_ms: float = 0.0, workspace: int = 0, note: str = "",
                        algo=algo, math=math) -> Measurement:
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
                if gate.skip(ws_size):
                    rows.append(row(Status.NOT_SUPPORTED, workspace=ws_size,
                                    note=gate.skip(ws_size)))
                    continue
                queried.append((call, algo_value, ws_size, row))
        queried.sort(key=lambda item: not gate.fits(item[2]))  # stable: algorithm order
        for call, algo_value, ws_size, row in queried:
            if gate.skip_late(ws_size):
                rows.append(row(Status.NOT_SUPPORTED, workspace=ws_size,
                                note=gate.skip_late(ws_size)))
                continue
            try:
                workspace = self.cupy.empty(max(ws_size, 1), dtype="uint8")
            except self.cupy.cuda.memory.OutOfMemoryError:
                rows.append(row(Status.FAILED, workspace=ws_size, note="out of GPU memory"))
                continue

            def run(i: int, call=call, algo_value=algo_value, ws_size=ws_size) -> None:
                x, w, y = buffers.pointers((i % slices) * problem.n)
                call.run(self.handle, algo_value, x, w, y, workspace.data.ptr, ws_size, beta=beta)

            try:
                timing = self._time(run, ws_size, frontier, gate)
            except errors.CudnnNotSupportedError as exc:
                rows.append(row(Status.NOT_SUPPORTED, workspace=ws_size, note=exc.text))
            except errors.CudnnError as exc:
                rows.append(row(Status.FAILED, workspace=ws_size, note=str(exc)))
            else:
                rows.append(row(Status.NOT_SUPPORTED, workspace=ws_size, note=gate.over_limit_note)
                            if timing is None else self._with_spread(gate.add(frontier.add(
                                row(Status.OK, timing.median_ms, ws_size, frontier.note(timing)),
                                timing)), timing))
            finally:
                workspace = None  # noqa: F841 - return the block to the pool before the next
        return rows

    def _with_spread(self, row: Measurement, timing) -> Measurement:
        """``row``, timed by ``timing``, with its spread kept for the store (:attr:`spreads`)."""
        self.spreads[row] = timing.iqr_ms
        return row

    def _time(self, run, workspace: int, frontier: Frontier, gate: SizeGate):
        """do_bench of ``run``, needing ``workspace`` bytes; None after a probe only (the gate
        has it)."""
        if gate.probe_only(workspace):
            self.probes += 1
            timing = do_bench(run, self.stream, self.method, gate.cutoff_ms(workspace),
                              probe_only=True)
            gate.probed(timing.median_ms)
            return None
        self.timings += 1
        return do_bench(run, self.stream, self.method, frontier.cutoff_ms(workspace))

    def _measure_engines(self, problem: ConvProblem, buffers: KernelBuffers,
                         frontier: Frontier, gate: SizeGate | None = None) -> list[Measurement]:
        """The graph API's engine configurations worth timing at ``problem.n``, one row each:
        every execution plan (and so its workspace) first, then the timings, those within the
        limit first (``gate``)."""
        from .cudnn.graph import ConvolutionGraph, byte_alignment, candidate_configs
        gate = gate or SizeGate(problem, problem.n, Pruning())
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
            rows, planned = [], []
            with contextlib.ExitStack() as plans:
                for candidate in candidates:
                    row = functools.partial(self._engine_row, problem, candidate)
                    try:  # from the name, as a plan's engine piece will be built
                        plan = plans.enter_context(graph.plan_from_name(candidate.config))
                    except errors.CudnnError as exc:
                        rows.append(row(Status.NOT_SUPPORTED, note=str(exc)))
                        continue
                    if gate.skip(plan.workspace_size):
                        rows.append(self._untimed(problem, candidate, plan, gate.skip))
                        continue
                    planned.append((candidate, plan))
                planned.sort(key=lambda item: not gate.fits(item[1].workspace_size))
                for candidate, plan in planned:
                    if gate.skip_late(plan.workspace_size):
                        rows.append(self._untimed(problem, candidate, plan, gate.skip_late))
                        continue
                    rows.append(self._time_engine(problem, plan, candidate, buffers, slices,
                                                  frontier, gate))
            return rows

    def _untimed(self, problem: ConvProblem, candidate, plan, skip) -> Measurement:
        """The row of an engine configuration left untimed: ``skip``'s note, then its
        numerical notes."""
        notes = candidate.note_text
        return self._engine_row(problem, candidate, Status.NOT_SUPPORTED, 0.0, plan.workspace_size,
                                skip(plan.workspace_size) + (f"; {notes}" if notes else ""))

    @staticmethod
    def _engine_row(problem: ConvProblem, candidate, status: Status, time_ms: float = 0.0,
                    workspace: int = 0, note: str = "") -> Measurement:
        return Measurement(problem.key, problem.n, candidate.name, problem.math, time_ms,
                           workspace, status, note)

    def _time_engine(self, problem: ConvProblem, plan, candidate, buffers: KernelBuffers,
                     slices: int, frontier: Frontier, gate: SizeGate) -> Measurement:
        """One engine configuration's ``plan`` timed at ``problem.n`` (a micro-batch)."""
        row = functools.partial(self._engine_row, problem, candidate)
        with contextlib.ExitStack() as packs:
            try:
                workspace = self.cupy.empty(max(plan.workspace_size, 1), dtype="uint8")
            except self.cupy.cuda.memory.OutOfMemoryError:
                return row(Status.FAILED, workspace=plan.workspace_size, note="out of GPU memory")
            try:
                # one variant pack per slice, built before timing as the legacy calls need none
                slice_packs = [packs.enter_context(plan.variant_pack(
                    *buffers.pointers(i * problem.n), workspace.data.ptr)) for i in range(slices)]
                timing = self._time(lambda i: plan.execute(slice_packs[i % slices]),
                                    plan.workspace_size, frontier, gate)
            except errors.CudnnNotSupportedError as exc:
                return row(Status.NOT_SUPPORTED, workspace=plan.workspace_size, note=exc.text)
            except errors.CudnnError as exc:
                return row(Status.FAILED, workspace=plan.workspace_size, note=str(exc))
            if timing is None:
                return self._untimed(problem, candidate, plan, lambda _: gate.over_limit_note)
            return self._with_spread(gate.add(frontier.add(
                row(Status.OK, timing.median_ms, plan.workspace_size,
                    frontier.note(timing, candidate.note_text)), timing)), timing)


def _progress(total: int | None, enabled: bool):
    """A progress bar (none when not enabled or nothing is to be done); ``total`` None: known
    later (the bar's ``total`` set as it becomes known)."""
    from tqdm import tqdm
    return tqdm(total=total, unit="size", desc="benchmark", disable=not enabled or total == 0,
                file=sys.stderr, dynamic_ncols=True)
