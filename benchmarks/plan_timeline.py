"""Issue 39, "What it must show": the timeline of a run as a new user runs it, first run and cached
run. How long from the command to the first planned step and to steady state, and what each of
the first steps took.

Per case (``MODEL:BATCH@BUDGET``) three processes, one after another, each a training script of
benchmarks/train_steps.py (benchmarks/models.py's network, SGD, random data, fp32 with TF32):

- ``pytorch``: ``python -m benchmarks.train_steps ...`` alone: the unconstrained step;
- ``first``: ``python -m mucudnn run --memory-budget BUDGET --offload -- python -m
  benchmarks.train_steps ...`` with a fresh ``XDG_CACHE_HOME`` (so online tuning and the plan cache
  start empty; ``MUCUDNN_PLAN_CACHE`` names its plan directory in it);
- ``cached``: the same command again, with the same cache: online tuning's measurements and the
  offload plan the first run stored (mucudnn/torch/plancache.py), where it stored one.

``MUCUDNN_LOG_LEVEL=info``, so the session's lines (``mucudnn: info: ...``, its plans, trials,
lowerings, the plan cache) show on stderr in order with the script's step lines; every line is
stamped as it arrives with the seconds since the command was launched. The shim is built once
before the runs (its build time is in the JSON) and shared by them (``MUCUDNN_SHIM_DIR``), so no
run pays for compiling it.

Reported per run: seconds from launch to the first step's end; to the first planned step (its
start: the first step the session ran under a plan, by the state train_steps.py reads from it,
or, where no state is known, the first step after a plan line); to steady state, the start of
the first step from which the remaining steps' p90/p50 <= ``--steady-ratio`` (at least
``--steady-min-steps`` of them), itself within that ratio of their median; the steady steps'
median against PyTorch's; each step's time; the session's lines with their times. A run killed at its timeout keeps what it printed.
Writes ``OUT/plan_timeline.json`` and ``OUT/plan_timeline.md`` after every run, and each run's
whole output as ``OUT/plan_timeline-CASE-RUN.log``.

    python -m benchmarks.plan_timeline --cases resnet152:128@8GiB resnet50:184@5GiB --out DIR
    python -m benchmarks.plan_timeline --device cpu --cases tiny:2@1MiB --steps 6 --out DIR
    python -m benchmarks.plan_timeline --again DIR    # DIR's logs read again, nothing run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.host_cost import parse_case, size_text
from benchmarks.train_steps import TINY
from mucudnn.errors import MucudnnError
from mucudnn.outputs import write_text_atomically

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("pytorch", "first", "cached")

STEP_LINE = re.compile(r"^train_steps: step (\d+) start_s=([\d.]+) end_s=([\d.]+) "
                       r"step_ms=([\d.]+) session=(\S+)")
READY_LINE = re.compile(r"^train_steps: ready at ([\d.]+) s")
MUCUDNN_LINE = re.compile(r"^mucudnn: (\w+): (.*)")
#: the shim's lines (a kernel, its plan point, its workspace) are no session's
SHIM_LINE = re.compile(r"\bN=\d+|graph plan|kernel|workspace|the shim's room|cuDNN", re.I)
#: a session's lines: its plans, trials, lowerings, fall-backs, the plan cache
SESSION_LINE = re.compile(r"offload|record|plan|trying it|saved tensor|cache", re.I)
#: a session's line saying a plan is in force from the next step (used only where the steps
#: carry no session state)
PLAN_IN_FORCE = re.compile(r"^offload plan for|keeping the plan|cached offload plan .*(loaded|"
                           r"in force|used for)|from the plan cache", re.I)
#: the states a session runs a step under a plan in (train_steps.session_state)
PLANNED_STATES = ("planned", "trial", "watching")


# -- one run ---------------------------------------------------------------------------------------

def run_stamped(cmd: list[str], env: dict, timeout_s: float, log: Path) -> dict:
    """Runs ``cmd`` (its own process group, killed past ``timeout_s``); every line of its output
    (stdout and stderr together) stamped with the seconds since launch, and written to ``log``."""
    lines: list[tuple[float, str]] = []
    launched = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            cwd=ROOT, start_new_session=True, text=True, errors="replace",
                            bufsize=1)

    def read() -> None:
        for line in proc.stdout:
            lines.append((time.monotonic() - launched, line.rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    status = "ok"
    try:
        code = proc.wait(timeout=timeout_s)
        if code != 0:
            status = f"exit {code}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status = "timeout"
    reader.join(timeout=10)
    wall = time.monotonic() - launched
    log.write_text("".join(f"[{at:8.3f}] {text}\n" for at, text in lines))
    return {"status": status, "wall_s": round(wall, 3), "timeout_s": round(timeout_s, 1),
            "lines": lines}


def parse_run(lines: list[tuple[float, str]]) -> dict:
    """The steps, the ready time and the mucudnn lines of one run's stamped output."""
    steps, mucudnn, ready = [], [], None
    for at, text in lines:
        if match := STEP_LINE.match(text):
            index, start, end, step_ms, state = match.groups()
            steps.append({"step": int(index), "start_s": float(start), "end_s": float(end),
                          "step_ms": float(step_ms), "state": state, "at_s": round(at, 3),
                          "after_lines": len(mucudnn)})
        elif match := READY_LINE.match(text):
            ready = {"process_s": float(match.group(1)), "at_s": round(at, 3)}
        elif match := MUCUDNN_LINE.match(text):
            level, body = match.groups()
            session = bool(SESSION_LINE.search(body)) and not SHIM_LINE.search(body)
            mucudnn.append({"at_s": round(at, 3), "level": level, "text": body,
                            "session": session})
    return {"steps": steps, "ready": ready, "mucudnn_lines": mucudnn}


