"""At exit, one line when a plan did nothing: refused for this process, or none of the kernels
the process ran in it (a run must not end looking as if the plan had worked)."""

from __future__ import annotations

from shim_harness import HEADER, plan_line

CASE = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 ws=65536 algo=0"


def last_warning(run):
    warnings = run.shim_lines("warning")
    return warnings[-1] if warnings else ""


def test_a_plan_for_another_gpu_is_named_again_at_exit(shim_env):
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)],
                               header=HEADER.replace("gpu mucudnn fake GPU", "gpu Other GPU"))
    run = shim_env.run([CASE], plan=plan)
    assert run.cases[0]["exact"] == "1"
    assert run.stderr.rstrip().splitlines()[-1] == last_warning(run)
    assert f"the plan {plan} was not used (refused for this process" in last_warning(run)


def test_a_plan_that_matched_no_kernel_says_so_at_exit(shim_env):
    other = CASE.replace("n=8", "n=6")  # a kernel of another N: not in the plan
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([other], plan=plan)
    assert f"the plan {plan} ran none of the 1 kernels this process ran" in last_warning(run)


def test_a_plan_that_ran_says_nothing_at_exit(shim_env):
    plan = shim_env.write_plan([plan_line(CASE, [(4, "gemm", "fma")] * 2)])
    run = shim_env.run([CASE], plan=plan)
    assert run.cases[0]["exact"] == "1" and not run.shim_lines("warning"), run.stderr
