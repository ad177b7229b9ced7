"""The shim reaches a cuDNN that was loaded into a local dlopen scope, as under PyTorch.

Python imports torch's extension with ``RTLD_LOCAL``, and libcudnn.so.9 comes in as its
dependency, so cuDNN is not in the global scope that the preloaded shim's ``dlsym(RTLD_NEXT, ...)``
searches. ``local_scope_main`` (not linked to cuDNN) rebuilds that structure: it opens
``liblocaluser.so`` (linked to the double) with ``RTLD_LOCAL`` and runs one forward convolution
and one ``Get_v7`` query through it. The other shim tests link cuDNN into the program, where
``RTLD_NEXT`` always finds it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from shim_harness import HERE, Run, plan_line

SUCCESS = "0"
# One float NCHW layer (as local_scope_main describes it) and the same layer as a driver case,
# from which the harness builds the kernel key and the plan line. The workspace passed is the
# plan's, the least the shim runs a plan with.
SHAPE = {"n": 4, "c": 3, "h": 5, "w": 5, "k": 2, "f": 3}
CASE = ("dir=fwd dt=f32 math=fma n={n} c={c} in={h}x{w} k={k} f={f}x{f} pad={p}x{p}"
        .format(**SHAPE, p=SHAPE["f"] // 2))
PIECES = [(2, "implicit_precomp_gemm", "fma"), (2, "gemm", "fma")]
CALLER_ALGO = 0   # implicit_gemm: runs undivided (without the shim) in any workspace


@dataclasses.dataclass
class LocalScopeProgram:
    main: Path
    library: Path


@pytest.fixture(scope="module")
def local_scope(shim_env, tmp_path_factory) -> LocalScopeProgram:
    out = tmp_path_factory.mktemp("local_scope")
    library = shim_env.compile([HERE / "local_scope_lib.c"], out / "liblocaluser.so",
                               shared=True, link_cudnn=True)
    main = shim_env.compile([HERE / "local_scope_main.c"], out / "local_scope_main")
    return LocalScopeProgram(main=main, library=library)


@pytest.fixture(scope="module")
def plan(shim_env) -> tuple[Path, int]:
    """The plan file splitting the layer's N into PIECES, and the plan's workspace in bytes."""
    line = plan_line(CASE, PIECES)
    return shim_env.write_plan([line]), int(line.split()[3])


def convolve(shim_env, program: LocalScopeProgram, workspace: int, **run_options) -> Run:
    args = [str(program.main), str(program.library),
            *(f"{name}={value}" for name, value in SHAPE.items()),
            f"algo={CALLER_ALGO}", f"ws={workspace}", "seed=7"]
    run = shim_env.run_program(args, **run_options)
    assert run.returncode == 0 and len(run.cases) == 1, run.stderr
    result = run.cases[0]
    # The structure under test: cuDNN is loaded, but only in the library's local scope.
    assert (result["cudnn_loaded"], result["cudnn_global"]) == ("1", "0"), result
    return run


def test_plan_runs_when_cudnn_is_in_a_local_scope(shim_env, local_scope, plan):
    from mucudnn.problem import ALGORITHMS, Direction

    plan_path, plan_workspace = plan
    reference = convolve(shim_env, local_scope, plan_workspace, preload=False)
    run = convolve(shim_env, local_scope, plan_workspace, plan=plan_path)
    result, expected = run.cases[0], reference.cases[0]

    assert run.shim_lines("error") == [], run.stderr
    assert "was not found" not in run.stderr
    assert (result["setup"], result["get_v7"], result["forward"]) == (SUCCESS,) * 3, result
    # The double executed the plan's micro-batches, so the shim called the real function.
    forward_algos = ALGORITHMS[Direction.FORWARD]
    assert [(int(c["n"]), int(c["algo"]), c["status"]) for c in run.conv_calls()] == [
        (b, forward_algos.index(algo), SUCCESS) for b, algo, _ in PIECES]
    assert [int(c["n"]) for c in reference.conv_calls()] == [SHAPE["n"]]
    assert result["y"] == expected["y"]
    assert any(float.fromhex(v) != 0 for v in result["y"].split(",")), "the output was not written"
    # The plan is offered first, with its workspace (PyTorch sizes its workspace from it).
    assert (result["first_status"], int(result["first_memory"])) == (SUCCESS, plan_workspace)
    assert int(result["first_memory"]) != int(expected["first_memory"]), "not the plan's answer"
