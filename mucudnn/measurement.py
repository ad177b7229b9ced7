"""What the benchmarker measures and the optimizer consumes: one algorithm at one micro-batch size."""

from __future__ import annotations

import dataclasses
import enum

from .problem import MathType


class Status(str, enum.Enum):
    OK = "ok"                        # ran; time and workspace are valid
    NOT_SUPPORTED = "not_supported"  # cuDNN refused this algorithm for this shape
    FAILED = "failed"                # any other cuDNN error or out of memory (the note says which)


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One timed (algorithm, math type) at micro-batch size ``batch`` for the kernel ``key``.

    ``time_ms`` is the median of the timed repetitions; ``workspace`` the bytes cuDNN asked for.
    Only rows with ``status == Status.OK`` carry meaningful time and workspace.
    """

    key: str
    batch: int
    algo: str
    math: MathType
    time_ms: float
    workspace: int
    status: Status = Status.OK
    note: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "math", MathType(self.math))
        object.__setattr__(self, "status", Status(self.status))

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


#: The note of a row a bench left untimed on purpose (mucudnn/bench.py); the row's status is
#: ``not_supported`` so that nothing reads its time, and its workspace is the one cuDNN reported.
#: Here, not in bench.py, because tuning reads it and must not import the benchmarker.
NOT_TIMED = "not timed: "
OVER_LIMIT = NOT_TIMED + "over limit"
OVER_LIMIT_NOTE = OVER_LIMIT + " ({bound} bytes usable at this size)"
QUICK = NOT_TIMED + "--quick"
QUICK_NOTE = QUICK + " stopped at size {size} ({request})"


def is_not_timed(row: Measurement) -> bool:
    return row.note.startswith(NOT_TIMED)
