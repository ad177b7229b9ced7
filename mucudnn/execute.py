"""Running a plan entry through the bindings: micro-batches in sequence on one stream.

This is what the shim does inside a framework, done from Python so the tuner's predictions and the
plans' numerics can be checked on the GPU without a framework (benchmarks/validate_tuner.py).
"""

from __future__ import annotations

from .cudnn import ConvolutionCall
from .plan import PlanEntry
from .problem import ALGORITHMS, Direction, MathType, algorithm_value


class PlanExecutor:
    """Runs one :class:`PlanEntry` on buffers shaped for its N (a :class:`bench.KernelBuffers`)."""

    def __init__(self, cudnn, handle, entry: PlanEntry) -> None:
        self.entry = entry
        self.handle = handle
        problem = entry.problem
        calls: dict[tuple[int, MathType], ConvolutionCall] = {}
        self.steps = []
        offset = 0
        for piece in entry.pieces:
            slot = (piece.batch, piece.math)
            if slot not in calls:
                calls[slot] = ConvolutionCall(cudnn, problem.with_n(piece.batch), piece.math)
            self.steps.append((calls[slot], algorithm_value(problem.direction, piece.algo), offset))
            offset += piece.batch
        self.accumulates = problem.direction is Direction.BACKWARD_FILTER

    def run(self, buffers, workspace_ptr: int, alpha: float = 1.0, beta: float = 0.0) -> None:
        for i, (call, algo, offset) in enumerate(self.steps):
            x, w, y = buffers.pointers(offset)
            # backward-filter sums over samples: later pieces add to what the first one wrote
            piece_beta = 1.0 if (self.accumulates and i > 0) else beta
            call.run(self.handle, algo, x, w, y, workspace_ptr, self.entry.workspace,
                     beta=piece_beta, alpha=alpha)



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
