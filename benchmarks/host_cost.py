"""Issue 39 item 6: is the offload session's host time hidden under the device's step?

mucudnn.torch's hooks run in Python on every module and every saved tensor. Per training step
this measures the time the host spends issuing the forward (with the loss) and the backward
(``time.perf_counter`` around ``forward_loss()`` and ``loss.backward()``, nothing synchronised
inside) and its CPU time (``time.process_time``, every thread's: a CUDA backward is issued, its
unpack hooks run, by autograd's device thread while the calling thread waits; the calling
thread's own, ``time.thread_time``, is in the JSON) against the device's step (CUDA events around
the whole step, the device synchronised before it starts and at its end), in these
configurations of one process, rounds alternated (each round starts at the next one):

- ``pytorch``: PyTorch alone;
- ``kept``: an OffloadSession whose budget (``--kept-budget``, default the GPU's memory) is above
  the step's need, so its plan keeps every saved tensor: the hooks' cost alone;
- ``mixed``: an OffloadSession for the case's budget, which offloads and recomputes (the plan's
  kept/offloaded/recomputed counts are in the row: a plan that does not do both is said so).
  The defaults: ResNet-152 N=128 at the issue's 8 GiB; the 3-D U-Net N=2 at 6 GiB, below
  PyTorch's least memory and above the least mucudnn.torch's API has trained in
  (benchmarks/results/offload/offload-h200.md), so that a plan exists and must move much;
- ``kept-armed``, ``mixed-armed`` (asked for by ``--configs``): ``kept`` and ``mixed`` with the
  session's rescue of steps that run out of memory armed at every planned step
  (``OffloadSession(rescue="always")``, mucudnn/torch/rescue.py): the cost of its mode, a Python
  call per op, in the steps it is armed in;
- ``recording``: a fresh OffloadSession per round, whose steps are all recording steps (it is
  given more recording steps than it runs, so it never plans); its first step takes its host
  buffers afresh and is its own row (``recording-first``).

The plan cache is off (``MUCUDNN_PLAN_CACHE=off``): every session records its own steps.

The sessions are mucudnn.torch's API (``OffloadSession(budget)`` as ``mucudnn.torch.session``
makes it), not capped by the allocator (``mucudnn run --memory-budget`` also caps it): the
device step here is what the plan's work takes without the allocator's flushes, so a host time
under it is hidden under a capped step too. Before the rounds, each session runs until its plan
has stayed the same for ``--settle-steps`` steps (recording, planning and its trial done), at
most ``--max-warmup-steps`` steps or ``--settle-timeout-s``; those steps are kept in the JSON
(``warmup``) with what the session was doing.

A step's host time is hidden when the host finished issuing it (forward + backward + optimizer)
before the device finished running it: host time < device step, the end wait then being the
rest. A host time at or over the device step means the step is host-bound, or that the host
waited for the device inside the step (a copy it must see finished): the CPU time
tells these apart only where waiting does not spin.

Each case (``MODEL:BATCH@BUDGET``, benchmarks/models.py's networks) runs in its own process with
a timeout; what it measured is written after every round, so a killed case keeps its rounds.
Writes ``OUT/host_cost.json`` and ``OUT/host_cost.md`` after every case.

    python -m benchmarks.host_cost --cases resnet152:128@8GiB unet3d:2@6GiB --out DIR
    python -m benchmarks.host_cost --device cpu --cases tiny:2@1MiB --rounds 2 --out DIR  # dry run
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.train_steps import TINY, build_training, parse_sample, session_state
from mucudnn.budget import parse_budget
from mucudnn.errors import MucudnnError
from mucudnn.outputs import write_text_atomically

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("pytorch", "kept", "mixed", "recording", "kept-armed", "mixed-armed")
#: what runs unless ``--configs`` says otherwise
DEFAULT_CONFIGS = CONFIGS[:4]
#: configurations of a session whose rescue (mucudnn/torch/rescue.py) is armed at every step
ARMED = {"kept-armed": "kept", "mixed-armed": "mixed"}
#: the metrics of a step, in ms: host wall time of the forward (with the loss), the backward, the
#: optimizer, the whole step; the process's and the calling thread's CPU time of the forward and
#: the backward; the device's step; the host's wait at its end
METRICS = ("fwd_ms", "bwd_ms", "opt_ms", "host_ms", "fwd_cpu_ms", "bwd_cpu_ms", "fwd_thread_ms",
           "bwd_thread_ms", "device_ms", "wait_ms")


def spread(values: list[float]) -> dict | None:
    """Median, least and most of ``values`` (None for none)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def size_text(nbytes: int) -> str:
    """``8 GiB``, ``256 KiB``: the largest binary unit with a whole part."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes} B"


def parse_case(text: str) -> tuple[str, int, int]:
    """``MODEL:BATCH@BUDGET`` -> (model, batch, budget bytes); MucudnnError for a bad one."""
    spec, at, budget = text.partition("@")
    model, colon, batch = spec.partition(":")
    if not (at and colon and model and batch.isdigit() and int(batch) > 0):
        raise MucudnnError(f"case {text!r}: expected MODEL:BATCH@BUDGET, e.g. resnet152:128@8GiB")
    return model, int(batch), parse_budget(budget)


# -- worker: one case, every configuration in one process ------------------------------------------

class Stepper:
    """Times one training step at a time (see the module docstring)."""

    def __init__(self, torch, training, optimizer, cuda: bool):
        self.torch, self.training, self.optimizer, self.cuda = torch, training, optimizer, cuda

    def step(self, session=None) -> dict:
        torch, clock = self.torch, time.perf_counter
        if self.cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        issued = clock()
        if self.cuda:
            start.record()
        self.optimizer.zero_grad(set_to_none=True)
        h0, c0, t0 = clock(), time.process_time(), time.thread_time()
        with session if session is not None else contextlib.nullcontext():
            loss = self.training.forward_loss()
        h1, c1, t1 = clock(), time.process_time(), time.thread_time()
        loss.backward()
        h2, c2, t2 = clock(), time.process_time(), time.thread_time()
        self.optimizer.step()
        h3 = clock()
        if self.cuda:
            end.record()
            end.synchronize()
        h4 = clock()
        device_ms = start.elapsed_time(end) if self.cuda else (h4 - issued) * 1e3
        return {"fwd_ms": (h1 - h0) * 1e3, "bwd_ms": (h2 - h1) * 1e3, "opt_ms": (h3 - h2) * 1e3,
                "host_ms": (h3 - issued) * 1e3, "fwd_cpu_ms": (c1 - c0) * 1e3,
                "bwd_cpu_ms": (c2 - c1) * 1e3, "fwd_thread_ms": (t1 - t0) * 1e3,
                "bwd_thread_ms": (t2 - t1) * 1e3, "device_ms": device_ms,
                "wait_ms": (h4 - h3) * 1e3}


#: a session's states (its own, where it names them) whose next steps may run otherwise
TRANSIENT = ("recording", "planning", "trial", "replanning")


def session_signature(session) -> tuple:
    """What decides how a session runs its next step: its plan, its modes, its state."""
    modes = getattr(session, "modes", None)
    return (id(getattr(session, "plan", None)), tuple(modes) if modes is not None else None,
            session_state(session))


def plan_counts(session) -> dict:
    """The session's modes in force: how many groups kept, offloaded, recomputed."""
    modes = list(getattr(session, "modes", None) or [])
    return {"kept": modes.count("keep"), "offloaded": modes.count("offload"),
            "recomputed": modes.count("recompute"), "groups": len(modes),
            "fell_back": bool(getattr(session, "fell_back", False))}


