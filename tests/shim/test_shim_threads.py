"""Several threads, each with its own handle, running different planned kernels at once."""

from __future__ import annotations

import random

from shim_harness import parse_fields, plan_line
from test_shim_exec import random_case, random_split


def test_threads_with_different_handles_shapes_and_plans(shim_env):
    rng = random.Random(7)
    kernels, lines = [], []
    while len(kernels) < 12:
        direction = ("fwd", "bwd_data", "bwd_filter")[len(kernels) % 3]
        case = random_case(rng, direction, rng.choice(["f32", "f64"]))
        line = plan_line(case, random_split(rng, int(parse_fields(case)["n"]), direction))
        if any(line.split()[1:3] == other.split()[1:3] for other in lines):
            continue
        kernels.append(f"{case} ws={line.split()[3]} algo=0")
        lines.append(line)
    cases = kernels * 16  # every kernel run by several threads, the first calls racing to set up
    run = shim_env.run(cases, plan=shim_env.write_plan(lines), threads=8,
                       env={"MUCUDNN_LOG_LEVEL": "info"})
    assert run.returncode == 0 and len(run.cases) == len(cases)
    for case, result in zip(cases, run.cases):
        assert (result["status"], result["ref_status"]) == ("0", "0"), case
        assert result["exact"] == "1" or float(result["max_rel"]) <= 1e-12, case
    pieces = sum(len(line.split()) - 5 for line in lines) * 16
    assert len(run.conv_calls()) == pieces + len(cases)  # every call planned, plus the references
    first_calls = [line for line in run.shim_lines("info") if ": plan, " in line]
    assert len(first_calls) == len(kernels)  # logged once per kernel, whichever thread came first
    assert not run.shim_lines("warning")
