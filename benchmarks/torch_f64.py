"""Float64 training under mucudnn.torch equals plain PyTorch's (issue 37's GPU criterion).

For each model (benchmarks/models.py's network, data and loss, all in float64, at a small batch and
resolution: ``SIZES``), ``--steps`` SGD steps (momentum 0.9; default planner.RECORD_STEPS + 3, so
that a budget session's three steps after its recording run its plan) run, every time from the same
initial weights, data and seed, as:

- ``plain``: PyTorch alone, the reference; ``plain-again``: the same once more, the control (were
  it not bitwise equal, "bitwise" below would mean nothing on this machine);
- ``offload`` / ``recompute``: ``OffloadSession(force="offload")`` / ``force="recompute"``;
- ``budget@roomy``: ``mucudnn.torch.session(B)`` with room for everything: its recorded profile
  gives the range plans choose in, from the least peak any plan reaches (``planning.least_peak``)
  to the peak of keeping everything;
- ``budget@F``: ``mucudnn.torch.session(B)``, B such that the plan's target, ``B * (1 - 0.1)`` (the
  session's default headroom), is the share F of the way down that range. ``--fractions``
  are tried in order until a plan runs offload and recompute in one step (a fraction whose plan
  does not exist, ``InfeasibleError``, is skipped); each fraction tried is a checked row;
- ``fit@F``: ``mucudnn.torch.fit(model, budget=B)`` at the budget that mixed (else the last one
  that planned);
- ``staged`` (``--stage-models``, default VGG-16): ``OffloadSession(budget=2 x the plain peak /
  0.9, stage="always")``: the best staged plan, whatever the plain one predicts.

After every step, every parameter's gradient and the loss are compared with the reference's, and
after the last step every parameter and buffer (batch norm's running statistics). A row passes
where all are bitwise equal (where the control is: else, a kernel of PyTorch's own that is not
repeatable, each tensor within ``--rtol``), or, where the session staged a step (the staged layers' gradients are
sums over micro-batches), each tensor within ``--rtol`` (1e-12) of the reference tensor's largest
magnitude; and where the session did what the row is for, read from its ``trace`` per step (groups
packed kept / offloaded / recomputed, rebuilds, fetches): ``offload`` offloaded and ``recompute``
recomputed in every step, ``budget@F`` and ``fit@F`` offloaded or recomputed in a planned step,
``staged`` ran a planned step with the stage in force (``session.stage``) and fewer groups packed
than its recording packed (the staged layers save nothing). Per model, one ``budget@F`` must have
mixed offload and recompute in one planned step. cuDNN deterministic, TF32 off, cudnn.benchmark
off, CUBLAS_WORKSPACE_CONFIG=:4096:8. The exit status is 1 when any check fails.

Writes ``torch_f64.json`` (every row with its per-step session record and what the session said)
and ``torch_f64.md`` (the table, also printed) into ``--out``.

    python -m benchmarks.torch_f64 --models resnet50 vgg16 r3d_18 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

#: per model: (batch, one sample's shape): float64 fits and a run takes seconds
SIZES = {
    "resnet50": (4, (3, 112, 112)),
    "vgg16": (8, (3, 64, 64)),
    "r3d_18": (2, (3, 16, 56, 56)),
    "unet3d": (1, (1, 32, 32, 32)),
}
DEFAULT_BATCH = 2
HEADROOM = 0.1          # OffloadSession's default headroom (docs/torch.md, "Plan")
RTOL = 1e-12            # staged rows: each tensor within RTOL x its largest magnitude
FRACTIONS = (0.6, 0.8, 0.4, 0.9, 0.2)
LR, MOMENTUM = 0.01, 0.9


# -- one case: a network, its data, its loss -----------------------------------------------------

@dataclass
class Case:
    """A model to train: ``pristine`` (on the CPU) is copied to ``device`` for every run, the
    ``batches`` (one per step, on ``device``) are the same for every run, and every run starts
    from ``torch.manual_seed(seed)`` (dropout's masks)."""

    name: str
    pristine: object
    batches: list
    loss: object
    device: object
    seed: int = 0
    description: str = ""

    def fresh(self):
        return copy.deepcopy(self.pristine).to(self.device)


def model_case(text: str, steps: int, device) -> Case:
    """MODEL or MODEL:N from benchmarks/models.py, float64, at SIZES' batch and sample shape."""
    import torch

    from benchmarks.models import build_network, loss_function, make_batch, spec_of

    name, _, batch = text.partition(":")
    spec = spec_of(name)
    default_batch, sample = SIZES.get(name, (DEFAULT_BATCH, spec.sample))
    batch = int(batch) if batch else default_batch
    torch.manual_seed(0)
    model = build_network(spec, sample).double()
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps):
        inputs, labels = make_batch(spec, batch, generator, sample)
        batches.append((inputs.double().to(device), labels.to(device)))
    return Case(text, model, batches, loss_function(spec), device,
                description=f"N={batch} x {'x'.join(map(str, sample))}")