def worker(args) -> None:
    import torch

    import mucudnn.torch as mt

    cuda = args.device.startswith("cuda")
    if not cuda:   # a dry run: one thread, not every core's (CI machines are small)
        torch.set_num_threads(1)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = False
    torch.manual_seed(0)
    training = build_training(args.model, args.batch, args.device, parse_sample(args.sample))
    optimizer = torch.optim.SGD(training.model.parameters(), lr=0.01, momentum=0.9)
    stepper = Stepper(torch, training, optimizer, cuda)
    started = time.monotonic()
    result: dict = {"model": args.model, "batch": args.batch, "mixed_budget": args.budget_bytes,
                    "device": torch.cuda.get_device_name() if cuda else "cpu",
                    "torch": torch.__version__, "lines": [], "warmup": [],
                    "samples": {name: [] for name in CONFIGS if name in args.configs}}
    current = {"config": None}

    def say(text: str) -> None:
        result["lines"].append({"config": current["config"], "text": text,
                                "at_s": round(time.monotonic() - started, 3)})
        print(f"mucudnn: info: [{current['config']}] {text}", file=sys.stderr, flush=True)

    link_options = {}
    if not cuda:   # CPU tensors have no host link of their own: one where host and device are one
        from mucudnn.torch.runtime import SameMemoryLink
        link_options = {"link": SameMemoryLink(gbps=(1.0, 1.0)), "min_bytes": 0}

    def new_session(budget: int, **options):
        return mt.OffloadSession(budget, say=say, strict=False, **link_options, **options)

    def save() -> None:
        result["elapsed_s"] = round(time.monotonic() - started, 3)
        write_text_atomically(args.result, json.dumps(result))

    kept_budget = args.kept_budget_bytes or (
        torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cuda
        else 1 << 40)
    result["kept_budget"] = kept_budget
    for _ in range(args.pytorch_warmup):   # CUDA, cuDNN and the allocator warmed up outside
        stepper.step()
    if cuda:
        result["pytorch_peak_allocated"] = torch.cuda.max_memory_allocated()
    budgets = {"kept": kept_budget, "mixed": args.budget_bytes}
    sessions = {"kept": new_session(kept_budget), "mixed": new_session(args.budget_bytes)}
    for armed, plain in ARMED.items():
        if armed in args.configs:
            sessions[armed] = new_session(budgets[plain], rescue="always")
    for name, session in sessions.items():
        current["config"] = name
        settle(stepper, session, name, result, args, started)
        result[f"{name}_plan"] = plan_counts(session)
        save()
    configs = [c for c in CONFIGS if c in args.configs]
    for round_index in range(args.rounds):
        if time.monotonic() - started > args.deadline_s:
            result["rounds_cut"] = f"deadline after {round_index} rounds"
            break
        shift = round_index % len(configs)
        for name in configs[shift:] + configs[:shift]:
            current["config"] = name
            run_round(stepper, name, sessions, new_session, result, args, round_index)
        result["rounds"] = round_index + 1
        save()
    for name, session in sessions.items():   # a plan changed in the rounds shows here
        result[f"{name}_plan_after"] = plan_counts(session)
    save()


