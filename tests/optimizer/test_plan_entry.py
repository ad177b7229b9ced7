"""The optimizer's KernelPlan becomes a plan file's PlanEntry; the plan file knows nothing of the
optimizer (one-way dependency: optimizer -> plan)."""

from __future__ import annotations

import ast
from pathlib import Path

import mucudnn.plan
from mucudnn.optimizer import KernelPlan, Piece
from mucudnn.plan import PlanEntry, PlanPiece
from mucudnn.problem import ConvProblem, Direction, MathType

KEY = ConvProblem(Direction.FORWARD, n=4, c=8, input_size=(8, 8), k=8, filter_size=(3, 3),
                  padding=(1, 1), stride=(1, 1), dilation=(1, 1)).key


def test_plan_entry_keeps_the_pieces_without_their_measurements():
    plan = KernelPlan(KEY, 4, (Piece(2, "gemm", MathType.FMA, 0.5, 1 << 20, borrow=True),
                               Piece(2, "implicit_gemm", "fma", 0.25, 4096)))
    entry = plan.plan_entry()
    assert entry == PlanEntry(KEY, 4, 4096, 0.75, (PlanPiece(2, "gemm", MathType.FMA, borrow=True),
                                                   PlanPiece(2, "implicit_gemm", MathType.FMA)))
    assert all(type(piece) is PlanPiece for piece in entry.pieces)


def test_the_plan_module_does_not_know_the_optimizer():
    tree = ast.parse(Path(mucudnn.plan.__file__).read_text())
    imported = {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
    assert not any("optimizer" in name for name in imported)
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    assert not {"KernelPlan", "from_kernel_plan"} & names
    assert not hasattr(PlanEntry, "from_kernel_plan")