# -- one run -------------------------------------------------------------------------------------

@dataclass
class Run:
    """What one training run left: per step the loss and each parameter's gradient (CPU
    copies), the parameters and buffers after the last step, and per step what the session did."""

    losses: list = field(default_factory=list)
    grads: list = field(default_factory=list)          # per step: [tensor or None per parameter]
    params: list = field(default_factory=list)
    buffers: list = field(default_factory=list)
    steps: list = field(default_factory=list)          # per step: step_record()
    memory: list = field(default_factory=list)         # per step (CUDA): before, after forward, peak
    error: str | None = None
    seconds: float = 0.0


def step_record(events: list, session) -> dict:
    """A step's trace events (``(event, gid, ...)`` tuples) as counts: the groups packed and the
    mode each ended in (a ``mode`` event turns a kept group into a recomputed one), the rebuilds
    and fetches run; whether the session had a plan and a stage in force."""
    modes: dict = {}
    rebuilds = fetches = 0
    for event in events:
        kind = event[0]
        if kind == "pack":
            modes[event[1]] = event[2]
        elif kind == "mode" and event[1] in modes:
            modes[event[1]] = event[2]
        elif kind == "recompute":
            rebuilds += 1
        elif kind in ("fetch", "prefetch"):
            fetches += 1
    values = list(modes.values())
    record = {"groups": len(values), "kept": values.count("keep"),
              "offloaded": values.count("offload"), "recomputed": values.count("recompute"),
              "rebuilds": rebuilds, "fetches": fetches}
    if session is not None:
        record["planned"] = getattr(session, "plan", None) is not None
        record["stage_in_force"] = getattr(session, "stage", None) is not None
    return record


def _cpu(tensor):
    return None if tensor is None else tensor.detach().to("cpu", copy=True)


def train(case: Case, *, session=None, wrap=None, context=None, trace=None,
          measure: bool = False) -> Run:
    """``len(case.batches)`` SGD steps of a fresh copy of the case's model: plain, with its
    forward inside ``session`` (entered each step), inside ``context()`` (a context manager
    factory: tests), or with the model as ``wrap(model)`` returns it (``fit``). ``trace``: the
    session's trace list, cut per step. ``measure`` (CUDA): per step the memory allocated before
    and after the forward and the step's peak (forward and backward)."""
    import torch

    run, start = Run(), time.perf_counter()
    cuda = torch.device(case.device).type == "cuda"
    torch.manual_seed(case.seed)
    model = case.fresh()
    if wrap is not None:
        model = wrap(model)
        if session is None:
            session = getattr(model, "mucudnn_session", None)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    params = list(model.parameters())
    try:
        for x, y in case.batches:
            optimizer.zero_grad(set_to_none=True)
            seen = len(trace) if trace is not None else 0
            if measure and cuda:
                torch.cuda.synchronize(case.device)
                torch.cuda.reset_peak_memory_stats(case.device)
                before = torch.cuda.memory_allocated(case.device)
            if session is not None and wrap is None:
                enter = session
            elif context is not None:
                enter = context()
            else:
                enter = contextlib.nullcontext()
            with enter:
                loss = case.loss(model(x), y)
            if measure and cuda:
                after_forward = torch.cuda.memory_allocated(case.device)
            loss.backward()
            if measure and cuda:
                torch.cuda.synchronize(case.device)
                run.memory.append({"before": before, "after_forward": after_forward,
                                   "peak": torch.cuda.max_memory_allocated(case.device)})
            run.losses.append(loss.item())
            run.grads.append([_cpu(p.grad) for p in params])
            if trace is not None:
                run.steps.append(step_record(trace[seen:], session))
            del loss
            optimizer.step()
        run.params = [_cpu(p) for p in model.parameters()]
        run.buffers = [_cpu(b) for b in model.buffers()]
    except Exception as exc:   # one failing run must not hide the others
        run.error = f"{type(exc).__name__}: {exc}"[-2000:]
    finally:
        run.seconds = time.perf_counter() - start
        del model, optimizer, params
        gc.collect()
        if cuda:
            torch.cuda.synchronize(case.device)
            torch.cuda.empty_cache()
    return run


