"""cudnnConvolution* through the shim: plans split the batch exactly, everything else passes through.

Every case runs the call through the shim and through the cuDNN double directly (undivided) on the
same data; ``exact=1`` means bit-identical outputs. f32 data are small integers, so even
backward-filter's accumulation over micro-batches is exact; f64 data are random reals.
"""

from __future__ import annotations

import random

import pytest

from shim_harness import key_of, parse_fields, plan_line

# Algorithms the double supports for every geometry (fft/winograd have shape rules).
ALWAYS_SUPPORTED = {
    "fwd": ["implicit_gemm", "implicit_precomp_gemm", "gemm", "direct"],
    "bwd_data": ["algo_0", "algo_1"],
    "bwd_filter": ["algo_0", "algo_1", "algo_3"],
}
MATHS = ["default", "tensor_op", "tensor_op_conv", "fma"]

BASE = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2"


def split_by_case(run, cases):
    """The double's conv calls of each case: the shim's call(s), then the driver's reference call."""
    calls = run.conv_calls()
    grouped, position = [], 0
    for case in cases:
        n = int(parse_fields(case).get("n", 2))
        group = []
        while True:
            call = calls[position]
            position += 1
            group.append(call)
            if sum(int(c["n"]) for c in group) > n:  # the reference call closes the case
                break
        grouped.append((group[:-1], group[-1]))
    assert position == len(calls)
    return grouped


def test_forward_plan_runs_the_pieces_in_the_callers_workspace(shim_env):
    case = BASE + " ws=65536 alpha=1 beta=0.5 algo=0"
    plan = shim_env.write_plan([plan_line(case, [(4, "implicit_precomp_gemm", "fma"),
                                                 (2, "gemm", "tensor_op"),
                                                 (2, "implicit_gemm", "default")])])
    run = shim_env.run([case], plan=plan, env={"MUCUDNN_LOG_LEVEL": "info"})
    result = run.cases[0]
    assert (result["status"], result["ref_status"], result["exact"]) == ("0", "0", "1")
    pieces, reference = split_by_case(run, [case])[0]
    assert [(c["n"], c["algo"], c["math"]) for c in pieces] == [
        ("4", "1", "fma"), ("2", "2", "tensor_op"), ("2", "0", "default")]
    assert {c["workspace"] for c in pieces} == {result["workspace"]}
    assert {c["ws"] for c in pieces} == {"65536"}
    # Consecutive slices along N: x and y advance by b samples of their N-stride (4*7*7, 6*7*7 floats).
    x = [int(c["x"], 16) for c in pieces] + [int(reference["x"], 16) + 8 * 196 * 4]
    y = [int(c["y"], 16) for c in pieces]
    assert x[0] == int(reference["x"], 16)
    assert [b - a for a, b in zip(x, x[1:])] == [4 * 196 * 4, 2 * 196 * 4, 2 * 196 * 4]
    assert [b - a for a, b in zip(y, y[1:])] == [4 * 294 * 4, 2 * 294 * 4]
    assert {c["w"] for c in pieces} == {reference["w"]}
    info = run.shim_lines("info")
    assert any("N=8: plan, 3 pieces: 4:implicit_precomp_gemm:fma 2:gemm:tensor_op "
               "2:implicit_gemm:default" in line for line in info), run.stderr


def random_case(rng: random.Random, direction: str, dtype: str) -> str:
    spatial = rng.choice([2, 2, 3])
    groups = rng.choice([1, 1, 2, 3])
    c, k = groups * rng.randint(1, 3), groups * rng.randint(1, 3)
    f = [rng.randint(1, 3) for _ in range(spatial)]
    dil = [rng.randint(1, 2) for _ in range(spatial)]
    pad = [rng.randint(0, 2) for _ in range(spatial)]
    stride = [rng.randint(1, 2) for _ in range(spatial)]
    size = [rng.randint((fi - 1) * di + 1, (fi - 1) * di + 5) for fi, di in zip(f, dil)]
    x = "x".join
    alpha = rng.choice([1, 0.5, -2, 0.25])
    beta = rng.choice([0, 0, 1, 0.5, -1.5])
    return (f"dir={direction} dt={dtype} math={rng.choice(MATHS)} layout={rng.choice(['nchw', 'nhwc'])} "
            f"n={rng.randint(2, 9)} c={c} in={x(map(str, size))} k={k} f={x(map(str, f))} "
            f"pad={x(map(str, pad))} stride={x(map(str, stride))} dil={x(map(str, dil))} g={groups} "
            f"mode={rng.choice(['xcorr', 'conv'])} alpha={alpha} beta={beta} seed={rng.randint(1, 10**6)}")


