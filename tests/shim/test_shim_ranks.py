"""Several processes (the ranks of a DDP job) through the shim: one MUCUDNN_PLAN naming plans for
several GPU models, each process taking its own; one shared plan and recording; a process killed
while the others write the recording."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

from shim_harness import FAKE_CUDNN_VERSION, FAKE_GPU_NAME, HEADER, parse_fields, plan_line

from mucudnn.plan import read_recording_weights

BASE = "dir=fwd n=8 c=4 in=7x7 k=6 f=3x3 pad=1x1 g=2 ws=65536 alpha=1 beta=0 algo=0"
OTHER_GPU = "mucudnn other fake GPU"


def header_for(gpu: str) -> str:
    return HEADER.replace(f"gpu {FAKE_GPU_NAME}", f"gpu {gpu}")


def pieces_run(run) -> list[tuple[str, str]]:
    return [(c["n"], c["algo"]) for c in run.conv_calls()]


def plans_for_two_models(shim_env, directory=None):
    """A plan for the double's GPU (pieces 4+4, implicit_precomp_gemm) and one for another GPU
    (pieces 2+6, gemm); both for BASE."""
    mine = shim_env.write_plan([plan_line(BASE, [(4, "implicit_precomp_gemm", "fma")] * 2)],
                               name="mine")
    other = shim_env.write_plan([plan_line(BASE, [(2, "gemm", "fma"), (6, "gemm", "fma")])],
                                header=header_for(OTHER_GPU), name="other")
    if directory is not None:
        directory.mkdir()
        mine = mine.rename(directory / "b-mine.plan")
        other = other.rename(directory / "a-other.plan")
    return mine, other


def test_a_list_of_plans_gives_each_gpu_model_its_own(shim_env):
    mine, other = plans_for_two_models(shim_env)
    listed = f"{other}:{mine}"
    info = {"MUCUDNN_LOG_LEVEL": "info"}
    run = shim_env.run([BASE], env={"MUCUDNN_PLAN": listed, **info})
    assert run.cases[0]["exact"] == "1" and pieces_run(run)[:2] == [("4", "1"), ("4", "1")]
    chose = [line for line in run.shim_lines("info") if "chose plan" in line]
    assert chose == [f"mucudnn: info: chose plan {mine} of the 2 in MUCUDNN_PLAN: the one for gpu "
                     f"'{FAKE_GPU_NAME}', cudnn {FAKE_CUDNN_VERSION}"]
    assert not run.shim_lines("error") and not run.shim_lines("warning")
    # the same setting on the other model takes the other plan
    run = shim_env.run([BASE], env={"MUCUDNN_PLAN": listed, "FAKE_CUDNN_GPU_NAME": OTHER_GPU,
                                    **info})
    assert run.cases[0]["exact"] == "1" and pieces_run(run)[:2] == [("2", "2"), ("6", "2")]
    assert any(f"chose plan {other} " in line for line in run.shim_lines("info"))


def test_a_directory_of_plans_is_its_plan_files(shim_env, tmp_path):
    mine, _ = plans_for_two_models(shim_env, tmp_path / "plans")
    (tmp_path / "plans" / "notes.txt").write_text("not a plan")
    run = shim_env.run([BASE], env={"MUCUDNN_PLAN": str(tmp_path / "plans"),
                                    "MUCUDNN_LOG_LEVEL": "info"})
    assert pieces_run(run)[:2] == [("4", "1"), ("4", "1")]
    assert any(f"chose plan {mine} of the 2 in MUCUDNN_PLAN" in line
               for line in run.shim_lines("info"))


def test_no_plan_for_this_gpu_passes_through_saying_what_the_plans_are_for(shim_env, tmp_path):
    _, other = plans_for_two_models(shim_env)
    broken = tmp_path / "broken.plan"
    broken.write_text("mucudnn-plan 1\n")
    run = shim_env.run([BASE], env={"MUCUDNN_PLAN": f"{other}:{broken}"})
    assert run.returncode == 0 and run.cases[0]["exact"] == "1"
    assert pieces_run(run) == [("8", "0"), ("8", "0")]  # the caller's call, then the reference
    errors = run.shim_lines("error")
    assert any(line.startswith(f"mucudnn: error: {broken}:") and line.endswith("; skipped")
               for line in errors), errors
    assert any(f"none of its 2 plans is for gpu '{FAKE_GPU_NAME}' with cudnn {FAKE_CUDNN_VERSION} "
               f"(they are for: '{OTHER_GPU}' cudnn {FAKE_CUDNN_VERSION}); passing every call "
               "through" in line for line in errors), errors


def test_a_directory_over_the_plan_count_is_cut_by_name_and_says_so(shim_env, tmp_path):
    """More plan files than the shim reads (256): the first by name are taken, whatever order the
    directory lists them in, and a warning says how many were left out."""
    plans = tmp_path / "plans"
    mine, other = plans_for_two_models(shim_env, plans)  # b-mine.plan, a-other.plan
    text = other.read_text()
    for i in range(300):
        (plans / f"a-other-{i:03}.plan").write_text(text)
    run = shim_env.run([BASE], env={"MUCUDNN_PLAN": str(plans)})
    assert pieces_run(run) == [("8", "0"), ("8", "0")]  # b-mine.plan sorts 302nd: not read
    warnings = run.shim_lines("warning")
    assert any("MUCUDNN_PLAN names 302 plan files" in line and "the 46 after the first 256" in line
               for line in warnings), warnings
    assert any("none of its 256 plans is for gpu" in line for line in run.shim_lines("error"))
    # within the count, the same directory's plan for this GPU is found
    for i in range(60):
        (plans / f"a-other-{i:03}.plan").unlink()
    run = shim_env.run([BASE], env={"MUCUDNN_PLAN": str(plans)})
    assert pieces_run(run)[:2] == [("4", "1"), ("4", "1")] and not run.shim_lines("warning")


# -- ranks sharing files ---------------------------------------------------------------------------

#: Distinct kernels, so that every rank appends many lines to the one recording.
RANK_CASES = [BASE.replace("n=8", f"n={n}") for n in range(1, 33)]


def run_ranks(shim_env, count: int, env: dict) -> list:
    """``count`` conv drivers at once on RANK_CASES, as the ranks of one job."""
    runs: list = [None] * count

    def rank(i: int) -> None:
        runs[i] = shim_env.run(RANK_CASES, env={**env, "RANK": str(i), "LOCAL_RANK": str(i)},
                               threads=2)

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return runs


def comparable(run) -> list[dict]:
    """A run's results without its buffers' addresses (which differ from process to process)."""
    return [{k: v for k, v in case.items() if k != "workspace"} for case in run.cases]


def test_four_ranks_share_one_plan_directory_and_one_recording(shim_env, tmp_path):
    mine, _ = plans_for_two_models(shim_env, tmp_path / "plans")
    record = tmp_path / "job.record"
    runs = run_ranks(shim_env, 4, {"MUCUDNN_PLAN": str(tmp_path / "plans"),
                                   "MUCUDNN_RECORD": str(record)})
    for run in runs:
        assert run.returncode == 0 and not run.stderr, run.stderr
        assert all(case["status"] == "0" and case["exact"] == "1" for case in run.cases)
        assert comparable(run) == comparable(runs[0])
        # the same calls (two threads a rank: in any order), n=8's two planned pieces among them
        assert sorted(pieces_run(run)) == sorted(pieces_run(runs[0]))
        assert pieces_run(run).count(("4", "1")) == 2
    lines = record.read_text().splitlines()
    assert sum(line.startswith("# mucudnn-record 1 pid=") for line in lines) == 4
    kernel_lines = [line for line in lines if line.startswith("kernel ")]
    assert len(kernel_lines) == 4 * len(RANK_CASES)  # each rank records each kernel once
    assert all(len(line.split()) == 3 for line in kernel_lines)  # whole lines, never interleaved
    weights = read_recording_weights([record])
    assert [p.n for p, _ in weights] and len(weights) == len(RANK_CASES)
    assert {w for _, w in weights} == {1}  # each ran once per rank: 4 calls each, divided by 4


#: Slow cases (host convolutions of the double): the victim is still running when it is killed.
VICTIM_CASES = [f"dir=fwd n={n} c=16 in=48x48 k=16 f=3x3 pad=1x1 ws=0 alpha=1 beta=0 algo=0"
                for n in range(1, 41)]


def test_a_rank_killed_while_the_others_append_leaves_the_recording_valid(shim_env, tmp_path):
    record = tmp_path / "job.record"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MUCUDNN_", "FAKE_CUDNN_"))}
    env.update(LD_LIBRARY_PATH=str(shim_env.fake_dir), LD_PRELOAD=str(shim_env.shim),
               MUCUDNN_RECORD=str(record), FAKE_CUDNN_LOG=str(tmp_path / "victim.log"))
    victim = subprocess.Popen([str(shim_env.driver)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, text=True)
    survivors: list = []
    try:
        victim.stdin.write("".join(case + "\n" for case in VICTIM_CASES))
        victim.stdin.close()
        wait_for(lambda: count_lines(record, "kernel ") >= 3)  # it is appending alone
        others = threading.Thread(target=lambda: survivors.extend(
            run_ranks(shim_env, 3, {"MUCUDNN_RECORD": str(record)})))
        others.start()
        wait_for(lambda: count_lines(record, "# mucudnn-record") >= 2)  # and now with others
        assert victim.poll() is None, "the victim finished before it could be killed"
        victim.send_signal(signal.SIGKILL)
        others.join()
    finally:
        victim.kill()
        victim.wait()
    assert victim.returncode == -signal.SIGKILL
    assert len(survivors) == 3
    for run in survivors:
        assert run.returncode == 0 and not run.stderr
        assert all(case["exact"] == "1" for case in run.cases)
    lines = record.read_text().splitlines()
    assert all(parse_fields(line).get("fn") in ("kernel", "calls", "#") for line in lines)
    weights = read_recording_weights([record])
    assert len(weights) >= len(RANK_CASES) + 3
    # the killed rank wrote its kernels but no calls; the survivors' calls weigh theirs
    assert sum(line.startswith("calls ") for line in lines) == 3 * len(RANK_CASES)
    assert {w for _, w in weights} == {1}


def count_lines(path, prefix: str) -> int:
    try:
        return sum(line.startswith(prefix) for line in path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def wait_for(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
