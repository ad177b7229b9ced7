"""Choosing micro-batch plans from measurements.

- :func:`best_plan` (WR): the fastest plan of one kernel within a per-kernel workspace limit.
- :func:`pareto_plans`: one kernel's time/workspace trade-offs, the input of WD and, thinned by
  :func:`thin_front`, the points of a ``front`` plan.
- :func:`solve_budget` (WD): one plan per kernel of a network within one shared budget (ILP).
"""

from .dp import FRONT_MAX_POINTS, FRONT_MIN_GAIN, best_plan, pareto_plans, thin_front
from .ilp import SolverError, network_time, network_workspace, solve_budget
from .kernel_plan import KernelPlan, Piece, Policy, candidate_sizes, fit_sizes

__all__ = [
    "FRONT_MAX_POINTS", "FRONT_MIN_GAIN", "KernelPlan", "Piece", "Policy", "SolverError",
    "best_plan", "candidate_sizes", "fit_sizes", "network_time", "network_workspace",
    "pareto_plans", "solve_budget", "thin_front",
]