def random_split(rng: random.Random, n: int, direction: str) -> list[tuple[int, str, str]]:
    pieces, left = [], n
    while left:
        b = rng.randint(1, left)
        pieces.append((b, rng.choice(ALWAYS_SUPPORTED[direction]), rng.choice(MATHS)))
        left -= b
    return pieces


@pytest.mark.parametrize("dtype", ["f32", "f64"])
def test_random_plans_match_the_undivided_call(shim_env, dtype):
    rng = random.Random(20240 + len(dtype))
    cases, lines, splits, seen = [], [], [], set()
    while len(cases) < 45:
        direction = ("fwd", "bwd_data", "bwd_filter")[len(cases) % 3]
        case = random_case(rng, direction, dtype)
        n = int(parse_fields(case)["n"])
        if (key_of(case), n) in seen:
            continue
        seen.add((key_of(case), n))
        split = random_split(rng, n, direction)
        line = plan_line(case, split)
        workspace = int(line.split()[3])
        cases.append(f"{case} ws={workspace + rng.choice([0, 64])} algo=0")
        lines.append(line)
        splits.append(split)
    run = shim_env.run(cases, plan=shim_env.write_plan(lines))
    assert run.returncode == 0, run.stderr
    assert not run.shim_lines("warning") and not run.shim_lines("error"), run.stderr
    for case, result, (pieces, reference), split in zip(cases, run.cases, split_by_case(run, cases),
                                                         splits):
        assert (result["status"], result["ref_status"]) == ("0", "0"), case
        if dtype == "f32":
            assert result["exact"] == "1", case
        else:
            assert float(result["max_rel"]) <= 1e-12, case
        from mucudnn.problem import ALGORITHMS, Direction
        direction = Direction(parse_fields(case)["dir"])
        assert [(int(c["n"]), int(c["algo"]), c["math"]) for c in pieces] == [
            (b, ALGORITHMS[direction].index(a), m) for b, a, m in split], case
        assert {c["workspace"] for c in pieces} == {result["workspace"]}
        f = parse_fields(case)
        betas = [float(c["beta"]) for c in pieces]
        if direction is Direction.BACKWARD_FILTER:  # accumulate: the caller's beta once, then 1
            assert betas == [float(f["beta"])] + [1.0] * (len(pieces) - 1), case
        else:
            assert betas == [float(f["beta"])] * len(pieces), case
        assert {float(c["alpha"]) for c in pieces} == {float(f["alpha"])}


def assert_passthrough(run, case):
    """The double received exactly the caller's call, once, then the driver's reference call."""
    f = parse_fields(case)
    (pieces, reference), = split_by_case(run, [case])
    assert len(pieces) == 1, pieces
    call = pieces[0]
    assert (call["n"], call["algo"], call["ws"]) == (f["n"], f.get("algo", "0"), f["ws"])
    assert call["workspace"] == run.cases[0]["workspace"]
    output = {"fwd": "y", "bwd_data": "dx", "bwd_filter": "dw"}[f.get("dir", "fwd")]
    # Same arguments as the undivided reference call, but for the output the driver copied.
    assert {k: v for k, v in call.items() if k != output} == \
        {k: v for k, v in reference.items() if k != output}
    assert run.cases[0]["exact"] == "1"