def settle(stepper, session, name: str, result: dict, args, started: float) -> None:
    """Steps under ``session`` until its plan stayed the same ``--settle-steps`` steps."""
    same, last, steps = 0, None, 0
    # its own limit, and what the rounds need of the case's deadline
    until = min(time.monotonic() + args.settle_timeout_s,
                started + args.deadline_s - args.rounds_reserve_s)
    while same < args.settle_steps and steps < args.max_warmup_steps \
            and time.monotonic() < until:
        sample = stepper.step(session)
        state = session_state(session)
        sample.update(config=name, step=steps + 1, state=state,
                      at_s=round(time.monotonic() - started, 3))
        result["warmup"].append(sample)
        signature = session_signature(session)
        same = same + 1 if signature == last and state not in TRANSIENT else 0
        last, steps = signature, steps + 1
    result[f"{name}_settled"] = same >= args.settle_steps
    result[f"{name}_warmup_steps"] = steps


def run_round(stepper, name: str, sessions: dict, new_session, result: dict, args,
              round_index: int) -> None:
    """One round of one configuration: an untimed step, then ``--steps`` timed ones; the
    recording configuration's steps are a fresh session's, every one timed."""
    samples = result["samples"][name]
    if name == "recording":
        try:   # more recording steps than it runs: it never plans
            session = new_session(args.budget_bytes, record_steps=args.steps + 1)
            steps = args.steps
        except TypeError:   # a session without record_steps records RECORD_STEPS: its first only
            session, steps = new_session(args.budget_bytes), 1
        for index in range(steps):
            sample = stepper.step(session)
            state = session_state(session)
            samples.append(dict(sample, round=round_index, index=index + 1, state=state))
        # its pinned host buffers go back to PyTorch's host cache now, for the next round's
        # session to take, rather than whenever a collection finds the session's cycles
        del session
        gc.collect()
        return
    session = sessions.get(name)
    stepper.step(session)
    for index in range(args.steps):
        sample = stepper.step(session)
        state = session_state(session)
        samples.append(dict(sample, round=round_index, index=index + 1, state=state))