def saved_bytes(case: Case) -> int:
    """The bytes the tensors autograd saves in one forward hold (each storage once, parameters
    not counted): what a session's plan decides about."""
    import torch

    torch.manual_seed(case.seed)
    model = case.fresh()
    params = {p.data_ptr() for p in model.parameters()}
    storages: dict = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        x, y = case.batches[0]
        loss = case.loss(model(x), y)
    del loss, model
    gc.collect()
    return sum(storages.values())


# -- comparing two runs --------------------------------------------------------------------------

def _bitwise_equal(a, b) -> bool:
    import torch
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    as_int = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
              torch.bfloat16: torch.int16}.get(a.dtype)
    if as_int is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(as_int), b.contiguous().view(as_int))


class Worst:
    """The largest absolute and relative (to the reference tensor's largest magnitude)
    difference over the tensors compared, and where."""

    def __init__(self):
        self.abs, self.rel, self.where, self.unequal, self.tensors = 0.0, 0.0, None, 0, 0
        self.mismatched: list[str] = []    # shapes, dtypes or None-ness that differ

    def add(self, where: str, ref, got) -> None:
        self.tensors += 1
        if ref is None or got is None:
            if ref is not got:
                self.mismatched.append(f"{where}: {'no reference' if ref is None else 'none'}")
            return
        if ref.shape != got.shape or ref.dtype != got.dtype:
            self.mismatched.append(f"{where}: {tuple(got.shape)} {got.dtype} against "
                                   f"{tuple(ref.shape)} {ref.dtype}")
            return
        if _bitwise_equal(ref, got):
            return
        self.unequal += 1
        if not ref.is_floating_point():
            difference = (ref.long() - got.long()).abs().max().item()
            scale = max(ref.abs().max().item(), 1)
        else:
            difference = (ref - got).abs().max().item()
            scale = ref.abs().max().item()
            if difference != difference:   # NaN where the reference has none (or in both)
                difference = float("inf")
        relative = difference / scale if scale > 0 else float("inf")
        if relative > self.rel or (relative == self.rel and difference > self.abs):
            self.where = where
        self.abs, self.rel = max(self.abs, difference), max(self.rel, relative)

    def passes(self, rtol: float) -> bool:
        return not self.mismatched and (self.unequal == 0 or self.rel <= rtol)

    def as_dict(self) -> dict:
        return {"max_abs": self.abs, "max_rel": self.rel, "worst": self.where,
                "unequal_tensors": self.unequal, "tensors": self.tensors,
                "mismatched": self.mismatched[:10]}


def compare(reference: Run, run: Run, names: list[str], buffer_names: list[str]) -> dict:
    """Gradients (every step), losses, and the parameters and buffers after the last step."""
    import torch

    grads, losses, params, buffers = Worst(), Worst(), Worst(), Worst()
    if len(run.grads) != len(reference.grads):
        grads.mismatched.append(f"{len(run.grads)} steps against {len(reference.grads)}")
    for step, (ref, got) in enumerate(zip(reference.grads, run.grads)):
        for name, a, b in zip(names, ref, got):
            grads.add(f"step {step} {name}.grad", a, b)
    for step, (a, b) in enumerate(zip(reference.losses, run.losses)):
        losses.add(f"step {step} loss", torch.tensor(a, dtype=torch.float64),
                   torch.tensor(b, dtype=torch.float64))
    for name, a, b in zip(names, reference.params, run.params):
        params.add(name, a, b)
    for name, a, b in zip(buffer_names, reference.buffers, run.buffers):
        buffers.add(name, a, b)
    if len(run.params) != len(reference.params):
        params.mismatched.append(f"{len(run.params)} parameters against {len(reference.params)}")
    if len(run.buffers) != len(reference.buffers):
        buffers.mismatched.append(f"{len(run.buffers)} buffers against {len(reference.buffers)}")
    return {"grads": grads, "losses": losses, "params": params, "buffers": buffers}


