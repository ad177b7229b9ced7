"""A trial of offload plans (lifecycle.py's :class:`~.lifecycle.TrialsAndWatch` runs it): the plans
run in turn on the device, each timed by its steps' end marks and watched for the caching
allocator's flushes after each op; the one it keeps. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from . import planner


@dataclass
class Trial:
    """Plans run in turn, :data:`planner.TRIAL_STEPS` planned steps each; the marks at their
    steps' ends time them, and the links' flush counts read at every unpack of their steps say
    after which op the caching allocator flushed its cache. ``awaiting``: the plans to run
    against the first are being made (it runs meanwhile; its timed steps done, it goes on
    untimed)."""

    plans: list
    labels: list                                 # per plan: what it is, for the lines said
    current: int = 0
    marks: list = field(default_factory=list)    # per plan: the end marks of its steps
    flushes: list = field(default_factory=list)  # per plan: the link's flush count at each mark
    #: per plan: the backward points (-1: the forward) after whose op a link's flush count grew
    #: in its last timed step (:meth:`flushes_in`)
    flush_points: list = field(default_factory=list)
    seen: dict = field(default_factory=dict)   # link -> its flush count when last read
    awaiting: bool = False

    def __post_init__(self):
        self.marks = [[] for _ in self.plans]
        self.flushes = [[] for _ in self.plans]
        self.flush_points = [set() for _ in self.plans]

    def add(self, others) -> None:
        """(label, plan) to run after those already in it."""
        for label, plan in others:
            self.plans.append(plan)
            self.labels.append(label)
            self.marks.append([])
            self.flushes.append([])
            self.flush_points.append(set())

    def put(self, index: int, plan) -> None:
        """``plan`` in the place of plan ``index``, as if none of its steps had run yet."""
        self.plans[index] = plan
        self.marks[index], self.flushes[index], self.flush_points[index] = [], [], set()

    def timing(self) -> bool:
        """Whether the current plan's steps are still timed (not its timed steps done while the
        others are made)."""
        return len(self.marks[self.current]) < planner.TRIAL_STEPS

    def saw_flushes(self, link, count: int, point: int) -> None:
        """``link``'s flush count ``count`` read after backward point ``point``'s op (-1: after
        the forward): if it grew since the last read (the first read of a link is its start),
        the current plan flushed there; a timed step's point is kept, until another timed step
        of the plan follows (as :meth:`flushes_in` counts)."""
        if count > self.seen.get(link, count) and self.marks[self.current]:
            self.flush_points[self.current].add(point)
        self.seen[link] = count

    def flush_note(self, index: int) -> str:
        """Plan ``index``'s flushes in its last timed step and where, as its trial line says them
        (" (2 flushes after the forward and after backward point 6)"; none: "")."""
        count = self.flushes_in(index)
        if not count:
            return ""
        points = sorted(self.flush_points[index])
        said = ["after the forward"] * (points[:1] == [-1])
        backward = [point for point in points if point >= 0]
        if backward:
            said.append(f"after backward point{'s' if len(backward) > 1 else ''} "
                        + ", ".join(map(str, backward)))
        where = " " + " and ".join(said) if said else ""
        return f" ({count} flush{'es' if count > 1 else ''}{where})"

    def flushes_in(self, index: int) -> int:
        """The caching allocator's flushes in plan ``index``'s last timed step. A plan that takes
        over from another finds the allocator's segments cut for that one, and may flush while
        it cuts its own (its reserved memory growing): a plan that flushes once the allocator
        has settled flushes in every step, and its last one too."""
        counts = self.flushes[index]
        return counts[-1] - counts[-2] if len(counts) > 1 else 0

    def kept(self, times: list[float]) -> int:
        """Of the first plans, timed ``times`` (:meth:`step_ms`), the fastest of those whose
        last timed step did not flush the caching allocator's cache (of all where each did): a
        plan that flushes in its trial's last step flushes more after it
        (benchmarks/results/pressure)."""
        calm = [index for index in range(len(times)) if not self.flushes_in(index)]
        return min(calm or range(len(times)), key=times.__getitem__)

    def step_ms(self, index: int, elapsed_ms: Callable) -> float:
        """The fastest of plan ``index``'s timed steps (each after its first): a step slowed by
        what the script does between steps (a checkpoint, a log) says nothing of the plan."""
        marks = self.marks[index]
        return min(elapsed_ms(a, b) for a, b in zip(marks, marks[1:]))