@pytest.mark.parametrize("direction", ["fwd", "bwd_data", "bwd_filter"])
def test_no_plan_passes_the_call_through_unchanged(shim_env, direction):
    case = f"dir={direction} n=6 c=3 in=5x5 k=2 f=3x3 ws=100000 algo=1 beta=0.5"
    other = f"dir={direction} n=4 c=3 in=5x5 k=2 f=3x3"  # a plan for another N of the same key
    plan = shim_env.write_plan([plan_line(other, [(2, ALWAYS_SUPPORTED[direction][0], "fma")] * 2)])
    run = shim_env.run([case], plan=plan, env={"MUCUDNN_LOG_LEVEL": "info"})
    assert_passthrough(run, case)
    assert any("N=6: passthrough (no plan)" in line for line in run.shim_lines("info")), run.stderr


def test_unkeyable_descriptors_pass_through(shim_env):
    case = "dir=fwd layout=padded n=4 c=2 in=6x6 k=2 f=3x3 ws=100000 algo=1"
    run = shim_env.run([case], plan=shim_env.write_plan([]), env={"MUCUDNN_LOG_LEVEL": "info"})
    assert run.cases[0]["nokey"] == "tensor_strides_are_not_packed"
    assert_passthrough(run, case)
    assert any("without a kernel key: tensor strides are not packed" in line
               for line in run.shim_lines("info")), run.stderr


def test_too_small_workspace_passes_through(shim_env):
    case = BASE + " ws=8191 algo=0"
    plan = shim_env.write_plan([plan_line(case, [(4, "gemm", "fma"), (4, "gemm", "fma")])])  # 32 KiB
    run = shim_env.run([case], plan=plan, env={"MUCUDNN_LOG_LEVEL": "info"})
    assert_passthrough(run, case)
    assert any("passthrough (workspace 8191 smaller than the plan's 32768)" in line
               for line in run.shim_lines("info")), run.stderr


def test_disable_passes_everything_through(shim_env):
    case = BASE + " ws=65536 algo=0"
    plan = shim_env.write_plan([plan_line(case, [(4, "gemm", "fma"), (4, "gemm", "fma")])])
    run = shim_env.run([case], plan=plan, env={"MUCUDNN_DISABLE": "1"})
    assert_passthrough(run, case)


def test_an_error_of_a_later_piece_is_returned(shim_env):
    case = BASE + " ws=65536 algo=0"
    plan = shim_env.write_plan([plan_line(case, [(6, "gemm", "fma"), (2, "gemm", "fma")])])
    run = shim_env.run([case], plan=plan, env={"FAKE_CUDNN_FAIL_N": "2"})
    assert run.cases[0]["status"] == "5000"  # CUDNN_STATUS_EXECUTION_FAILED from the double
    assert run.cases[0]["ref_status"] == "0"
    assert [c["n"] for c in run.conv_calls()] == ["6", "2", "8"]
    assert any("piece 2 of the plan failed" in line for line in run.shim_lines("warning"))


def test_a_first_piece_cuDNN_rejects_falls_back_to_the_undivided_call(shim_env):
    # fft is not supported with stride 2: the double says NOT_SUPPORTED before writing anything.
    case = "dir=fwd n=4 c=2 in=8x8 k=2 f=3x3 stride=2x2 ws=65536 algo=0"
    plan = shim_env.write_plan([plan_line(case, [(2, "fft", "fma"), (2, "gemm", "fma")])])
    run = shim_env.run([case, case], plan=plan)
    assert [r["status"] for r in run.cases] == ["0", "0"]
    assert [r["exact"] for r in run.cases] == ["1", "1"]
    # first call: failed piece, undivided retry, reference; second call: undivided, reference
    assert [(c["n"], c["algo"]) for c in run.conv_calls()] == [
        ("2", "4"), ("4", "0"), ("4", "0"), ("4", "0"), ("4", "0")]
    warnings = run.shim_lines("warning")
    assert "first piece failed" in warnings[0], run.stderr
    # then, at exit, that the plan ended up running nothing
    assert len(warnings) == 2 and "ran none of the 1 kernels this process ran" in warnings[1], run.stderr