# -- one checked row -----------------------------------------------------------------------------

#: what each kind of row must have seen the session do (see the module docstring)
REQUIREMENTS = {
    "plain": None,
    "budget-roomy": None,
    "offload": "offloaded in every step",
    "recompute": "recomputed in every step",
    "budget": "offloaded or recomputed in a planned step",
    "fit": "offloaded or recomputed in a planned step",
    "staged": "a planned step staged (stage in force, fewer groups packed than recorded)",
}


def requirement_met(kind: str, steps: list[dict]) -> bool | None:
    if REQUIREMENTS.get(kind) is None:
        return None
    if not steps:
        return False
    planned = [s for s in steps if s.get("planned")]
    if kind == "offload":
        return all(s["offloaded"] > 0 for s in steps)
    if kind == "recompute":
        return all(s["recomputed"] > 0 for s in steps)
    if kind in ("budget", "fit"):
        return any(s["offloaded"] + s["recomputed"] > 0 or staged_step(s, steps)
                   for s in planned)
    if kind == "staged":
        return any(staged_step(s, steps) for s in planned)
    raise ValueError(kind)


def staged_step(step: dict, steps: list[dict]) -> bool:
    """A step run with the stage in force that packed fewer groups than the first (recording)
    step, the staged layers saving nothing; or, where the recording itself staged (a recording
    that would not fit unstaged: ``stage.recording_chunks``), any step with the stage in
    force."""
    return bool(step.get("stage_in_force")) and (
        step["groups"] < steps[0]["groups"] or bool(steps[0].get("stage_in_force")))


def mixed(steps: list[dict]) -> bool:
    """Whether a planned step offloaded and recomputed groups."""
    return any(s.get("planned") and s["offloaded"] > 0 and s["recomputed"] > 0 for s in steps)


def session_summary(session) -> dict:
    """What the session says of itself at the end (public attributes; absent ones left out)."""
    if session is None:
        return {}
    summary = {}
    plan = getattr(session, "plan", None)
    if plan is not None:
        summary["plan"] = {mode: plan.count(mode) for mode in ("keep", "offload", "recompute")}
        with contextlib.suppress(Exception):
            summary["plan_described"] = plan.describe()
    stage = getattr(session, "stage", None)
    if stage is not None:
        inner = getattr(stage, "stage", None)
        summary["stage"] = {name: getattr(inner, name) for name in
                            ("modules", "first_group", "end_group", "chunks")
                            if hasattr(inner, name)}
        with contextlib.suppress(Exception):
            summary["stage_described"] = inner.describe()
    for name in ("fell_back", "kept_after_trial", "replans_used", "target"):
        if hasattr(session, name):
            summary[name] = getattr(session, name)
    return summary


def _release_memory() -> None:
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def check_run(case: Case, reference: Run, mode: str, kind: str, *, make_session=None,
              wrap=None, context=None, rtol: float = RTOL, budget: int | None = None,
              fraction: float | None = None, names=None, buffer_names=None,
              deterministic: bool = True, sessions: list | None = None) -> dict:
    """One row: a run of ``case`` (under ``make_session(trace, say)``'s session, as
    ``wrap(model, trace, say)``, or inside ``context()``) against ``reference``.
    ``deterministic``: plain PyTorch repeats itself bit for bit on this model (the control);
    where it does not (an atomic-add kernel: VGG-16's adaptive pooling backward), every row is
    held to ``rtol`` as a staged one is. ``sessions``: receives the session used."""
    trace, said, fitted = [], [], []
    _release_memory()   # what earlier rows left is no baseline of this row's recording
    session = make_session(trace, said.append) if make_session is not None else None
    if sessions is not None and session is not None:
        sessions.append(session)

    def wrapper(model):
        model = wrap(model, trace, said.append)
        fitted.append(getattr(model, "mucudnn_session", None))
        return model

    run = train(case, session=session, wrap=wrapper if wrap is not None else None,
                context=context,
                trace=trace if (session is not None or wrap is not None) else None)
    if session is None and fitted:
        session = fitted[0]
    row = {"model": case.name, "size": case.description, "mode": mode, "kind": kind,
           "budget": budget, "fraction": fraction, "steps": run.steps, "said": said[-20:],
           "seconds": round(run.seconds, 2)}
    if session is not None:
        row["session"] = session_summary(session)
    if run.error is not None:
        row.update(status="ERROR", error=run.error, reasons=[run.error])
        return row
    names = names or [f"param{i}" for i in range(len(reference.params))]
    buffer_names = buffer_names or [f"buffer{i}" for i in range(len(reference.buffers))]
    found = compare(reference, run, names, buffer_names)
    staged = any(staged_step(s, run.steps) for s in run.steps) if run.steps else False
    tolerance = rtol if staged or not deterministic else 0.0
    row.update(staged=staged, tolerance=tolerance,
               bitwise=all(w.unequal == 0 and not w.mismatched for w in found.values()),
               **{part: worst.as_dict() for part, worst in found.items()})
    reasons = [f"{part}: {worst.unequal} tensors differ, max rel {worst.rel:.3g} at {worst.where}"
               f" (allowed {tolerance:g})" for part, worst in found.items()
               if not worst.passes(tolerance)]
    reasons += [f"{part}: {m}" for part, worst in found.items() for m in worst.mismatched[:3]]
    met = requirement_met(kind, run.steps)
    row["requirement"] = REQUIREMENTS.get(kind)
    row["requirement_met"] = met
    if met is False:
        reasons.append(f"the session did not do what this row is for: {REQUIREMENTS[kind]}")
    row.update(status="FAIL" if reasons else "PASS", reasons=reasons)
    return row