# -- driver ----------------------------------------------------------------------------------------

def summarize(samples: list[dict]) -> dict:
    out = {metric: spread([s[metric] for s in samples]) for metric in METRICS}
    out["cpu_ms"] = spread([s["fwd_cpu_ms"] + s["bwd_cpu_ms"] for s in samples])
    out["hidden_steps"] = sum(1 for s in samples if s["host_ms"] < s["device_ms"])
    out["steps"] = len(samples)
    return out


def rows_of(case: dict, dry: bool = False) -> list[dict]:
    """The table's rows of one case: one per configuration measured (the recording's first
    steps apart from its later ones)."""
    samples = case.get("samples", {})
    # a fresh session's steps that it ran as a recording (any other is no recording's time)
    recorded = [s for s in samples.get("recording", []) if s["state"] == "recording"]
    groups = {"pytorch": samples.get("pytorch", []), "kept": samples.get("kept", []),
              "mixed": samples.get("mixed", []),
              **{name: samples.get(name, []) for name in ARMED},
              "recording-first": [s for s in recorded if s["index"] == 1],
              "recording": [s for s in recorded if s["index"] > 1]}
    base = spread([s["device_ms"] for s in groups["pytorch"]])
    rows = []
    for name, group in groups.items():
        if not group:
            continue
        summary = summarize(group)
        row = {"config": name, **summary}
        host, device = summary["host_ms"]["median"], summary["device_ms"]["median"]
        # on the CPU the "device" is the host itself: nothing is hidden or not
        row["hidden"] = None if dry else host < device
        if base:
            row["device_vs_pytorch"] = device / base["median"]
        plan = case.get(f"{name}_plan")
        if plan:
            row["plan"] = plan
        rows.append(row)
    return rows


def cell(stat: dict | None) -> str:
    if not stat:
        return "—"
    return f"{stat['median']:.1f} ({stat['min']:.1f}–{stat['max']:.1f})"


def plan_cell(row: dict) -> str:
    plan = row.get("plan")
    if not plan:
        return "—"
    text = f"{plan['kept']}/{plan['offloaded']}/{plan['recomputed']}"
    if plan.get("fell_back"):
        text += " (fell back)"
    elif row["config"] == "mixed" and not (plan["offloaded"] and plan["recomputed"]):
        text += " (not mixed)"
    elif row["config"] == "kept" and plan["kept"] != plan["groups"]:
        text += " (not all kept)"
    return text


