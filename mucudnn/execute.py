"""Running a plan entry through the bindings: micro-batches in sequence on one stream.

This is what the shim does inside a framework, done from Python so the tuner's predictions and the
plans' numerics can be checked on the GPU without a framework (benchmarks/validate_tuner.py).
Legacy pieces run through ``cudnnConvolution*``, engine pieces through the graph API.
"""

from __future__ import annotations

from .cudnn import ConvolutionCall
from .engines import Api, parse_engine_name
from .errors import MucudnnError
from .plan import PlanEntry
from .problem import ALGORITHMS, ConvProblem, Direction, MathType, algorithm_value


class _LegacyStep:
    """One legacy piece: an algorithm of the piece's ConvolutionCall."""

    def __init__(self, handle, call: ConvolutionCall, algo: int) -> None:
        self.handle, self.call, self.algo = handle, call, algo

    def run(self, pointers, workspace_ptr: int, workspace_size: int, alpha: float,
            beta: float) -> None:
        self.call.run(self.handle, self.algo, *pointers, workspace_ptr, workspace_size, beta=beta,
                      alpha=alpha)

    def close(self) -> None:
        """Nothing to release early: the legacy descriptors go with the call."""


class _EngineStep:
    """One engine piece. The graph bakes alpha, beta and the pointers' alignment in, so a graph
    and plan are built for each combination the piece runs with, on first use."""

    def __init__(self, cudnn, handle, problem: ConvProblem, name: str) -> None:
        self.cudnn, self.handle, self.problem, self.name = cudnn, handle, problem, name
        self.config = parse_engine_name(name)
        self._plans: dict[tuple[float, float, int], tuple] = {}

    def run(self, pointers, workspace_ptr: int, workspace_size: int, alpha: float,
            beta: float) -> None:
        from .cudnn.graph import byte_alignment
        key = (alpha, beta, byte_alignment(*pointers))
        if key not in self._plans:
            self._plans[key] = self._build(*key)
        _, plan = self._plans[key]
        if plan.workspace_size > workspace_size:  # the graph API would overrun the buffer
            raise MucudnnError(f"engine {self.name} at b={self.problem.n} needs "
                               f"{plan.workspace_size} bytes of workspace, the plan gives "
                               f"{workspace_size}")
        plan.run(*pointers, workspace_ptr)

    def _build(self, alpha: float, beta: float, alignment: int) -> tuple:
        from .cudnn.graph import ConvolutionGraph
        graph = ConvolutionGraph(self.cudnn, self.handle, self.problem, alpha, beta, alignment)
        try:
            return graph, graph.plan_from_name(self.config)
        except BaseException:
            graph.close()
            raise

    def close(self) -> None:
        for graph, plan in self._plans.values():
            plan.close()
            graph.close()
        self._plans.clear()


class PlanExecutor:
    """Runs one :class:`PlanEntry` on buffers shaped for its N (a :class:`bench.KernelBuffers`).

    Every piece runs in the caller's workspace; an entry with a borrowing piece (``:out``, whose
    workspace the shim takes from the output, shim/src/exec.c) is refused with
    :class:`MucudnnError`, since running it here would check another plan than the shim runs.
    ``close()`` (or ``with``) releases the graph-API descriptors of its engine pieces.
    """

    def __init__(self, cudnn, handle, entry: PlanEntry) -> None:
        borrowing = [f"piece {i} ({piece})" for i, piece in enumerate(entry.pieces, 1) if piece.borrow]
        if borrowing:
            raise MucudnnError(
                f"{entry.key} N={entry.n}: {', '.join(borrowing)} borrows the output as workspace, "
                "which PlanExecutor does not run; check such plans through the shim (mucudnn run) "
                "or tune without --borrow-output")
        self.entry = entry
        self.handle = handle
        problem = entry.problem
        calls: dict[tuple[int, MathType], ConvolutionCall] = {}
        self.steps = []
        offset = 0
        for piece in entry.pieces:
            if piece.api is Api.GRAPH:
                step = _EngineStep(cudnn, handle, problem.with_n(piece.batch), piece.algo)
            else:
                slot = (piece.batch, piece.math)
                if slot not in calls:
                    calls[slot] = ConvolutionCall(cudnn, problem.with_n(piece.batch), piece.math)
                step = _LegacyStep(handle, calls[slot],
                                   algorithm_value(problem.direction, piece.algo))
            self.steps.append((step, offset))
            offset += piece.batch
        self.accumulates = problem.direction is Direction.BACKWARD_FILTER

    def run(self, buffers, workspace_ptr: int, alpha: float = 1.0, beta: float = 0.0) -> None:
        for i, (step, offset) in enumerate(self.steps):
            # backward-filter sums over samples: later pieces add to what the first one wrote
            piece_beta = 1.0 if (self.accumulates and i > 0) else beta
            step.run(buffers.pointers(offset), workspace_ptr, self.entry.workspace, alpha,
                     piece_beta)

    def close(self) -> None:
        for step, _ in self.steps:
            step.close()

    def __enter__(self) -> "PlanExecutor":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def double_reference(cudnn, handle, buffers, stream):
    """float64 ``conv(inputs)`` (alpha 1, beta 0) of ``buffers``' problem, computed by cuDNN.

    Tries the direction's algorithms in enum order and uses the first that supports double
    precision for this shape. Callers combine alpha/beta themselves (``alpha * ref + beta * prior``),
    so the reference does not depend on cuDNN's own scaling path.
    """
    import cupy

    from .errors import CudnnError
    reference = buffers.as_double()
    problem = reference.problem
    call = ConvolutionCall(cudnn, problem, MathType.FMA)
    failures = []
    for value, name in enumerate(ALGORITHMS[problem.direction]):
        try:
            size = call.workspace_size(handle, value)
            ws = cupy.empty(max(size, 1), dtype="uint8")
            call.run(handle, value, *reference.pointers(0), ws.data.ptr, size)
            stream.synchronize()
            return buffers.output_like(reference)
        except CudnnError as exc:
            failures.append(f"{name}: {exc.text}")
    raise CudnnError("double reference", -1, "no algorithm supports double here: "
                     + "; ".join(failures))
