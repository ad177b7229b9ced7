"""The micro-batch size policies: the one list the CLI's ``--policy``, the optimizer, the plan
file's ``policy`` header and the shim's plan parser (shim/src/plan.c, checked by
tests/test_names.py) all use."""

from __future__ import annotations

import enum


class Policy(str, enum.Enum):
    """Which micro-batch sizes a plan for a mini-batch of ``n`` may use."""

    UNDIVIDED = "undivided"       # {n}: what cuDNN does on its own
    POWER_OF_TWO = "powerOfTwo"   # {1, 2, 4, ...} up to n, and n itself
    ALL = "all"                   # {1, ..., n}
    # powerOfTwo, plus each configuration's largest size within a workspace limit (fit_sizes):
    # most of what `all` gains, at a few sizes more per kernel
    FIT = "fit"


#: Every policy's name, in the order of :class:`Policy`.
POLICIES = tuple(policy.value for policy in Policy)