# -- one model -----------------------------------------------------------------------------------

def check_model(case: Case, *, stage: bool = False, fractions=FRACTIONS, rtol: float = RTOL,
                session_options: dict | None = None, say=print,
                deadline: float | None = None) -> dict:
    """Every row of one case (module docstring) and the model's checks. ``session_options``:
    more keyword arguments for every session (CPU tests: a ``link``, ``min_bytes``);
    ``deadline``: a ``time.monotonic()`` after which no further budget fraction is tried."""
    import torch

    import mucudnn.torch as mt
    from mucudnn.errors import InfeasibleError
    from mucudnn.torch.offload_session import OffloadSession

    options = dict(session_options or {})
    pristine = case.pristine
    names = [name for name, _ in pristine.named_parameters()]
    buffer_names = [name for name, _ in pristine.named_buffers()]
    cuda = torch.device(case.device).type == "cuda"
    rows, checks = [], []

    def log(row):
        rows.append(row)
        last = row["steps"][-1] if row.get("steps") else {}
        did = (f"last step {last.get('kept')}/{last.get('offloaded')}/{last.get('recomputed')} "
               f"kept/offloaded/recomputed" if last else "")
        grads = row.get("grads", {})
        say(f"[{case.name}] {row['mode']}: {row['status']} grads max abs "
            f"{grads.get('max_abs', float('nan')):.3g} rel {grads.get('max_rel', float('nan')):.3g}"
            f"{'; staged' if row.get('staged') else ''}; {did} ({row['seconds']} s)"
            + (f"; {'; '.join(row['reasons'][:3])}" if row.get("reasons") else ""))

    reference = train(case, measure=True)
    if reference.error is not None:
        row = {"model": case.name, "size": case.description, "mode": "plain", "kind": "plain",
               "status": "ERROR", "error": reference.error, "reasons": [reference.error],
               "steps": [], "seconds": round(reference.seconds, 2)}
        log(row)
        return {"model": case.name, "rows": rows, "checks": [], "passed": False}
    saved = saved_bytes(case)
    later = reference.memory[1:] or reference.memory
    peak = max((m["peak"] for m in later), default=0) if cuda else saved
    say(f"[{case.name}] {case.description}: plain {len(case.batches)} steps in "
        f"{reference.seconds:.1f} s; peak {peak / 2**20:.1f} MiB, saved per forward "
        f"{saved / 2**20:.1f} MiB")
    common = dict(rtol=rtol, names=names, buffer_names=buffer_names)
    control = check_run(case, reference, "plain-again", "plain", **common)
    if not control["bitwise"]:
        # PyTorch itself is not bit for bit repeatable here: the control is held to rtol, and
        # so is every row (float64 to rounding)
        control = check_run(case, reference, "plain-again", "plain", deterministic=False,
                            **common)
        common["deterministic"] = False
    log(control)

    def session_of(**kwargs):
        return lambda trace, said: OffloadSession(trace=trace, say=said, **kwargs, **options)

    for force in ("offload", "recompute"):
        log(check_run(case, reference, force, force, make_session=session_of(force=force),
                      **common))

    # the range of budgets that make a plan choose: from the least peak any plan reaches to the
    # peak of keeping everything, both from the profile a session with room for all records
    probes: list = []
    log(check_run(case, reference, "budget@roomy", "budget-roomy",
                  budget=int(4 * max(peak, saved) / (1 - HEADROOM)),
                  make_session=lambda trace, said: mt.session(
                      int(4 * max(peak, saved) / (1 - HEADROOM)), trace=trace, say=said,
                      **options), sessions=probes, **common))

    def plans_range(session):
        """(least peak, peak with everything kept) of ``session``'s recorded profile: what its
        recording measured (workspace choices, the allocator) moves both, so each budget is
        taken from the last session that planned."""
        from mucudnn.torch import planner
        from mucudnn.torch import planning
        if session is None or session.profile is None or session.plan is None:
            return 0, peak
        profile = session.profile
        low = planning.least_peak(profile, session.lookahead)
        high = planner.peak_memory(profile, [planner.KEEP] * len(profile.groups),
                                   session.lookahead)
        say(f"[{case.name}] the plans' range: least peak {low / 2**20:.1f} MiB, all kept "
            f"{high / 2**20:.1f} MiB")
        return low, high

    low, high = plans_range(probes[0] if probes else None)
    probes.clear()   # a session holds its last step's modules: none may outlive its row
    chosen, mixing = None, None
    for fraction in fractions:
        if deadline is not None and time.monotonic() > deadline and chosen is not None:
            say(f"[{case.name}] out of time: no budget fraction after {chosen[1]:g} tried")
            break
        # the plan's target: the share ``fraction`` of the way down from all kept to the least
        budget = int((high - fraction * (high - low)) / (1 - HEADROOM))
        tried: list = []
        row = check_run(case, reference, f"budget@{fraction:g}", "budget", budget=budget,
                        fraction=fraction, make_session=lambda trace, said, b=budget: mt.session(
                            b, trace=trace, say=said, **options), sessions=tried, **common)
        if row["status"] == "ERROR" and "InfeasibleError" in row.get("error", ""):
            row["status"] = "INFEASIBLE"
        elif row["status"] == "FAIL" and row.get("requirement_met") is False and \
                len(row["reasons"]) == 1:
            row["status"] = "KEPT-ALL"   # equal, but its plan moved nothing: the next share
        log(row)
        if row["status"] != "INFEASIBLE":
            chosen = (budget, fraction)
            if tried and tried[0].plan is not None:
                low, high = plans_range(tried[0])
            tried.clear()
            if mixed(row["steps"]):
                mixing = chosen
                break
    checks.append({"check": "a budget plan offloaded and recomputed in one planned step",
                   "passed": mixing is not None,
                   "detail": (f"budget@{mixing[1]:g} ({mixing[0] / 2**20:.1f} MiB)" if mixing
                              else f"none of the fractions {list(fractions)}")})
    fit_at = mixing or chosen
    if fit_at is not None:
        budget, fraction = fit_at
        log(check_run(case, reference, f"fit@{fraction:g}", "fit", budget=budget,
                      fraction=fraction, wrap=lambda model, trace, said, b=budget: mt.fit(
                          model, budget=b, trace=trace, say=said, **options), **common))
    else:
        checks.append({"check": "fit ran", "passed": False,
                       "detail": "no budget fraction had a plan"})
    if stage:
        budget = int(2 * peak / (1 - HEADROOM))
        log(check_run(case, reference, "staged", "staged", budget=budget,
                      make_session=session_of(budget=budget, stage="always"), **common))
    for row in rows:
        if row["status"] not in ("PASS", "INFEASIBLE", "KEPT-ALL"):
            checks.append({"check": f"{row['mode']}", "passed": False,
                           "detail": "; ".join(row.get("reasons", []))[:500]})
    return {"model": case.name, "size": case.description, "peak": peak, "saved": saved,
            "plain_seconds": round(reference.seconds, 2), "rows": rows, "checks": checks,
            "passed": all(c["passed"] for c in checks)}