def markdown(cases: list[dict], args) -> str:
    dry = not args.device.startswith("cuda")
    out = ["# Host time of a training step with and without the offload session", "",
           f"`python -m benchmarks.host_cost {' '.join(args.argv)}`" if args.argv else "", "",
           "Median (least–most) over the timed steps of every round; ms. Host: the Python "
           "thread's wall time issuing the forward with the loss (fwd), the backward (bwd), and "
           "the whole step with the optimizer (total); CPU: the process's CPU time of fwd + bwd; "
           "device: CUDA events around the step; wait: the host's wait for the device at the "
           "step's end. Hidden: the host's total under the device's step (the step is not "
           "host-bound); steps hidden counts the steps where it was. Plan: groups "
           "kept/offloaded/recomputed.", ""]
    if dry:
        out += ["**Dry run on the CPU**: the device time is the host's wall time; nothing here "
                "says anything of a GPU.", ""]
    out += ["| model | config | plan | host fwd | host bwd | host total | CPU fwd + bwd | device "
            "step | wait at end | hidden | steps hidden | device × PyTorch |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        where = f"{case['model']} N={case['batch']} @ {size_text(case['mixed_budget'])}"
        if case.get("status") != "ok" and not case.get("samples"):
            out.append(f"| {where} | {case.get('status')}: "
                       f"{case.get('reason', '')[-200:]} |" + " |" * 10)
            continue
        for row in rows_of(case, dry):
            out.append("| " + " | ".join([
                where, row["config"], plan_cell(row), cell(row["fwd_ms"]), cell(row["bwd_ms"]),
                cell(row["host_ms"]), cell(row["cpu_ms"]), cell(row["device_ms"]),
                cell(row["wait_ms"]), hidden_cell(row["hidden"]),
                f"{row['hidden_steps']}/{row['steps']}",
                f"{row['device_vs_pytorch']:.3f}" if "device_vs_pytorch" in row else "—"]) + " |")
        notes = []
        if case.get("status") != "ok":
            notes.append(f"status {case.get('status')}: {case.get('reason', '')[-300:]}")
        for name in ("kept", "mixed"):
            if case.get(f"{name}_settled") is False:
                notes.append(f"the {name} session's plan had not settled after "
                             f"{case.get(f'{name}_warmup_steps')} steps")
            before, after = case.get(f"{name}_plan"), case.get(f"{name}_plan_after")
            if before and after and before != after:
                notes.append(f"the {name} session's plan changed during the rounds: "
                             f"{plan_text(before)} -> {plan_text(after)}")
        if case.get("rounds_cut"):
            notes.append(f"rounds cut: {case['rounds_cut']}")
        out += [f"- {where}: {note}" for note in notes]
    out += ["", f"Device: {cases[0].get('device', '?') if cases else '?'}; PyTorch "
                f"{cases[0].get('torch', '?') if cases else '?'}."]
    return "\n".join(out) + "\n"


def hidden_cell(hidden: bool | None) -> str:
    return "—" if hidden is None else "yes" if hidden else "**no: host-bound**"


def plan_text(plan: dict) -> str:
    return f"{plan['kept']}/{plan['offloaded']}/{plan['recomputed']}" + \
        (" fell back" if plan.get("fell_back") else "")


def run_case(args, text: str, timeout_s: float, out: Path) -> dict:
    """One case in its own process (its process group killed past ``timeout_s``)."""
    model, batch, budget = parse_case(text)
    partial = out / f"host_cost-{model}-{batch}.partial.json"
    partial.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.host_cost", "worker", "--model", model,
           "--batch", str(batch), "--budget-bytes", str(budget), "--result", str(partial),
           "--device", args.device, "--rounds", str(args.rounds), "--steps", str(args.steps),
           "--settle-steps", str(args.settle_steps),
           "--max-warmup-steps", str(args.max_warmup_steps),
           "--settle-timeout-s", str(args.settle_timeout_s),
           "--pytorch-warmup", str(args.pytorch_warmup),
           "--rounds-reserve-s", str(args.rounds_reserve_s),
           "--kept-budget-bytes", str(args.kept_budget_bytes or 0),
           "--deadline-s", str(max(1.0, timeout_s - 15)), "--configs", *args.configs]
    if args.sample:
        cmd += ["--sample", args.sample]
    # no plan cache: every session here records its own steps (a fresh one loading the plan
    # another stored would run no recording step)
    env = dict(os.environ, PYTHONUNBUFFERED="1", MUCUDNN_PLAN_CACHE="off",
               PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    print(f"[{time.strftime('%H:%M:%S')}] {text}: timeout {timeout_s:.0f} s", flush=True)
    log = out / f"host_cost-{model}-{batch}.log"
    status, reason = "ok", ""
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                cwd=ROOT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
            if code != 0:
                status, reason = "failed", f"exit {code}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status, reason = "timeout", f"killed after {timeout_s:.0f} s"
    case = {"model": model, "batch": batch, "mixed_budget": budget}
    if partial.exists():
        case.update(json.loads(partial.read_text()))
        partial.unlink()
    if status != "ok":
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        reason += ("; " if reason else "") + " / ".join(tail)
    case.update(status=status, reason=reason, log=log.name)
    print(f"    {status} {reason}"[:400], flush=True)
    return case


def driver(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.time_budget_s is None else time.monotonic() + args.time_budget_s
    cases: list[dict] = []

    def save() -> None:
        document = {"argv": args.argv, "cases": cases}
        write_text_atomically(out / "host_cost.json", json.dumps(document, indent=1))
        write_text_atomically(out / "host_cost.md", markdown(cases, args))

    for index, text in enumerate(args.cases):
        timeout = args.case_timeout_s
        if deadline is not None:
            # what is left, less --case-reserve-s for each case after this one
            later = len(args.cases) - index - 1
            timeout = min(timeout, deadline - time.monotonic() - later * args.case_reserve_s)
            if timeout < 20:
                model, batch, budget = parse_case(text)
                cases.append({"model": model, "batch": batch, "mixed_budget": budget,
                              "status": "skipped", "reason": "time budget spent"})
                continue
        cases.append(run_case(args, text, timeout, out))
        save()
    save()
    print(markdown(cases, args))


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="role")
    work = sub.add_parser("worker", help="one case (internal)")
    for p in (parser, work):
        p.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
        p.add_argument("--sample", help="one input's shape (default: the model's), e.g. 1,8,8,8")
        p.add_argument("--rounds", type=int, default=5)
        p.add_argument("--steps", type=int, default=3, help="timed steps per round and config")
        p.add_argument("--settle-steps", type=int, default=8,
                       help="a session is settled once its plan stayed the same this many steps")
        p.add_argument("--max-warmup-steps", type=int, default=60)
        p.add_argument("--settle-timeout-s", type=float, default=150)
        p.add_argument("--pytorch-warmup", type=int, default=3)
        p.add_argument("--rounds-reserve-s", type=float, default=35,
                       help="a session settles no later than this before the case's deadline")
        p.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(DEFAULT_CONFIGS))
    parser.add_argument("--cases", nargs="+", default=["resnet152:128@8GiB", "unet3d:2@6GiB"],
                        help=f"MODEL:BATCH@BUDGET (the mixed session's budget); MODEL of "
                             f"benchmarks/models.py, or {TINY}")
    parser.add_argument("--kept-budget", help="the kept session's budget (default: the GPU's "
                                              "memory)")
    parser.add_argument("--case-timeout-s", type=float, default=240)
    parser.add_argument("--time-budget-s", type=float, help="every case within this")
    parser.add_argument("--case-reserve-s", type=float, default=80,
                        help="with --time-budget-s: what a case leaves each later one")
    parser.add_argument("--out", default="host-cost-out")
    work.add_argument("--model", required=True)
    work.add_argument("--batch", type=int, required=True)
    work.add_argument("--budget-bytes", type=int, required=True)
    work.add_argument("--kept-budget-bytes", type=int, default=0)
    work.add_argument("--result", required=True)
    work.add_argument("--deadline-s", type=float, default=1e9)
    args = parser.parse_args(argv)
    if args.role == "worker":
        worker(args)
        return
    args.argv = argv
    try:   # every case and budget before anything runs: one clear line for a bad one
        for text in args.cases:
            parse_case(text)
        args.kept_budget_bytes = parse_budget(args.kept_budget) if args.kept_budget else 0
    except MucudnnError as exc:
        parser.error(str(exc))
    driver(args)


if __name__ == "__main__":
    main()
