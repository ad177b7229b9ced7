"""Issue 12: the shim against plain PyTorch without and under memory pressure, on the GPU.

Three parts, each run on its own (``ratio``, ``minmem``, ``maxbatch``; ``report`` rewrites the
page from the JSON), for models of benchmarks/models.py (``MODEL`` or ``MODEL:BATCH``; default
the issue's N). Every run is benchmarks/shim_pytorch.py's worker (its model, data, loss and CUDA
event timing: median of --steps after --warmup) in its own process, on PyTorch's default cuDNN
path, TF32 on; ``--dtypes fp32`` is fp32 with TF32, ``bf16`` autocast with channels-last inputs
and network. The shim runs in one of two modes:

- ``--shim-mode online`` (default, zero set-up): ``mucudnn run -- WORKER`` with no plan, online
  tuning on (MUCUDNN_ONLINE=1), its measurements in a fresh OUT/online/MODEL (MUCUDNN_ONLINE_DIR).
  Before a setting's timed runs (ratio, minmem), one untimed run (2 steps, no warm-up) tunes: its
  wall time, its two step times and the shim's lines that mention ``online tuning`` are the
  first-use overhead; in maxbatch each probe's warm-up step tunes its own batch size;
- ``--shim-mode front``: an offline front plan (record, ``mucudnn bench``, ``mucudnn tune`` with
  no limit: benchmarks/never_slower.py's prepare), ``mucudnn run --plan FRONT``.

Parts (each writes OUT/pressure-PART.json after every configuration and prints one line each):

- ``ratio`` (a): per setting (dtype x cudnn.benchmark off/on) and model, --rounds rounds of
  PyTorch then the shim, back to back; the ratio shim/PyTorch of each round and their median.
  Target: <= 1.01 everywhere.
- ``minmem`` (b): per model and side (PyTorch, shim), the smallest per-process cap
  (torch.cuda.set_per_process_memory_fraction) on a --cap-step GiB grid at which --probe-steps
  steps after one warm-up succeed. Bisection, one process per probe, bracketed by an uncapped
  run's peak allocated x --low-fraction (assumed to fail; checked when every probe passes) and peak
  reserved (checked first; the bracket widens when it fails); the shim's bracket is PyTorch's
  minimum and --shim-low-fraction of it. The step time at the minimum is that probe's. Targets:
  the shim never needs more than PyTorch; on 3-D models <= 0.8x of it, at <= 1.10x PyTorch's
  unconstrained step. ``--offload`` adds a third side, "shim + offload": the shim as above run
  through `mucudnn run --memory-budget CAP --offload` (the CLI's own path: its budget hook limits
  the allocator and tells the shim; mucudnn.torch keeps, offloads or recomputes saved tensors,
  docs/torch.md), bracketed by the smaller minimum found and --offload-low-fraction of it; its
  probes warm up --offload-warmup steps (>= 13: mucudnn.torch records 2 before its plan applies,
  and may try three plans 3 steps each),
  and keep mucudnn.torch's plan line (``offload_lines``; MUCUDNN_LOG_LEVEL=info, the shim's lines
  in OUT/logs). Its allocator is the part's (the CLI's expandable_segments default does not
  apply; set PYTORCH_CUDA_ALLOC_CONF for every run). On a 3-D model it first probes the target's
  own cap once ("target": 0.8x PyTorch's minimum, down to the grid; a capped step need not grow as
  the cap shrinks). Then a fourth search, "fast": the smallest cap at which shim + offload trains
  with a step <= 1.10x PyTorch's unconstrained step (both of the issue's 3-D targets at one cap; a
  slower run fails), between --fast-low-fraction of the smaller minimum and that minimum; the
  offload probes share their runs. --offload-searches picks among target, fast and any;
  --no-shim-search leaves the shim alone out. Each searched shim side gets
  ``vs_pytorch_min``, ``vs_pytorch_uncapped_step`` and ``target_met`` in the JSON; the fast
  search also ``slower_above_gib``, the larger caps below PyTorch's minimum probed (by it or the
  target) at which the run was slower than that, where the target is then not met (its
  bisection assumes a larger cap is never slower).
- ``maxbatch`` (c): per model and side, the largest batch that trains under a --cap GiB cap (24):
  from N doubling until it fails (halving if N fails), then bisection to --resolution (5 %); the
  shim starts from PyTorch's largest, growing by --seeded-growth. images/s at the largest. Target:
  the shim's >= PyTorch's.

Under a cap the shim runs as a user runs it there, `mucudnn run --memory-budget CAP` (its room
then chooses workspaces within what the cap leaves, as on a GPU of that size, counting what
PyTorch's cache holds free; the part's allocator stays PYTORCH_CUDA_ALLOC_CONF, not the CLI's
default; --no-shim-budget: not told, except offload runs, which need it). Running out of memory
is a result ("oom"), as is a run past --probe-timeout-s ("timeout", its process group killed). --time-budget-s: no new run starts once that many seconds have passed;
what was not run is listed under "skipped". --gpus 0,1,...: models spread over those GPUs (one
child process per model, CUDA_VISIBLE_DEVICES), results merged. The page OUT/pressure-GPU.md
(tables of every part found in OUT) is written after each part; commit it under
benchmarks/results/.

    python -m benchmarks.pressure ratio --models resnet50 r3d_18 --dtypes fp32 bf16 --out DIR
    python -m benchmarks.pressure minmem --models unet3d r3d_18 --out DIR --time-budget-s 300
    python -m benchmarks.pressure minmem --models r3d_18 --offload --out DIR --time-budget-s 500
    python -m benchmarks.pressure maxbatch --models resnet50 --cap 24 --out DIR
    python -m benchmarks.pressure report --out DIR --to benchmarks/results/pressure-h200.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.models import parse_model, spec_of
# set by `mucudnn run --offload` only; where mucudnn.torch writes its recorded profile
from mucudnn._torch_site.mucudnn_torch_env import ENV_OFFLOAD, ENV_OFFLOAD_PROFILE
from mucudnn.torch.planner import RECORD_STEPS, TRIAL_PLANS, TRIAL_STEPS
from benchmarks.shim_pytorch import worker_command, worker_outcome

PARTS = ("ratio", "minmem", "maxbatch")
DTYPES = {"fp32": "fp32 (TF32 on)", "bf16": "bf16 autocast, channels-last"}
ONLINE_PATTERN = re.compile(r"online tuning", re.IGNORECASE)
# the shim's exit summary: how many kernels this run measured online (docs/shim.md, "Online tuning")
ONLINE_MEASURED = re.compile(r"online tuning: measured (\d+) kernels")
OFFLOAD_PATTERN = re.compile(r"^mucudnn: .*(offload|saved tensor)", re.IGNORECASE)
# mucudnn.torch's OffloadSession records this many steps (its record_steps; every saved tensor
# offloaded, the first pinning the host pool) before its plan applies, and may then try up to
# TRIAL_PLANS plans TRIAL_STEPS steps each: an offload probe's warm-up covers them and two
# planned steps (the first grows the pinned pool and the caching allocator to the plan's
# pattern), so that its timed steps are the kept plan's steady state
OFFLOAD_RECORD_STEPS = RECORD_STEPS
OFFLOAD_MIN_WARMUP = OFFLOAD_RECORD_STEPS + TRIAL_PLANS * TRIAL_STEPS + 2
# the default covers more: a trial whose every plan flushed is followed by the plans for a lower
# target (the 3-D U-Net under 7.0 GiB: three plans, then one alone, session 22)
OFFLOAD_WARMUP = OFFLOAD_MIN_WARMUP + 10
DEVICE_MEMORY_GIB = 140.0   # where a cap search gives up widening its bracket upwards (H200)


class OutOfTime(Exception):
    """The time budget ran out before a run could start."""


class Terminated(Exception):
    """SIGTERM (a stage's timeout): stop, kill the running probe, write what was measured."""


class Budget:
    """--time-budget-s: a deadline for starting runs, and what was not run because of it."""

    def __init__(self, seconds: float | None, clock=time.monotonic):
        self.clock = clock
        self.deadline = None if seconds is None else clock() + seconds
        self.skipped: list[str] = []

    def check(self, what: str, reserve_s: float = 0.0) -> None:
        """OutOfTime unless ``reserve_s`` seconds (kept for what must run later) are left."""
        if self.deadline is not None and self.clock() + reserve_s >= self.deadline:
            self.skipped.append(what)
            raise OutOfTime(what)

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.clock()


# -- searches (pure: probe is any function returning a worker outcome) ----------------------------

class RunFailed(Exception):
    """A search's run failed otherwise than by running out of memory or time."""


def passed(outcome: dict) -> bool:
    return outcome.get("status") == "ok"


def crashed(outcome: dict, where: str) -> None:
    if outcome.get("status") not in ("ok", "oom", "timeout", SLOW):
        raise RunFailed(f"{outcome.get('status')} at {where}: "
                        + (outcome.get("stderr_tail") or "").strip()[-300:])


def min_cap_search(probe, low_gib: float, high_gib: float, *, step_gib: float = 0.25,
                   ceiling_gib: float = DEVICE_MEMORY_GIB, crash_ends_search: bool = True) -> dict:
    """The smallest cap on the grid of ``step_gib`` at which ``probe(cap)`` passes, assuming that
    a larger cap never fails where a smaller one passes. ``high_gib`` is probed first and the
    bracket widens upwards (doubling) while it fails; ``low_gib`` is assumed to fail and probed
    only if every probe above it passed, the bracket then widening downwards. A cap of 0 fails
    without a probe (it would mean no cap). Out of memory and timeouts do not train; a run that
    failed otherwise (a crash) ends the search (``error``): no bisection on crashes, unless
    ``crash_ends_search`` is False (every outcome but ``ok`` then just fails to train). OutOfTime
    from ``probe`` ends the search with ``complete`` False and the bracket known so far."""
    ceiling = max(1, math.floor(ceiling_gib / step_gib + 1e-9))
    lo = min(ceiling - 1, max(0, math.floor(low_gib / step_gib + 1e-9)))
    hi = min(ceiling, max(lo + 1, math.ceil(high_gib / step_gib - 1e-9)))
    outcomes: dict[int, dict] = {}
    probes: list[dict] = []

    def ok(k: int) -> bool:
        if k <= 0:
            return False
        if k not in outcomes:
            outcomes[k] = probe(k * step_gib)
            probes.append({"cap_gib": k * step_gib, **brief(outcomes[k])})
            if crash_ends_search:
                crashed(outcomes[k], f"{k * step_gib:g} GiB")
        return passed(outcomes[k])

    result = {"min_cap_gib": None, "complete": False, "probes": probes}
    try:
        width, lo_failed = hi - lo, False
        while not ok(hi):  # the upper end fails: widen upwards
            lo, lo_failed = hi, True
            if hi >= ceiling:
                result.update(complete=True, note=f"fails even at {hi * step_gib} GiB")
                return result
            width *= 2
            hi = min(ceiling, hi + width)
        while True:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if ok(mid):
                    hi = mid
                else:
                    lo, lo_failed = mid, True
            if lo_failed or lo <= 0 or not ok(lo):
                break
            width *= 2  # the assumed lower end passed too: widen downwards
            hi, lo = lo, max(0, lo - width)
        result.update(min_cap_gib=hi * step_gib, complete=True, at_min=outcomes[hi])
    except RunFailed as exc:
        result.update(error=str(exc))
    except OutOfTime:
        passing = [k for k in outcomes if passed(outcomes[k])]
        failing = [k for k in outcomes if not passed(outcomes[k])]
        result.update(at_most_gib=min(passing) * step_gib if passing else None,
                      above_gib=max(failing) * step_gib if failing else None)
    return result


def max_batch_search(probe, start: int, *, growth: float = 2.0, resolution: float = 0.05,
                     ceiling: int = 1 << 16) -> dict:
    """The largest batch at which ``probe(batch)`` passes, assuming it fails for every larger
    one once it fails: from ``start`` grow by ``growth`` until a failure (or shrink until a pass),
    then bisect until the bracket is within ``resolution`` of the largest passing batch (or 1).
    As in min_cap_search, a crash ends the search (``error``), and OutOfTime from ``probe`` ends
    it with ``complete`` False."""
    outcomes: dict[int, dict] = {}
    probes: list[dict] = []

    def ok(batch: int) -> bool:
        if batch not in outcomes:
            outcomes[batch] = probe(batch)
            probes.append({"batch": batch, **brief(outcomes[batch])})
            crashed(outcomes[batch], f"batch {batch}")
        return passed(outcomes[batch])

    result = {"max_batch": None, "complete": False, "probes": probes}
    try:
        start = max(1, min(start, ceiling))
        if ok(start):
            lo, hi = start, None
            while hi is None:
                if lo >= ceiling:
                    result.update(note=f"passes at the ceiling batch {ceiling}")
                    hi = lo + 1
                    break
                nxt = min(ceiling, max(lo + 1, int(lo * growth)))
                if ok(nxt):
                    lo = nxt
                else:
                    hi = nxt
        else:
            lo, hi = None, start
            while lo is None:
                if hi <= 1:
                    result.update(complete=True, note="fails at batch 1")
                    return result
                nxt = max(1, min(hi - 1, int(hi / growth)))
                if ok(nxt):
                    lo = nxt
                else:
                    hi = nxt
        while hi - lo > max(1, int(resolution * lo)):
            mid = (lo + hi) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid
        result.update(max_batch=lo, complete=True, at_max=outcomes[lo])
    except RunFailed as exc:
        result.update(error=str(exc))
    except OutOfTime:
        passing = [b for b in outcomes if passed(outcomes[b])]
        result.update(at_least=max(passing) if passing else None)
    return result


def brief(outcome: dict) -> dict:
    """The fields of a worker outcome worth keeping per probe."""
    keep = ("status", "step_ms", "peak_bytes", "peak_reserved_bytes", "wall_s", "error", "oom_at",
            "reused_from", "returncode", "offload_lines", "limit_ms", "offload_profile",
            "alloc_retries", "alloc_retries_per_step", "device_frees_per_step", "step_ms_all",
            "device_allocs_per_step",
            "warmup_ms_all", "host_ms_all", "tuned_kernels", "segments", "offload_log",
            "forward_host_ms_all", "forward_ms_all", "host_cpu_ms_all", "gc_ms_all",
            "memory_trace", "host_profile", "profile")
    kept = {k: outcome[k] for k in keep if k in outcome}
    if outcome.get("stderr_tail") and outcome.get("status") != "ok":  # why it failed
        kept["stderr_tail"] = outcome["stderr_tail"][-600:]
    return kept


# -- runs ----------------------------------------------------------------------------------------

class Runner:
    """Runs the worker, one process per run, plain or under the shim, never raising for what the
    run did (OutOfTime when the budget is spent, Terminated on SIGTERM)."""

    def __init__(self, args, budget: Budget, out: Path):
        self.args, self.budget, self.out = args, budget, out
        self.front_plans: dict[tuple[str, int, str], str | None] = {}
        self.front_errors: dict[tuple[str, int, str], str] = {}
        # settings whose first use already ran in this OUT (an earlier ratio part)
        self.tuned: set[tuple[str, int, str, bool]] = set()
        if args.part != "ratio":
            for model, entry in read_part(out, "ratio").get("models", {}).items():
                for row in entry.get("settings", {}).values():
                    if (row.get("first_use") or {}).get("status") == "ok" \
                            and self.online_dir(model).is_dir():
                        self.tuned.add((model, entry["batch"], row["dtype"], row["cudnn_benchmark"]))

    def online_dir(self, model: str) -> Path:
        return self.out / "online" / model

    def run(self, what: str, model: str, batch: int, *, shim: bool, dtype: str,
            cudnn_benchmark: bool, cap_gib: float = 0.0, steps: int, warmup: int,
            log: Path | None = None, offload: bool = False, profile_steps: int = 0) -> dict:
        """One worker run. ``offload`` (with ``shim`` and a cap): through `mucudnn run
        --memory-budget CAP --offload`, the CLI's own path (the budget hook limits the allocator
        and tells the shim; mucudnn.torch keeps, offloads or recomputes saved tensors).
        ``profile_steps``: after the timed steps, that many more under the profiler (the
        worker's ``--profile``: where the step's time went)."""
        if offload and not (shim and cap_gib):
            raise ValueError("an offload run is a shim run under a cap")
        self.budget.check(what)
        env_extra, plan = {}, None
        if shim and self.args.shim_mode == "online":
            self.online_dir(model).mkdir(parents=True, exist_ok=True)
            env_extra = {"MUCUDNN_ONLINE": "1", "MUCUDNN_ONLINE_DIR": str(self.online_dir(model))}
        elif shim:
            plan = self.front_plan(model, batch, dtype)
            if plan is None:
                error = self.front_errors[(model, batch, dtype)]
                print(f"    {what}: failed (no front plan: {error[-200:]})", flush=True)
                return {"status": "failed", "stderr_tail": f"no front plan: {error}"}
        # The cap is the allocator's, invisible in the device's free memory. The shim is told it
        # as a user tells it, `mucudnn run --memory-budget CAP` (so that its room, docs/shim.md,
        # sees it, as on a GPU of that size, and sees what PyTorch's cache holds free through the
        # CLI's PyTorch site); --no-shim-budget: not at all (offload runs always: it needs it)
        cli_budget = shim and cap_gib and (self.args.shim_budget or offload)
        if cli_budget and log is None:  # offload runs among them
            # mucudnn.torch says its plan (or its fall-back) at info level, on stderr; the shim's
            # own info lines go to this file
            what = "offload" if offload else "shim"
            log = self.out / "logs" / f"{model}-{batch}-{dtype}-{what}-{cap_gib:g}GiB.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.unlink(missing_ok=True)
        cmd, env = worker_command(model, env_extra, tf32=True, shim=shim, steps=steps,
                                  warmup=warmup, cudnn_benchmark=cudnn_benchmark, plan=plan,
                                  log=str(log) if log else None, batch=batch, path="default",
                                  dtype=dtype, memory_cap_gib=cap_gib,
                                  online=shim and self.args.shim_mode == "online",
                                  memory_budget=int(cap_gib * 2**30) if cli_budget else None,
                                  offload=offload, profile=profile_steps,
                                  memory_trace=bool(cap_gib) and self.args.memory_trace)
        # only where this run asks for it (an offload run's budget and offload: the CLI sets them)
        for name in ("MUCUDNN_ONLINE", "MUCUDNN_ONLINE_DIR", "MUCUDNN_MEMORY_BUDGET", ENV_OFFLOAD,
                     ENV_OFFLOAD_PROFILE):
            if name not in env_extra:
                env.pop(name, None)
        profile = None
        if offload:  # the recorded profile and plan, for the planner to be replayed off the GPU
            profile = log.with_name(log.stem + "-profile.json")
            profile.unlink(missing_ok=True)
            env[ENV_OFFLOAD_PROFILE] = str(profile)
        if cli_budget:
            # `mucudnn run --memory-budget` turns on expandable segments unless the allocator is
            # configured: configured here as the part's, so that every run has the same allocator
            env["PYTORCH_CUDA_ALLOC_CONF"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        rc, stdout, stderr, wall_s, timed_out = execute(cmd, env, self.args.probe_timeout_s)
        outcome = ({"status": "timeout", "stderr_tail": stderr[-1500:]} if timed_out
                   else worker_outcome(rc, stdout, stderr))
        outcome["wall_s"] = round(wall_s, 2)
        if shim:
            logged = log.read_text(errors="replace") if log and log.exists() else ""
            # the shim's exit report comes last: keep the last lines that mention online tuning
            outcome["online_lines"] = [line.strip() for line in (logged + "\n" + stderr).splitlines()
                                       if ONLINE_PATTERN.search(line)][-5:]
            tuned = tuned_kernels(outcome["online_lines"])
            if tuned is not None:
                outcome["tuned_kernels"] = tuned
        if offload:  # the plan the probe ran (or that it fell back to offloading everything)
            outcome["offload_lines"] = [line.strip()[:300] for line in stderr.splitlines()
                                        if OFFLOAD_PATTERN.search(line)][-3:]
            if profile.exists():
                outcome["offload_profile"] = str(profile.relative_to(self.out))
            if log.exists():   # the shim's lines: the points its kernels took
                outcome["offload_log"] = str(log.relative_to(self.out))
        print(f"    {what}: {outcome['status']}" + (f" {outcome['step_ms']:.2f} ms"
              if "step_ms" in outcome else "") + f" ({wall_s:.1f} s)", flush=True)
        return outcome

    def front_plan(self, model: str, batch: int, dtype: str) -> str | None:
        """Front mode: the plan of (model, batch, dtype), made on first use (record, bench,
        tune); None, with the reason in front_errors, where making it failed (tried once)."""
        key = (model, batch, dtype)
        if key not in self.front_plans:
            from benchmarks.never_slower import prepare
            self.budget.check(f"front plan {model}:{batch} {dtype}")
            plans = self.out / "front"
            plans.mkdir(parents=True, exist_ok=True)
            try:
                made = prepare(model, batch, plans, "64MiB", dtype=dtype)
                self.front_plans[key] = made["plans"]["front"]
            except RuntimeError as exc:  # recording, bench or tune failed
                self.front_plans[key], self.front_errors[key] = None, str(exc)[-1500:]
        return self.front_plans[key]

    def first_use(self, model: str, batch: int, dtype: str, cudnn_benchmark: bool) -> dict | None:
        """Online mode: one untimed run that tunes what the setting runs (once per model, batch,
        dtype and benchmark mode), so that timed runs start tuned. None in front mode or when done."""
        key = (model, batch, dtype, cudnn_benchmark)
        if self.args.shim_mode != "online" or key in self.tuned:
            return None
        self.tuned.add(key)
        log = self.out / "logs" / f"{model}-{batch}-{dtype}-bench{int(cudnn_benchmark)}-tuning.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        outcome = self.run(f"{model}:{batch} {dtype} benchmark {on_off(cudnn_benchmark)} first use",
                           model, batch, shim=True, dtype=dtype, cudnn_benchmark=cudnn_benchmark,
                           steps=2, warmup=0, log=log)
        return {**brief(outcome), "step_ms_all": outcome.get("step_ms_all"),
                "online_lines": outcome.get("online_lines", []), "log": log.name}


def execute(cmd: list[str], env: dict, timeout_s: float) -> tuple[int, str, str, float, bool]:
    """Run ``cmd`` in a session of its own; past ``timeout_s``, or when this process is
    terminated, kill that whole process group (the worker runs as a grandchild under `mucudnn
    run`, and must not hold GPU memory while the next probe runs)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        return proc.returncode, stdout, stderr, time.perf_counter() - t0, False
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        stdout, stderr = proc.communicate()
        return proc.returncode, stdout, stderr, time.perf_counter() - t0, True
    except BaseException:
        _kill_group(proc)
        proc.communicate()
        raise


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def on_off(flag: bool) -> str:
    return "on" if flag else "off"


def setting_key(dtype: str, cudnn_benchmark: bool) -> str:
    return f"{dtype}/benchmark-{on_off(cudnn_benchmark)}"


# -- parts ---------------------------------------------------------------------------------------

class Report:
    """One part's JSON, rewritten after every configuration."""

    def __init__(self, part: str, args, out: Path, budget: Budget):
        self.path = out / f"pressure-{part}.json"
        self.budget = budget
        self.data = {"part": part, "device": None,
                     "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "settings": settings_of(args), "models": {}, "skipped": budget.skipped}

    def note_device(self, outcome: dict) -> None:
        if outcome.get("device") and not self.data["device"]:
            self.data["device"] = outcome["device"]

    def save(self) -> None:
        from mucudnn.outputs import write_text_atomically
        write_text_atomically(self.path, json.dumps(self.data, indent=1) + "\n")


#: the settings that change which point a convolution runs (docs/shim.md) and what mucudnn.torch
#: plans for (docs/torch.md); a part records those its stage set (``shim_environment``)
RUN_CHOICES = ("MUCUDNN_WORKSPACE_LIMIT", "MUCUDNN_WORKSPACE_SLACK", "MUCUDNN_OFFLOAD_HEADROOM")


def settings_of(args) -> dict:
    keep = ("shim_mode", "dtypes", "benchmark", "rounds", "steps", "warmup", "probe_steps",
            "target_steps",
            "cap_step", "low_fraction", "shim_low_fraction", "cap", "resolution",
            "seeded_growth", "shim_budget", "time_budget_s", "probe_timeout_s", "offload",
            "offload_warmup", "offload_profile_steps", "offload_low_fraction",
            "fast_low_fraction", "shim_search", "offload_searches", "memory_trace")
    settings = {k: getattr(args, k) for k in keep if hasattr(args, k)}
    # every run of the part inherits it, PyTorch's and the shim's alike
    settings["allocator"] = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    # the shim's runs inherit these where the stage's environment sets them
    shim_env = {name: os.environ[name] for name in RUN_CHOICES if name in os.environ}
    if shim_env:
        settings["shim_environment"] = shim_env
    return settings


def ratio_part(args, runner: Runner, report: Report) -> None:
    models = [parse_model(m) for m in args.models]
    for dtype in args.dtypes:  # settings outside, models inside: a short budget covers every model
        for mode in args.benchmark:
            bench = mode == "on"
            for model, batch in models:
                entry = report.data["models"].setdefault(model, {"batch": batch, "settings": {}})
                row = entry["settings"][setting_key(dtype, bench)] = {
                    "dtype": dtype, "cudnn_benchmark": bench, "rounds": []}
                try:
                    first = runner.first_use(model, batch, dtype, bench)
                    if first:
                        row["first_use"] = first
                    for i in range(args.rounds):
                        what = f"{model}:{batch} {dtype} benchmark {mode} round {i + 1}"
                        torch_run = runner.run(f"{what} PyTorch", model, batch, shim=False,
                                               dtype=dtype, cudnn_benchmark=bench,
                                               steps=args.steps, warmup=args.warmup)
                        report.note_device(torch_run)
                        shim_run = runner.run(f"{what} shim", model, batch, shim=True, dtype=dtype,
                                              cudnn_benchmark=bench, steps=args.steps,
                                              warmup=args.warmup)
                        row["rounds"].append(round_row(torch_run, shim_run))
                        if torch_run["status"] not in ("ok", "oom"):  # no ratio will come of it
                            row["incomplete"] = f"PyTorch run {torch_run['status']}"
                            break
                except OutOfTime:
                    row["incomplete"] = "time budget spent"
                ratios = [r["ratio"] for r in row["rounds"] if r.get("ratio") is not None]
                row["median_ratio"] = statistics.median(ratios) if ratios else None
                report.save()
                print(ratio_line(model, batch, dtype, bench, row), flush=True)


def round_row(torch_run: dict, shim_run: dict) -> dict:
    row = {"pytorch": brief(torch_run), "shim": {**brief(shim_run),
                                                  "online_lines": shim_run.get("online_lines", [])}}
    if passed(torch_run) and passed(shim_run):
        row["ratio"] = shim_run["step_ms"] / torch_run["step_ms"]
    return row


def ratio_line(model, batch, dtype, bench, row) -> str:
    ratios = " ".join(f"{r['ratio']:.4f}" if r.get("ratio") else
                      f"{r['pytorch']['status']}/{r['shim']['status']}" for r in row["rounds"])
    median = row["median_ratio"]
    first = row.get("first_use")
    return (f"[ratio {model}:{batch} {dtype} benchmark {on_off(bench)}] shim/PyTorch {ratios or '-'}"
            f" -> median {'-' if median is None else f'{median:.4f}'}"
            + (f"; first use {first.get('wall_s', '-')} s" if first else "")
            + (f" ({row['incomplete']})" if "incomplete" in row else ""))


# minmem's searches; "fast": shim + offload where its step is at most STEP_RATIO_3D x PyTorch's
# uncapped step (a slower run does not pass), the issue's two targets met at one cap
SIDES = {"pytorch": "PyTorch", "shim": "shim", "offload": "shim + offload",
         "fast": "shim + offload, fast"}
SLOW = "slow"   # a fast search's run that trained, but over the step limit


def minmem_part(args, runner: Runner, report: Report) -> None:
    dtype, bench = args.dtypes[0], args.benchmark[0] == "on"
    reused = previous_uncapped(runner.out, dtype, bench)
    for model, batch in (parse_model(m) for m in args.models):
        entry = report.data["models"][model] = {"batch": batch, "dtype": dtype,
                                                "cudnn_benchmark": bench}
        label = f"{model}:{batch} {dtype} benchmark {on_off(bench)}"

        offload_runs: dict[float, dict] = {}  # cap -> outcome, shared by "offload" and "fast"

        def probe(side: str, steps: int | None = None):
            offload = side in ("offload", "fast")

            def at(cap_gib: float) -> dict:
                if offload and cap_gib in offload_runs:  # run by the other offload search
                    return {**offload_runs[cap_gib], "reused_from": "the other offload search"}
                outcome = runner.run(f"{label} {SIDES[side]} cap {cap_gib:g} GiB", model, batch,
                                     shim=side != "pytorch", offload=offload, dtype=dtype,
                                     cudnn_benchmark=bench, cap_gib=cap_gib,
                                     steps=steps or args.probe_steps,
                                     warmup=args.offload_warmup if offload else 1,
                                     profile_steps=args.offload_profile_steps if offload else 0)
                report.note_device(outcome)
                if offload:
                    offload_runs[cap_gib] = outcome
                return outcome
            return at

        try:
            base = reused.get((model, batch))
            if base is None:
                base = runner.run(f"{label} PyTorch uncapped", model, batch, shim=False,
                                  dtype=dtype, cudnn_benchmark=bench, steps=args.steps,
                                  warmup=args.warmup)
                report.note_device(base)
            entry["pytorch_uncapped"] = brief(base)
            if not passed(base):
                entry["error"] = f"PyTorch uncapped: {base['status']}"
                continue
            allocated, reserved = base["peak_bytes"] / 2**30, base["peak_reserved_bytes"] / 2**30
            entry["pytorch"] = min_cap_search(probe("pytorch"), allocated * args.low_fraction,
                                              reserved, step_gib=args.cap_step)
            report.save()
            first = runner.first_use(model, batch, dtype, bench)
            if first:
                entry["shim_first_use"] = first
            reference = entry["pytorch"].get("min_cap_gib") or entry["pytorch"].get("at_most_gib")
            high = reference or reserved
            if args.offload and "target" in args.offload_searches and is_3d(model) and reference:
                # the target itself, probed at its cap: a capped step need not grow as the cap
                # shrinks (near a run's own minimum the caching allocator flushes its cache
                # often: PyTorch on r3d_18 at 5.75 GiB, 16 times a step)
                entry["target"] = target_probe(probe("fast", args.target_steps), reference,
                                               base["step_ms"], args.cap_step)
                report.save()
            if args.shim_search:
                entry["shim"] = min_cap_search(probe("shim"), high * args.shim_low_fraction, high,
                                               step_gib=args.cap_step)
                report.save()
            if args.offload:
                # offload trains wherever the shim does (its plan keeps what fits): below the
                # smaller minimum; first where it is also fast (down to --fast-low-fraction of
                # that minimum), then at any speed (down to --offload-low-fraction)
                found = [s.get("min_cap_gib") or s.get("at_most_gib")
                         for s in (entry["pytorch"], entry.get("shim") or {})]
                high = min((x for x in found if x), default=reserved)
                if "fast" in args.offload_searches:
                    entry["fast"] = min_cap_search(
                        fast_probe(probe("fast"), STEP_RATIO_3D * base["step_ms"]),
                        high * args.fast_low_fraction, high, step_gib=args.cap_step,
                        ceiling_gib=high)  # slow at the smaller minimum: the target is not met
                    report.save()
                if "any" in args.offload_searches:
                    entry["offload"] = min_cap_search(
                        probe("offload"), high * args.offload_low_fraction,
                        (entry.get("fast") or {}).get("min_cap_gib") or high,
                        step_gib=args.cap_step)
        except OutOfTime:
            entry.setdefault("incomplete", "time budget spent")
        finally:
            for side in ("shim", "offload", "fast"):
                if entry.get(side) is not None:
                    entry[side].update(minmem_targets(model, entry, side))
            report.save()
            print(minmem_line(model, batch, entry), flush=True)


# issue 12 (b) on the 3-D models: a minimum at most this fraction of PyTorch's, with a step there
# at most this multiple of PyTorch's unconstrained step; elsewhere: at most PyTorch's minimum
MIN_FRACTION_3D, STEP_RATIO_3D = 0.8, 1.10


def fast_probe(probe, limit_ms: float):
    """``probe``, where a run that trains with a step over ``limit_ms`` does not pass (status
    SLOW, the outcome otherwise kept): min_cap_search on it finds the smallest cap at which the
    run trains that fast, assuming a larger cap is never slower by more than noise."""
    def at(cap_gib: float) -> dict:
        outcome = probe(cap_gib)
        if passed(outcome) and outcome.get("step_ms", math.inf) > limit_ms:
            return {**outcome, "status": SLOW, "limit_ms": round(limit_ms, 2)}
        return outcome
    return at


def target_probe(probe, pytorch_min_gib: float, base_ms: float, step_gib: float) -> dict:
    """Shim + offload at the 3-D target's cap (:data:`MIN_FRACTION_3D` of PyTorch's minimum, down
    to the grid): its outcome, its step against PyTorch's uncapped ``base_ms`` and whether both
    targets are met there."""
    cap = math.floor(MIN_FRACTION_3D * pytorch_min_gib / step_gib + 1e-9) * step_gib
    if cap <= 0:   # below one grid step: a cap of 0 would be no cap (min_cap_search's rule)
        return {"cap_gib": cap, "status": "not probed", "vs_pytorch_min": 0.0, "target_met": False}
    outcome = probe(cap)
    result = {"cap_gib": cap, **brief(outcome), "vs_pytorch_min": cap / pytorch_min_gib}
    if passed(outcome):
        result["vs_pytorch_uncapped_step"] = outcome["step_ms"] / base_ms
    result["target_met"] = passed(outcome) and result["vs_pytorch_uncapped_step"] <= STEP_RATIO_3D
    return result


def tuned_kernels(online_lines: list[str]) -> int | None:
    """The kernels a shim run measured online, from its exit summary (None: no summary)."""
    found = [int(m.group(1)) for m in map(ONLINE_MEASURED.search, online_lines) if m]
    return found[-1] if found else None


def tuning_note(at_min: dict) -> str:
    """A capped run that tuned kernels online (kernels first seen under the cap: an engine of other
    numerics after a refusal) may have spent its timed steps measuring them: said beside its step
    time, which then is not the steady state."""
    tuned = (at_min or {}).get("tuned_kernels")
    return (f"the shim's run at its minimum tuned {tuned} kernels online, which may be in its "
            "timed steps") if tuned else ""


def is_3d(model: str) -> bool:
    """A model of volumes or clips: (C, D, H, W) samples."""
    return len(spec_of(model).sample) == 4


def minmem_targets(model: str, entry: dict, side: str) -> dict:
    """A side's minimum against PyTorch's (``vs_pytorch_min``), its step there against PyTorch's
    uncapped step (``vs_pytorch_uncapped_step``), and whether they meet the issue's target
    (``target_met``; None while a ratio it needs is missing). The fast search's minimum also
    needs every larger cap probed below PyTorch's minimum (its own and the target's probe) to
    have trained that fast: its bisection assumes a larger cap is never slower, and near the
    cap the 3-D U-Net's step is not monotone (session 17: 113.2 ms at 6.75 GiB, 121.6 at 7.0).
    Those that did not are ``slower_above_gib``, and the target is then not met."""
    own, pytorch = entry.get(side) or {}, entry.get("pytorch") or {}
    base_ms = (entry.get("pytorch_uncapped") or {}).get("step_ms")
    own_ms = (own.get("at_min") or {}).get("step_ms")
    ratios = {}
    if own.get("min_cap_gib") and pytorch.get("min_cap_gib"):
        ratios["vs_pytorch_min"] = own["min_cap_gib"] / pytorch["min_cap_gib"]
    if own_ms and base_ms:
        ratios["vs_pytorch_uncapped_step"] = own_ms / base_ms
    if side == "fast" and own.get("min_cap_gib"):
        ratios["slower_above_gib"] = slower_above(entry, own["min_cap_gib"])
    met = None
    if side == "fast" and own.get("complete") and own.get("min_cap_gib") is None and not own.get("error"):
        met = False  # slow (or failing) even at the smaller minimum, its ceiling: not met there
    elif ratios.get("slower_above_gib"):
        met = False
    elif "vs_pytorch_min" in ratios and not is_3d(model):
        met = ratios["vs_pytorch_min"] <= 1.0
    elif "vs_pytorch_min" in ratios and "vs_pytorch_uncapped_step" in ratios:
        met = (ratios["vs_pytorch_min"] <= MIN_FRACTION_3D
               and ratios["vs_pytorch_uncapped_step"] <= STEP_RATIO_3D)
    return {**ratios, "target_met": met}


def previous_uncapped(out: Path, dtype: str, bench: bool) -> dict:
    """PyTorch's uncapped runs of an earlier ``ratio`` part in the same OUT, same setting: their
    peaks bracket the minimum-memory search without running again."""
    found = {}
    for model, entry in read_part(out, "ratio").get("models", {}).items():
        rounds = entry.get("settings", {}).get(setting_key(dtype, bench), {}).get("rounds", [])
        runs = [r["pytorch"] for r in rounds if passed(r.get("pytorch", {}))]
        if runs and all(k in runs[0] for k in ("peak_bytes", "peak_reserved_bytes")):
            found[(model, entry["batch"])] = {**runs[0], "reused_from": "pressure-ratio.json",
                                              "step_ms": statistics.median(r["step_ms"] for r in runs)}
    return found


def slower_above(entry: dict, min_cap_gib: float) -> list[float]:
    """The caps above ``min_cap_gib`` and below PyTorch's minimum at which an offload probe of
    ``entry`` (the fast search's, the target's) did not train within :data:`STEP_RATIO_3D` of
    PyTorch's uncapped step."""
    base_ms = (entry.get("pytorch_uncapped") or {}).get("step_ms")
    ceiling = (entry.get("pytorch") or {}).get("min_cap_gib") or math.inf
    probes = list((entry.get("fast") or {}).get("probes", [])) + (
        [entry["target"]] if entry.get("target") else [])
    return sorted({p["cap_gib"] for p in probes
                   if min_cap_gib < p.get("cap_gib", 0) < ceiling and base_ms
                   and not (passed(p) and p.get("step_ms", math.inf) <= STEP_RATIO_3D * base_ms)})


def slower_text(caps: list[float]) -> str:
    """:func:`slower_above`'s caps, as the line and the page say them."""
    return f"slower at {', '.join(f'{c:g}' for c in caps)} GiB"


def minmem_line(model, batch, entry) -> str:
    def side(name):
        s = entry.get(name)
        if not s:
            return f"{name} -"
        at = s.get("at_min") or {}
        cap = s.get("min_cap_gib")
        text = f"{name} {cap:g} GiB" if cap is not None else (
            f"{name} <= {s['at_most_gib']:g} GiB (incomplete)" if s.get("at_most_gib") else f"{name} -")
        ratios = [f"{s[k]:.3f}x {what}" for k, what in (("vs_pytorch_min", "PyTorch's min"),
                  ("vs_pytorch_uncapped_step", "its uncapped step")) if s.get(k) is not None]
        ratios += [slower_text(s["slower_above_gib"])] if s.get("slower_above_gib") else []
        return text + (f" {at['step_ms']:.1f} ms" if "step_ms" in at else "") + \
            f" [{len(s['probes'])} probes]" + (f" ({', '.join(ratios)})" if ratios else "")
    return f"[minmem {model}:{batch}] " + ", ".join(
        side(n) for n in SIDES if n in entry) + \
        (f" ({entry['incomplete']})" if "incomplete" in entry else "") + \
        (f" ({entry['error']})" if "error" in entry else "")


def maxbatch_part(args, runner: Runner, report: Report) -> None:
    dtype, bench = args.dtypes[0], args.benchmark[0] == "on"
    report.data["cap_gib"] = args.cap
    for model, batch in (parse_model(m) for m in args.models):
        entry = report.data["models"][model] = {"batch": batch, "dtype": dtype,
                                                "cudnn_benchmark": bench, "cap_gib": args.cap}

        def probe(shim: bool):
            def at(n: int) -> dict:
                outcome = runner.run(f"{model} {dtype} benchmark {on_off(bench)} "
                                     f"{'shim' if shim else 'PyTorch'} batch {n} cap {args.cap:g} GiB",
                                     model, n, shim=shim, dtype=dtype, cudnn_benchmark=bench,
                                     cap_gib=args.cap, steps=args.probe_steps, warmup=1)
                report.note_device(outcome)
                return outcome
            return at

        try:
            entry["pytorch"] = with_throughput(max_batch_search(probe(False), batch,
                                                                resolution=args.resolution))
            report.save()
            # online mode: no separate first use, each probe's warm-up step tunes its batch size
            # (kernels are keyed by their shapes), as a user's first step at a new batch would
            seed = entry["pytorch"].get("max_batch") or batch
            entry["shim"] = with_throughput(max_batch_search(
                probe(True), seed, growth=args.seeded_growth, resolution=args.resolution))
        except OutOfTime:
            entry.setdefault("incomplete", "time budget spent")
        finally:
            report.save()
            print(maxbatch_line(model, entry), flush=True)


def with_throughput(search: dict) -> dict:
    at = search.get("at_max") or {}
    if search.get("max_batch") and at.get("step_ms"):
        search["images_per_s"] = search["max_batch"] * 1000.0 / at["step_ms"]
    return search


def maxbatch_line(model, entry) -> str:
    def side(name):
        s = entry.get(name) or {}
        if s.get("max_batch") is None:
            return f"{name} -" + (f" (>= {s['at_least']})" if s.get("at_least") else "")
        rate = s.get("images_per_s")
        return (f"{name} N={s['max_batch']}" + (f" {rate:.0f}/s" if rate else "")
                + f" [{len(s['probes'])} probes]")
    return f"[maxbatch {model} cap {entry['cap_gib']:g} GiB] " + ", ".join(
        side(n) for n in ("pytorch", "shim")) + (f" ({entry['incomplete']})" if "incomplete" in entry else "")


# -- the page ------------------------------------------------------------------------------------

def gpu_slug(device: str | None) -> str:
    """'NVIDIA H200' -> 'h200', 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    match = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", device or "")
    return match.group(1).lower() if match else "gpu"


def fmt(value, spec=".2f", missing="-") -> str:
    return missing if value is None else format(value, spec)


def markdown(reports: dict) -> str:
    """The results page from the parts' JSON (``{part: data}``, any subset)."""
    device = next((r["device"] for r in reports.values() if r.get("device")), None)
    lines = ["# The shim against PyTorch, without and under memory pressure (issue 12)", "",
             f"Device: {device or 'unknown'}. `python -m benchmarks.pressure` (benchmarks/pressure.py; "
             "worker: benchmarks/shim_pytorch.py, models: benchmarks/models.py), PyTorch's default "
             "cuDNN path, TF32 on, SGD, random data, one process per run.", ""]
    allocators = {r["settings"].get("allocator", "") for r in reports.values()}
    lines += [f"PyTorch's allocator (`PYTORCH_CUDA_ALLOC_CONF`, every run alike): "
              f"{', '.join(f'`{a}`' if a else 'the default' for a in sorted(allocators))}.", ""]
    if "ratio" in reports:
        r = reports["ratio"]
        s = r["settings"]
        lines += ["## (a) No memory pressure: step time shim / PyTorch (target <= 1.01)", "",
                  *started(r),
                  f"Shim mode `{s.get('shim_mode')}`; {s.get('rounds')} rounds of PyTorch then the "
                  f"shim, median of {s.get('steps')} steps after {s.get('warmup')} warm-up each. "
                  "First use: the untimed run that tuned (wall s; first and second step ms).", "",
                  "| model, N | setting | PyTorch ms | shim ms | shim / PyTorch per round | median | "
                  "<= 1.01 | peak allocated GiB PyTorch / shim | first use | note |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for model, entry in r["models"].items():
            for key, row in entry["settings"].items():
                rounds = row["rounds"]
                pt = " ".join(fmt(x["pytorch"].get("step_ms"), ".2f", x["pytorch"]["status"]) for x in rounds)
                sh = " ".join(fmt(x["shim"].get("step_ms"), ".2f", x["shim"]["status"]) for x in rounds)
                per = " ".join(fmt(x.get("ratio"), ".4f") for x in rounds)
                median = row.get("median_ratio")
                peaks = next((f"{x['pytorch']['peak_bytes'] / 2**30:.2f} / {x['shim']['peak_bytes'] / 2**30:.2f}"
                              for x in rounds if x.get("ratio") is not None), "-")
                first = row.get("first_use")
                first_text = "-" if not first else (
                    f"{fmt(first.get('wall_s'), '.1f')} s; "
                    + " / ".join(fmt(t, ".0f") for t in (first.get("step_ms_all") or []))
                    + (f"; {first['online_lines'][-1]}" if first.get("online_lines") else
                       "; no 'online tuning' line" if first.get("status") == "ok" else f"; {first.get('status')}"))
                verdict = "-" if median is None else ("yes" if median <= 1.01 else "**no**")
                lines.append(f"| {model}, {entry['batch']} | {key} | {pt or '-'} | {sh or '-'} | "
                             f"{per or '-'} | {fmt(median, '.4f')} | {verdict} | {peaks} | "
                             f"{first_text.replace('|', '/')} | {row.get('incomplete', '')} |")
        lines += [""]
    if "minmem" in reports:
        r = reports["minmem"]
        s = r["settings"]
        lines += ["## (b) Minimum memory: smallest per-process cap that trains", "",
                  *started(r),
                  f"Caps on a {s.get('cap_step')} GiB grid; a cap passes when {s.get('probe_steps')} "
                  "steps after one warm-up train; step ms: that probe's median. Targets: shim <= "
                  "PyTorch; 3-D models shim <= 0.8x PyTorch, at <= 1.10x PyTorch's unconstrained step.", "",
                  "| model, N | setting | PyTorch uncapped ms (peak alloc / reserved GiB) | "
                  "PyTorch min GiB | ms there | shim min GiB | ms there | shim / PyTorch min | "
                  "shim ms / PyTorch uncapped | probes PyTorch / shim | note |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for model, e in r["models"].items():
            base = e.get("pytorch_uncapped", {})
            pt, sh = e.get("pytorch") or {}, e.get("shim") or {}
            if "shim" not in e and s.get("shim_search") is False:  # --no-shim-search
                sh = {"note": "not searched"}
            sh_ms = (sh.get("at_min") or {}).get("step_ms")
            ratios = minmem_targets(model, e, "shim")
            ratio_min, slow = ratios.get("vs_pytorch_min"), ratios.get("vs_pytorch_uncapped_step")
            base_text = (f"{fmt(base.get('step_ms'))} ({fmt(base.get('peak_bytes', 0) / 2**30)} / "
                         f"{fmt(base.get('peak_reserved_bytes', 0) / 2**30)})") if base.get("step_ms") \
                else base.get("status", "-")
            lines.append(
                f"| {model}, {e['batch']} | {setting_key(e['dtype'], e['cudnn_benchmark'])} | {base_text} | "
                f"{min_text(pt)} | {fmt((pt.get('at_min') or {}).get('step_ms'))} | {min_text(sh)} | "
                f"{fmt(sh_ms)} | {fmt(ratio_min, '.3f')} | {fmt(slow, '.3f')} | "
                f"{len(pt.get('probes', []))} / {len(sh.get('probes', []))} | "
                f"{'; '.join(x for x in (note_of(e), tuning_note(sh.get('at_min'))) if x)} |")
        lines += [""]
        lines += offload_table(r)
    if "maxbatch" in reports:
        r = reports["maxbatch"]
        lines += [f"## (c) Largest batch under a {r.get('cap_gib', '?')} GiB cap (target: shim >= PyTorch)", "",
                  *started(r),
                  f"Bisection on N to {r['settings'].get('resolution')} of it; images/s from that "
                  f"probe's median of {r['settings'].get('probe_steps')} steps.", "",
                  "| model | setting | PyTorch largest N | images/s | shim largest N | images/s | "
                  "shim >= PyTorch | note |",
                  "|---|---|---|---|---|---|---|---|"]
        for model, e in r["models"].items():
            pt, sh = e.get("pytorch") or {}, e.get("shim") or {}
            a, b = pt.get("images_per_s"), sh.get("images_per_s")
            verdict = "-" if a is None or b is None else ("yes" if b >= a else "**no**")
            lines.append(f"| {model} | {setting_key(e['dtype'], e['cudnn_benchmark'])} | "
                         f"{batch_text(pt)} | {fmt(a, '.0f')} | {batch_text(sh)} | {fmt(b, '.0f')} | "
                         f"{verdict} | {note_of(e)} |")
        lines += [""]
    skipped = [what for r in reports.values() for what in r.get("skipped", [])]
    if skipped:
        lines += ["## Not run (time budget spent)", ""] + [f"- {what}" for what in skipped] + [""]
    return "\n".join(lines)


def offload_table(report: dict) -> list[str]:
    """minmem's shim + offload rows (--offload), where any model has them."""
    models = {m: e for m, e in report["models"].items()
              if any(k in e for k in ("offload", "fast", "target"))}
    if not models:
        return []
    s = report["settings"]
    lines = ["### Shim + activation offload (`mucudnn run --memory-budget CAP --offload`)", "",
             f"The shim as above, plus mucudnn.torch keeping, offloading or recomputing saved "
             f"tensors for the cap (docs/torch.md). A cap passes when {s.get('probe_steps')} steps "
             f"after {s.get('offload_warmup')} warm-up train (the first {OFFLOAD_RECORD_STEPS} "
             "record, then the plan applies, or two are tried and the faster kept). "
             "Target on 3-D models: min <= "
             f"{MIN_FRACTION_3D}x PyTorch's, at <= {STEP_RATIO_3D:.2f}x its uncapped step; "
             "elsewhere <= PyTorch's min. On 3-D models, first one probe at the target's cap "
             f"(*target*: {MIN_FRACTION_3D}x PyTorch's min, down to the grid; its median of "
             f"{s.get('target_steps', s.get('probe_steps'))} steps). Two searches: the "
             "smallest cap that trains at any "
             f"speed (*any*), and the smallest where the step is also <= {STEP_RATIO_3D:.2f}x "
             "PyTorch's uncapped step (*fast*; a slower run counts as a failure), both targets "
             "at one cap. They share their runs.", "",
             "| model, N | setting | search | PyTorch uncapped ms | PyTorch min GiB | offload min GiB | "
             "ms there | offload / PyTorch min | offload ms / PyTorch uncapped | target met | "
             "probes | plan at the min | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, e in models.items():
        pt = e.get("pytorch") or {}

        def row(search, minimum, run, ratios, probes, note=""):
            """One row: ``run`` the outcome at ``minimum`` (its step and plan lines)."""
            met = ratios.get("target_met")
            plan = "; ".join(run.get("offload_lines") or []).replace("|", "/") or "-"
            lines.append(
                f"| {model}, {e['batch']} | {setting_key(e['dtype'], e['cudnn_benchmark'])} | "
                f"{search} | {fmt((e.get('pytorch_uncapped') or {}).get('step_ms'))} | "
                f"{min_text(pt)} | {minimum} | {fmt(run.get('step_ms'))} | "
                f"{fmt(ratios.get('vs_pytorch_min'), '.3f')} | "
                f"{fmt(ratios.get('vs_pytorch_uncapped_step'), '.3f')} | "
                f"{'-' if met is None else 'yes' if met else '**no**'} | {probes} | "
                f"{plan[:300]} | {note.replace('|', '/')[:200]} |")

        if "target" in e:
            t = e["target"]
            row("target (one probe)", f"{t['cap_gib']:g} ({t.get('status')})", t, t, 1)
        for side, search in (("fast", "fast"), ("offload", "any")):
            if side in e:
                off, targets = e[side], minmem_targets(model, e, side)
                slower = targets.get("slower_above_gib")
                row(search, min_text(off), off.get("at_min") or {}, targets,
                    len(off.get("probes", [])),
                    "; ".join(x for x in (off.get("error"), e.get("incomplete"),
                                          slower and slower_text(slower)) if x))
    return lines + [""]


def started(report: dict) -> list[str]:
    """When the part started (parts of one page may come from different runs)."""
    return [f"Run started {report['started']}."] if report.get("started") else []


def note_of(entry: dict) -> str:
    """What kept a model's row short: the time budget, a failed run, a crashed search."""
    notes = [entry[k] for k in ("incomplete", "error") if entry.get(k)]
    notes += [f"{side}: {entry[side]['error']}" for side in ("pytorch", "shim")
              if (entry.get(side) or {}).get("error")]
    return "; ".join(notes).replace("|", "/").replace("\n", " ")[:200]


def min_text(search: dict) -> str:
    if search.get("min_cap_gib") is not None:
        return f"{search['min_cap_gib']:g}"
    if search.get("at_most_gib") is not None:
        return f"<= {search['at_most_gib']:g} (incomplete)"
    return search.get("note", "-")


def batch_text(search: dict) -> str:
    if search.get("max_batch") is not None:
        return str(search["max_batch"])
    if search.get("at_least") is not None:
        return f">= {search['at_least']} (incomplete)"
    return search.get("note", "-")


def read_part(out: Path, part: str) -> dict:
    """OUT/pressure-PART.json, or {} where there is none (or it is unreadable)."""
    try:
        return json.loads((out / f"pressure-{part}.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def write_page(out: Path, to: Path | None = None) -> Path | None:
    """Read every part's JSON in ``out``, write the page (``to``, or OUT/pressure-GPU.md) and,
    where minmem ran, its plot beside it (same name, ``-minmem.png``)."""
    from mucudnn.outputs import write_text_atomically
    reports = {part: data for part in PARTS if (data := read_part(out, part))}
    if not reports:
        return None
    device = next((r["device"] for r in reports.values() if r.get("device")), None)
    target = to or out / f"pressure-{gpu_slug(device)}.md"
    write_text_atomically(target, markdown(reports) + "\n")
    if "minmem" in reports:
        from benchmarks.budget_plot import plot
        plot(minmem_rows(reports["minmem"]), target.with_name(target.stem + "-minmem.png"))
    return target


# minmem's sides as benchmarks/offload.py's methods, so that its plot (benchmarks/budget_plot.py)
# draws them: step time against the cap, shim + offload as mucudnn's curve, PyTorch capped as the
# other (the shim alone trains only where PyTorch does: its points are the page's)
PLOT_METHODS = {"pytorch": "pytorch", "offload": "mucudnn", "fast": "mucudnn"}


def minmem_rows(report: dict) -> list[dict]:
    """minmem's probes and minima as benchmarks/offload.py's result rows (budget_plot's input):
    every probe that trained is a point at its cap (a fast search's slow run too: it trained),
    PyTorch's uncapped run an anchor at its peak reserved, each side's minimum a vertical line and
    each cap where a run did not train a dotted one."""
    rows = []
    for model, entry in report.get("models", {}).items():
        base = entry.get("pytorch_uncapped") or {}
        if passed(base) and base.get("peak_reserved_bytes"):
            rows.append({"model": model, "method": "pytorch", "budget_bytes": None, "status": "ok",
                         "step_ms": base["step_ms"], "peak_reserved": base["peak_reserved_bytes"]})
        for side, method in PLOT_METHODS.items():
            search = entry.get(side) or {}
            for probe in search.get("probes", []):
                if probe.get("cap_gib") is None:  # a report of an older layout: nothing to draw
                    continue
                trained = probe.get("status") in ("ok", SLOW)
                rows.append({"model": model, "method": method, "part": "probe",
                             "budget_bytes": int(probe["cap_gib"] * 2**30),
                             "status": "ok" if trained else probe.get("status"),
                             "step_ms": probe.get("step_ms"),
                             "peak_reserved": probe.get("peak_reserved_bytes") or 0})
            if search.get("min_cap_gib") and side != "fast":
                rows.append({"model": model, "method": method, "part": "min",
                             "min_budget_gib": search["min_cap_gib"]})
    return rows


# -- several GPUs ----------------------------------------------------------------------------------

def fan_out(args, argv: list[str], out: Path) -> None:
    """One child per model (``pressure PART --models MODEL --out OUT/parts/MODEL``: its own
    online directory and earlier parts), at most one per GPU at a time, each with what is left of
    the time budget; then each part's JSON merged into OUT."""
    queue = list(args.models)
    gpus = [g for g in args.gpus.split(",") if g]
    running: dict[str, tuple[subprocess.Popen, str, Path]] = {}
    base = strip_options(argv, {"--models", "--out", "--gpus", "--time-budget-s"})
    budget = Budget(args.time_budget_s)
    try:
        while queue or running:
            for gpu in gpus:
                if gpu not in running and queue:
                    model = queue.pop(0)
                    child_out = out / "parts" / model.replace(":", "_")
                    child_out.mkdir(parents=True, exist_ok=True)
                    left = []
                    if budget.deadline is not None:
                        remaining = budget.deadline - budget.clock()
                        if remaining <= 0:
                            print(f"[{args.part}] {model}: not started (time budget spent)", flush=True)
                            continue
                        left = ["--time-budget-s", f"{remaining:.0f}"]
                    log = open(child_out / "child.log", "a")
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.pressure", *base, *left, "--models",
                         model, "--out", str(child_out)],
                        env=dict(os.environ, CUDA_VISIBLE_DEVICES=gpu), stdout=log,
                        stderr=subprocess.STDOUT)
                    log.close()
                    running[gpu] = (proc, model, child_out)
                    print(f"[{args.part}] {model} on GPU {gpu}", flush=True)
            for gpu, (proc, model, child_out) in list(running.items()):
                if proc.poll() is not None:
                    del running[gpu]
                    print((child_out / "child.log").read_text(errors="replace"), flush=True)
            time.sleep(1)
    finally:
        for proc, _, _ in running.values():
            proc.terminate()  # each child kills its probe and writes its JSON
        for proc, _, _ in running.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        merge_parts(out)


def strip_options(argv: list[str], names: set[str]) -> list[str]:
    """``argv`` without the options ``names`` and their values (one or more, up to the next
    option)."""
    kept, skipping = [], False
    for item in argv:
        if item.startswith("--"):
            name = item.split("=", 1)[0]
            skipping = name in names
            if skipping:
                continue
        elif skipping:
            continue
        kept.append(item)
    return kept


def merge_parts(out: Path) -> None:
    """OUT/parts/*/pressure-PART.json -> OUT/pressure-PART.json (models united)."""
    from mucudnn.outputs import write_text_atomically
    for part in PARTS:
        merged = None
        for path in sorted(out.glob(f"parts/*/pressure-{part}.json")):
            data = json.loads(path.read_text())
            if merged is None:
                merged = data
            else:
                merged["models"].update(data["models"])
                merged["skipped"] += data.get("skipped", [])
                merged["device"] = merged["device"] or data.get("device")
        if merged is not None:
            write_text_atomically(out / f"pressure-{part}.json", json.dumps(merged, indent=1) + "\n")


# -- command line --------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=[*PARTS, "report"])
    ap.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "r3d_18", "unet3d",
                                                    "deeplabv3_resnet50"], help="MODEL or MODEL:BATCH")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shim-mode", choices=["online", "front"], default="online")
    ap.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"],
                    help="ratio: each; minmem, maxbatch: the first")
    ap.add_argument("--benchmark", nargs="+", choices=["off", "on"], default=["off", "on"],
                    help="cudnn.benchmark (ratio: each; minmem, maxbatch: the first)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10, help="timed steps of ratio and uncapped runs")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--probe-steps", type=int, default=3, help="timed steps of a probe (after 1 warm-up)")
    ap.add_argument("--target-steps", type=int, default=40,
                    help="minmem --offload: timed steps of the 3-D target's probe, whose median "
                         "the target is judged on (the lent H200's host CPU runs slower for "
                         "stretches of steps: session 23)")
    ap.add_argument("--cap-step", type=float, default=0.25, help="GiB: the grid of minmem caps")
    ap.add_argument("--low-fraction", type=float, default=0.7,
                    help="minmem: PyTorch's lower bracket, this times its uncapped peak allocated")
    ap.add_argument("--shim-low-fraction", type=float, default=0.6,
                    help="minmem: the shim's lower bracket, this times PyTorch's minimum")
    ap.add_argument("--offload", action="store_true",
                    help="minmem: also search the shim + activation offload (`mucudnn run "
                         "--memory-budget CAP --offload`), below the smaller minimum found")
    ap.add_argument("--offload-warmup", type=int, default=OFFLOAD_WARMUP,
                    help=f"minmem --offload: warm-up steps of its probes (at least "
                         f"{OFFLOAD_MIN_WARMUP}: mucudnn.torch records {OFFLOAD_RECORD_STEPS} "
                         f"first, then may try {TRIAL_PLANS} plans {TRIAL_STEPS} steps each, and "
                         "more for a lower target where each flushed the allocator's cache)")
    ap.add_argument("--offload-profile-steps", type=int, default=0, metavar="STEPS",
                    help="minmem --offload: after a probe's timed steps, that many more under "
                         "cProfile (the host's Python: 'host_profile') and that many under "
                         "torch.profiler (where the GPU waited and what the host ran then, the "
                         "host's CUDA calls and where it synchronized: 'profile')")
    ap.add_argument("--offload-low-fraction", type=float, default=0.25,
                    help="minmem --offload: its lower bracket, this times the smaller minimum")
    ap.add_argument("--fast-low-fraction", type=float, default=0.5,
                    help="minmem --offload: the lower bracket of its search for the smallest cap "
                         f"with a step <= {STEP_RATIO_3D}x PyTorch's uncapped, this times the "
                         "smaller minimum")
    ap.add_argument("--offload-searches", nargs="+", choices=["target", "fast", "any"],
                    default=["target", "fast", "any"],
                    help="minmem --offload: the 3-D target's cap probed alone, the fast and the "
                         "any-speed searches")
    ap.add_argument("--no-shim-search", dest="shim_search", action="store_false",
                    help="minmem: search PyTorch (and --offload's sides) only, not the shim alone")
    ap.add_argument("--cap", type=float, default=24.0, help="maxbatch: the cap, GiB")
    ap.add_argument("--resolution", type=float, default=0.05, help="maxbatch: relative bracket")
    ap.add_argument("--seeded-growth", type=float, default=1.25,
                    help="maxbatch: the shim's growth factor from PyTorch's largest batch")
    ap.add_argument("--no-shim-budget", dest="shim_budget", action="store_false",
                    help="under a cap, run the shim without `mucudnn run --memory-budget CAP`")
    ap.add_argument("--time-budget-s", type=float, help="start no run after this many seconds")
    ap.add_argument("--probe-timeout-s", type=float, default=240.0, help="kill a run after this")
    ap.add_argument("--memory-trace", action="store_true",
                    help="each capped run also records one step's allocator history after its "
                         "timed steps: what it held at its most mapped (allocated, freed but not "
                         "yet reusable, cached), its growths and flushes")
    ap.add_argument("--gpus", default="", help="comma-separated GPU indices: models in parallel")
    ap.add_argument("--to", help="report: the page to write (default OUT/pressure-GPU.md)")
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = parser()
    args = ap.parse_args(argv)
    if args.offload and args.part not in ("minmem", "report"):
        ap.error(f"--offload is minmem's (the {args.part} part has no offload runs)")
    if args.offload_warmup < OFFLOAD_MIN_WARMUP:
        ap.error(f"--offload-warmup {args.offload_warmup}: at least {OFFLOAD_MIN_WARMUP} "
                 f"(mucudnn.torch records {OFFLOAD_RECORD_STEPS} steps before its plan applies)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.part == "report":
        page = write_page(out, Path(args.to) if args.to else None)
        print(f"wrote {page}" if page else f"no pressure-*.json in {out}")
        return 0
    def terminate(signum, frame):
        raise Terminated()
    signal.signal(signal.SIGTERM, terminate)
    if args.gpus:
        try:
            fan_out(args, argv, out)  # on Terminated, its children write theirs and it merges
        except Terminated:
            print(f"[{args.part}] terminated: merged what the children measured", flush=True)
        print(f"wrote {write_page(out)}", flush=True)
        return 0
    budget = Budget(args.time_budget_s)
    if args.part == "ratio" and args.shim_mode == "online":
        shutil.rmtree(out / "online", ignore_errors=True)  # zero set-up: every model starts untuned
    runner = Runner(args, budget, out)
    report = Report(args.part, args, out, budget)
    try:
        {"ratio": ratio_part, "minmem": minmem_part, "maxbatch": maxbatch_part}[args.part](
            args, runner, report)
    except Terminated:
        report.data["terminated"] = True
        print(f"[{args.part}] terminated: writing what was measured", flush=True)
    finally:
        report.save()
        page = write_page(out)
    if budget.skipped:
        print(f"[{args.part}] time budget spent: {len(budget.skipped)} run(s) not started, first: "
              f"{budget.skipped[0]}", flush=True)
    print(f"wrote {report.path} and {page}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