# -- report --------------------------------------------------------------------------------------

def _did(row: dict) -> str:
    steps = row.get("steps") or []
    if not steps:
        return "—"
    planned = [s for s in steps if s.get("planned")]
    shown = planned or steps
    parts = [f"{s['kept']}/{s['offloaded']}/{s['recomputed']}" for s in shown]
    recorded = len(steps) - len(planned) if planned else 0
    text = ("" if not recorded else f"{recorded} rec. + ") + ", ".join(parts)
    if row.get("staged"):
        chunks = row.get("session", {}).get("stage", {}).get("chunks")
        text += f"; staged ({steps[0]['groups']}→{shown[-1]['groups']} groups"
        text += f", {chunks} chunks)" if chunks else ")"
    return text


def markdown(results: list[dict], rtol: float) -> str:
    lines = ["| model | size | mode | budget MiB | kept/offloaded/recomputed per step | "
             "grads max abs | grads max rel | params max abs | params max rel | buffers max rel"
             " | bitwise | result |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for result in results:
        for row in result["rows"]:
            def num(part, key):
                value = row.get(part, {}).get(key)
                return "—" if value is None else f"{value:.3g}"
            budget = row.get("budget")
            lines.append(
                f"| {row['model']} | {row.get('size', '')} | {row['mode']} | "
                f"{'—' if budget is None else f'{budget / 2**20:.1f}'} | {_did(row)} | "
                f"{num('grads', 'max_abs')} | {num('grads', 'max_rel')} | "
                f"{num('params', 'max_abs')} | {num('params', 'max_rel')} | "
                f"{num('buffers', 'max_rel')} | {'yes' if row.get('bitwise') else 'no'} | "
                f"{row['status']} |")
    lines += ["", f"PASS: bitwise equal, or (a staged step ran) within {rtol:g} of each tensor's "
              "largest magnitude; and the session did what the row is for. Per step: the groups "
              "packed kept/offloaded/recomputed (recording steps counted, planned ones listed).",
              ""]
    for result in results:
        for check in result["checks"]:
            lines.append(f"- {result['model']}: {check['check']}: "
                         f"{'PASS' if check['passed'] else 'FAIL'} ({check.get('detail', '')})")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from mucudnn.torch import planner

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet50", "vgg16", "r3d_18"],
                    help="MODEL or MODEL:N (benchmarks/models.py; sizes: SIZES)")
    ap.add_argument("--steps", type=int, default=planner.RECORD_STEPS + 3)
    ap.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS),
                    help="budget@F: the plan's target is the share F of the way down from "
                         "keeping everything to the least peak; tried in order until a plan mixes")
    ap.add_argument("--stage-models", nargs="*", default=["vgg16"],
                    help="models that also run staged (stage='always')")
    ap.add_argument("--rtol", type=float, default=RTOL)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--time-budget-s", type=float, default=None,
                    help="no further budget fraction starts after this many seconds")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before CUDA starts
    import torch

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    deadline = start + args.time_budget_s if args.time_budget_s else None
    header = {"torch": torch.__version__, "cuda": torch.version.cuda,
              "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "steps": args.steps, "record_steps": planner.RECORD_STEPS,
              "fractions": args.fractions, "rtol": args.rtol, "headroom": HEADROOM}
    print(json.dumps(header), flush=True)
    results = []
    for text in args.models:
        case = None
        try:
            case = model_case(text, args.steps, device)
            results.append(check_model(case, stage=text.partition(":")[0] in args.stage_models,
                                       fractions=args.fractions, rtol=args.rtol,
                                       deadline=deadline,
                                       say=lambda line: print(line, flush=True)))
        except Exception as exc:   # one model's failure must not hide the others
            print(f"[{text}] failed: {type(exc).__name__}: {exc}", flush=True)
            results.append({"model": text, "rows": [], "passed": False, "checks": [
                {"check": "ran", "passed": False, "detail": f"{type(exc).__name__}: {exc}"[:500]}]})
        (out / "torch_f64.json").write_text(json.dumps({**header, "results": results}, indent=1,
                                                       default=str))
        del case
        gc.collect()
    page = markdown(results, args.rtol)
    (out / "torch_f64.md").write_text(page)
    print(page, flush=True)
    passed = all(r["passed"] for r in results)
    print(f"{'PASS' if passed else 'FAIL'}: {len(results)} models in "
          f"{time.monotonic() - start:.0f} s", flush=True)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