def p90_over_p50(values: list[float]) -> float:
    ordered = sorted(values)
    # the nearest-rank 90th percentile: no interpolation past what was measured
    p90 = ordered[max(0, -(-len(ordered) * 9 // 10) - 1)]
    return p90 / statistics.median(ordered)


def steady_from(step_ms: list[float], ratio: float, min_steps: int) -> int | None:
    """The first step (1-based) from which the remaining steps' p90/p50 <= ``ratio``, with at
    least ``min_steps`` of them, that is itself within ``ratio`` of their median; None when no
    such step. (The p90 alone leaves out the slowest tenth: of 60 steps, the 6 steps of a
    recording and its planning would pass for steady.)"""
    for first in range(len(step_ms) - min_steps + 1):
        tail = step_ms[first:]
        if step_ms[first] <= ratio * statistics.median(tail) and p90_over_p50(tail) <= ratio:
            return first + 1
    return None


def timeline(parsed: dict, ratio: float, min_steps: int) -> dict:
    """What the issue asks of a run, from its parsed lines (times since launch)."""
    steps = parsed["steps"]
    out: dict = {"steps_ms": [s["step_ms"] for s in steps], "states": [s["state"] for s in steps]}
    if not steps:
        return out
    # the process's clock against the launch's: the least delay between a step's end and its
    # line's arrival (the process starts after the launcher: its zero is later)
    offset = min(s["at_s"] - s["end_s"] for s in steps)
    out["process_started_s"] = round(offset, 3)

    def since_launch(step: dict, key: str = "start_s") -> float:
        return round(step[key] + offset, 3)

    out["first_step_end_s"] = since_launch(steps[0], "end_s")
    known = [s for s in steps if s["state"] != "none"]
    planned = None
    if known:
        out["planned_by"] = "session state"
        planned = next((s for s in steps if s["state"] in PLANNED_STATES), None)
    else:
        plan_lines = [i for i, line in enumerate(parsed["mucudnn_lines"])
                      if line["session"] and PLAN_IN_FORCE.search(line["text"])]
        if plan_lines:
            out["planned_by"] = "plan line"
            planned = next((s for s in steps if s["after_lines"] > plan_lines[0]), None)
    if planned is not None:
        out["first_planned_step"] = planned["step"]
        out["first_planned_start_s"] = since_launch(planned)
    steady = steady_from(out["steps_ms"], ratio, min_steps)
    if steady is not None:
        tail = out["steps_ms"][steady - 1:]
        out.update(steady_step=steady, steady_start_s=since_launch(steps[steady - 1]),
                   steady_median_ms=statistics.median(tail),
                   steady_p90_over_p50=round(p90_over_p50(tail), 4))
    return out


# -- driver ----------------------------------------------------------------------------------------

def train_command(args, model: str, batch: int, steps: int) -> list[str]:
    cmd = [sys.executable, "-m", "benchmarks.train_steps", "--model", model, "--batch",
           str(batch), "--steps", str(steps), "--device", args.device]
    return cmd + (["--sample", args.sample] if args.sample else []) + \
        (["--detail"] if args.detail else [])


def prepare_shim(env: dict) -> dict:
    """Builds the shim once (timed), and the environment that makes every run use that build:
    its directory (MUCUDNN_SHIM_DIR) and the cuDNN headers it was built against (a fresh cache
    home would otherwise look for them, and build, elsewhere)."""
    from mucudnn.shimlib import find_cudnn_include, shim_path
    started = time.monotonic()
    try:
        library = shim_path()
        include = find_cudnn_include()
    except MucudnnError as exc:
        return {"error": str(exc).splitlines()[0]}
    env.setdefault("MUCUDNN_SHIM_DIR", str(library.parent.parent))
    env.setdefault("MUCUDNN_CUDNN_INCLUDE", str(include))
    return {"library": str(library), "seconds": round(time.monotonic() - started, 3)}


def markdown(document: dict, args) -> str:
    out = ["# Timeline of a run under `mucudnn run --memory-budget B --offload`, first and cached",
           "", f"`python -m benchmarks.plan_timeline {' '.join(args.argv)}`", "",
           "Seconds since the command was launched. First planned step: the first step run under "
           "a plan (its start); steady state: the start of the first step from which the rest "
           f"have p90/p50 <= {args.steady_ratio} (at least {args.steady_min_steps} steps), "
           "itself within that ratio of their median. "
           "Each run of a case: `pytorch` is the script alone; `first` is `python -m mucudnn run "
           "--memory-budget B --offload -- python -m benchmarks.train_steps ...` with a fresh "
           "cache; `cached` is the same command again with that cache.", ""]
    if not args.device.startswith("cuda"):
        out += ["**Dry run on the CPU**: no session plans CPU tensors; nothing here says "
                "anything of a GPU.", ""]
    out += ["| case | run | status | process up | first step done | first planned step | "
            "steady state | steady step ms | × PyTorch | session lines |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for case in document["cases"]:
        name = f"{case['model']} N={case['batch']} @ {size_text(case['budget'])}"
        base = case["runs"].get("pytorch", {}).get("steady_median_ms")
        for run_name, run in case["runs"].items():
            if run.get("status") == "skipped":
                out.append(f"| {name} | {run_name} | skipped ({run.get('reason')}) |" + " |" * 7)
                continue
            planned = (f"{run['first_planned_start_s']:.1f} s (step {run['first_planned_step']})"
                       if "first_planned_step" in run else "none" if run_name != "pytorch"
                       else "—")
            steady = (f"{run['steady_start_s']:.1f} s (step {run['steady_step']})"
                      if "steady_step" in run else "not reached")
            median = run.get("steady_median_ms")
            out.append("| " + " | ".join([
                name, run_name, run["status"] + (f" after {run['wall_s']:.0f} s"
                                                 if run["status"] == "timeout" else ""),
                # /proc's start time has 10 ms ticks: a process started at once reads -0.0
                f"{max(0.0, run['process_started_s']):.1f} s" if "process_started_s" in run
                else "—",
                f"{run['first_step_end_s']:.1f} s" if "first_step_end_s" in run else "—",
                planned, steady, f"{median:.1f}" if median else "—",
                f"{median / base:.3f}" if median and base else "—",
                str(sum(line["session"] for line in run.get("mucudnn_lines", [])))]) + " |")
    for case in document["cases"]:
        name = f"{case['model']} N={case['batch']} @ {size_text(case['budget'])}"
        out += ["", f"## {name}", ""]
        for run_name, run in case["runs"].items():
            steps = run.get("steps_ms", [])
            if not steps:
                continue
            shown = steps[:args.show_steps]
            if run_name != "pytorch":
                out.append(f"- {run_name}: the plan cache held {len(run['plan_cache_files'])} "
                           "file(s) after it")
            states = run.get("states", [])
            out.append(f"- {run_name}, steps 1–{len(shown)} ms: " + ", ".join(
                f"{ms:.0f}" + (f" [{state}]" if state != "none" and (
                    index == 0 or states[index - 1] != state) else "")
                for index, (ms, state) in enumerate(zip(shown, states))))
        for run_name, run in case["runs"].items():
            lines = [line for line in run.get("mucudnn_lines", []) if line["session"]]
            if lines:
                out += ["", f"Session lines, {run_name} run:", ""]
                out += [f"    {line['at_s']:8.2f} s  {line['level']}: {line['text']}"
                        for line in lines]
    out += ["", "[state]: how the session ran the steps from there on (train_steps.py reads it "
                "from the session after each step)."]
    shim = document.get("shim", {})
    built = shim.get("error") or f"built (or found built) in {shim.get('seconds')} s"
    out += ["", f"Shim: {built} before the runs; device {args.device}."]
    return "\n".join(out) + "\n"


def driver(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
    base_env = dict(os.environ, PYTHONUNBUFFERED="1", MUCUDNN_LOG_LEVEL="info",
                    PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT),
                                                             os.environ.get("PYTHONPATH")))))
    document: dict = {"argv": args.argv, "shim": prepare_shim(base_env), "cases": []}

    def save() -> None:
        saved = json.dumps(document, indent=1)
        write_text_atomically(out / "plan_timeline.json", saved)
        write_text_atomically(out / "plan_timeline.md", markdown(document, args))

    planned_runs = [(text, run) for text in args.cases for run in RUNS]
    for text in args.cases:
        model, batch, budget = parse_case(text)
        tag = f"{model}-{batch}"
        cache = (out / f"cache-{tag}").resolve()
        shutil.rmtree(cache, ignore_errors=True)
        cache.mkdir(parents=True)
        plans = cache / "mucudnn" / "offload-plans"
        env = dict(base_env, XDG_CACHE_HOME=str(cache), MUCUDNN_PLAN_CACHE=str(plans))
        case = {"model": model, "batch": batch, "budget": budget, "runs": {}}
        document["cases"].append(case)
        for run_name in RUNS:
            planned_runs.pop(0)
            timeout = args.run_timeout_s if run_name == "first" else args.short_timeout_s
            if deadline is not None:
                # what is left, less --reserve-s for each run after this one
                timeout = min(timeout, deadline - time.monotonic()
                              - args.reserve_s * len(planned_runs))
                if timeout < 15:
                    case["runs"][run_name] = {"status": "skipped", "reason": "time budget spent"}
                    continue
            train = train_command(args, model, batch,
                                  args.pytorch_steps if run_name == "pytorch" else args.steps)
            cmd = train if run_name == "pytorch" else [
                sys.executable, "-m", "mucudnn", "run", "--memory-budget", text.partition("@")[2],
                "--offload", "--", *train]
            print(f"[{time.strftime('%H:%M:%S')}] {text} {run_name}: timeout {timeout:.0f} s",
                  flush=True)
            ran = run_stamped(cmd, env, timeout, out / f"plan_timeline-{tag}-{run_name}.log")
            parsed = parse_run(ran.pop("lines"))
            run = {**ran, "command": cmd, **timeline(parsed, args.steady_ratio,
                                                      args.steady_min_steps),
                   "ready": parsed["ready"], "mucudnn_lines": parsed["mucudnn_lines"],
                   # what the plan cache holds after the run (the first run's plan, if stored)
                   "plan_cache_files": sorted(p.name for p in plans.glob("*"))
                   if plans.is_dir() else []}
            case["runs"][run_name] = run
            print(f"    {run['status']} in {run['wall_s']:.0f} s: {len(run['steps_ms'])} steps, "
                  f"first planned step {run.get('first_planned_step')}, steady from step "
                  f"{run.get('steady_step')}", flush=True)
            save()
    save()
    print(markdown(document, args))


_STAMPED = re.compile(r"^\[\s*(-?[0-9.]+)\] (.*)$")


def read_again(out: Path, args) -> None:
    """Each run of ``out/plan_timeline.json`` read again from its log with this version's
    definitions (``--again``): its JSON and page rewritten, nothing run. What the run was (its
    status, wall time, command, the plan cache's files) stays as recorded."""
    document = json.loads((out / "plan_timeline.json").read_text())
    for case in document["cases"]:
        tag = f"{case['model']}-{case['batch']}"
        for run_name, run in case["runs"].items():
            log = out / f"plan_timeline-{tag}-{run_name}.log"
            if run.get("status") == "skipped" or not log.is_file():
                continue
            lines = [(float(m.group(1)), m.group(2)) for m in map(
                _STAMPED.match, log.read_text().splitlines()) if m is not None]
            parsed = parse_run(lines)
            for key in ("first_planned_step", "first_planned_start_s", "planned_by",
                        "steady_step", "steady_start_s", "steady_median_ms",
                        "steady_p90_over_p50"):
                run.pop(key, None)
            run.update(timeline(parsed, args.steady_ratio, args.steady_min_steps),
                       ready=parsed["ready"], mucudnn_lines=parsed["mucudnn_lines"])
    write_text_atomically(out / "plan_timeline.json", json.dumps(document, indent=1))
    write_text_atomically(out / "plan_timeline.md", markdown(document, args))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["resnet152:128@8GiB", "resnet50:184@5GiB"],
                        help=f"MODEL:BATCH@BUDGET; MODEL of benchmarks/models.py, or {TINY}")
    parser.add_argument("--steps", type=int, default=60, help="steps of each mucudnn run")
    parser.add_argument("--pytorch-steps", type=int, default=15)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    parser.add_argument("--sample", help="one input's shape (default: the model's)")
    parser.add_argument("--steady-ratio", type=float, default=1.05)
    parser.add_argument("--steady-min-steps", type=int, default=5)
    parser.add_argument("--show-steps", type=int, default=20, help="steps listed on the page")
    parser.add_argument("--detail", action="store_true",
                        help="each run's script prints every step's detail in its log "
                             "(train_steps --detail: allocator retries, armed steps, host times)")
    parser.add_argument("--run-timeout-s", type=float, default=240, help="a first run's")
    parser.add_argument("--short-timeout-s", type=float, default=90,
                        help="a PyTorch or cached run's")
    parser.add_argument("--time-budget-s", type=float, help="every run within this")
    parser.add_argument("--reserve-s", type=float, default=30,
                        help="with --time-budget-s: what a run leaves each later one")
    parser.add_argument("--out", default="plan-timeline-out")
    parser.add_argument("--again", metavar="DIR",
                        help="read DIR's runs again from their logs (a page written before a "
                             "definition changed) and rewrite its JSON and page; runs nothing")
    args = parser.parse_args(argv)
    args.argv = argv
    if args.again:
        out = Path(args.again)
        if not (out / "plan_timeline.json").is_file():
            parser.error(f"--again: {out / 'plan_timeline.json'} does not exist")
        recorded = json.loads((out / "plan_timeline.json").read_text()).get("argv", [])
        # the page names the command that ran the runs, with its own options
        args = parser.parse_args([a for a in recorded if a != "--again"])
        args.argv = recorded
        read_again(out, args)
        print(markdown(json.loads((out / "plan_timeline.json").read_text()), args))
        return
    try:   # every case before anything runs: one clear line for a bad one
        for text in args.cases:
            parse_case(text)
    except MucudnnError as exc:
        parser.error(str(exc))
    driver(args)


if __name__ == "__main__":
    main()
