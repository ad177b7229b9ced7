"""The plan's lifecycle in mucudnn.torch's offload session, on the PyTorch side: what a step's end
tells the lifecycle (lifecycle.py: the profile recorded, how the step ended, its time and
flushes) and what the session does with its decision (the lines said, the stage, the profile
written for a replay off the GPU, the prefetch schedule), and the plan cache (plancache.py):
a plan an earlier run of the same script settled on runs from the first step, checked against
what that step saves. :class:`PlanLifecycle` is a part of
:class:`~mucudnn.torch.offload_session.OffloadSession`; nothing else calls into it but the
session's step end (:meth:`PlanLifecycle._close_step`) and its first save
(:meth:`PlanLifecycle._look_up_plan`, :meth:`PlanLifecycle._check_cached_group`)."""

from __future__ import annotations

import gc
import operator

import torch

from .lifecycle import (AS_RECORDED, FAILED, FALLBACK, FIXED, OK, OUT_OF_MEMORY, PLANNING,
                        RECORD, RECORDING, RESCUED, UNPLANNED, StepOutcome)
from .link import CudaLink
from .plan_runner import StageCandidate
from .plan_worker import ProcessRunner
from .plancache import UNCHECKED, CachedPlan, PlanCache, PlanKey, StepFloor
from .planner import KEEP, LEAST_HEADROOM
from .records import _Group, _Step
from .recording import stage_candidates, step_profile
from . import planner_stage
from ..sizes import describe_size, format_size
from .stage import RECORDING_STAGE_SHARE, StagePlan, chain_of, recording_stage
from .stage import _transformed as stage_transformed


class OfLifecycle(property):
    """A session attribute that is its lifecycle's (read and set through the session): a
    property whose getter is ``operator.attrgetter``'s, so that a read (``modes``, ``plan`` and
    ``profile`` at every saved group of a step) makes no Python call."""

    def __init__(self, name: str):
        def set_(session, value):
            setattr(session.lifecycle, name, value)
        super().__init__(operator.attrgetter("lifecycle." + name), set_)
        self.name = name


class PlanLifecycle:
    """The plan-lifecycle part of :class:`~mucudnn.torch.offload_session.OffloadSession`."""

    budget = OfLifecycle("budget")
    profile = OfLifecycle("profile")
    recorded_profile = OfLifecycle("recorded_profile")
    plan = OfLifecycle("plan")
    modes = OfLifecycle("modes")
    fell_back = OfLifecycle("fell_back")
    kept_after_trial = OfLifecycle("kept_after_trial")
    replans_left = OfLifecycle("replans_left")
    replans_used = OfLifecycle("replans_used")
    lowerings_left = OfLifecycle("lowerings_left")
    target = OfLifecycle("target")
    #: where the plan's life is (lifecycle.py's states: recording, planning, trial, watching, ...)
    state = OfLifecycle("state")
    headroom = OfLifecycle("headroom")
    trials = OfLifecycle("trials")
    keep_apart = OfLifecycle("keep_apart")
    strict = OfLifecycle("strict")
    replan_step = OfLifecycle("replan_step")

    def out_of_memory_line(self) -> str | None:
        """What a step that ran out of device memory and ended the script says of the session,
        in one line (``mucudnn run --offload`` says it as the script dies of it); None where no
        budget is planned for."""
        budget = self.lifecycle.budget
        if budget is None:
            return None
        if self._before_any_save():
            return (f"the script ran out of device memory before the offload session saved any "
                    f"tensor: the model, its inputs and what else it allocated take more than "
                    f"the {format_size(budget)} memory budget")
        staged = f", {self.stage.stage.describe()}" if self.stage is not None else ""
        if self._offload_rest:
            return (f"the step ran out of device memory under the offload plan from the plan "
                    f"cache, which this step did not fit (its first groups kept as planned, the "
                    f"rest offloaded){staged}, in the {format_size(budget)} memory budget")
        if self._offloading_everything():
            return (f"the step ran out of device memory with every saved tensor offloaded{staged}: "
                    f"the {format_size(budget)} memory budget is below what one step needs "
                    f"at least (the parameters, their gradients, the optimizer's state and one "
                    f"op's inputs, outputs and workspace); give it a larger --memory-budget")
        target = self.target
        return (f"the step ran out of device memory under the offload plan in force ({self.state}"
                + (f", planned for {format_size(target)}" if target else "") + f"{staged}) "
                f"of the {format_size(budget)} memory budget")

    def script_ran_out_of_memory(self) -> str | None:
        """:meth:`out_of_memory_line`, said as the script dies of running out of device memory;
        where that happened with every saved tensor offloaded, the budget is kept as one the
        step does not fit (:class:`~.plancache.StepFloor`): a later run under no more is told
        before its first step."""
        line = self.out_of_memory_line()
        # not a step a cached plan ran until it no longer fitted (:attr:`_offload_rest`): its
        # first groups were kept, so its budget may fit a step offloaded from its start
        if line is not None and not self._before_any_save() and not self._offload_rest and \
                self._offloading_everything():
            self._store_floor(None)
        return line

    def _before_any_save(self) -> bool:
        return self.steps == 0 and not self._step.groups

    def _offloading_everything(self) -> bool:
        return self.offloads_as_recorded or self.state in (RECORDING, PLANNING, UNPLANNED,
                                                           FALLBACK)

    @property
    def offloads_as_recorded(self) -> bool:
        """The step offloads every saved tensor inline, fetched on demand (a plan is being made
        in its place, the session fell back, or a cached plan did not fit it)."""
        return self.lifecycle.inline or self._offload_rest

    def _close_step(self, failed: bool, out_of_memory: bool) -> None:
        finished = self._step
        link = self._any_link()
        for used in self._links_in_use():
            used.settle()   # a step's copies to the host are over (one whose forward failed too)
        # the rest of the backward, the optimizer and the next forward up to here
        tail_peak = self.recorder.peak(link) if finished.profiling else 0
        if not failed and finished.unpacks and not finished.backward_done:
            # its backward raised; out of memory if the allocator refused something meanwhile
            # (a refusal that an op caught, cuDNN trying a workspace, does not end a backward)
            failed = True
            out_of_memory = finished.ooms is not None and link.ooms() > finished.ooms
        if failed:
            # What the failed step's error still refers to (its traceback's frames, autograd's
            # unrun nodes) reaches its groups: they let go of their device tensors, and reference
            # cycles through those frames are collected now, before this step allocates; else
            # every later step starts with most of the failed step's memory still allocated.
            for group in finished.groups:
                group.tensor, group.fetch, group.readers = None, None, 0
        # the node of its last unpack, in a graph that may outlive the step (a backward run
        # again after this one's end): the graph's packs hold the step (:attr:`_Step.node`)
        finished.node, finished.node_groups = None, []
        if failed:
            gc.collect()
        self.steps += 1
        # the next step's (recording or not once the lifecycle has decided): what reads the
        # links' counters from here on (a test's link) sees a step that has not begun
        self._step = _Step()
        profile, candidates = None, ()
        if not failed:
            self._first_unpacks = [g.first_unpack for g in finished.groups]
            self._say_unmoved(finished)
            if self._cached is not None and not self._offload_rest:
                self._check_cached_step(finished)
            if finished.profiling and finished.groups:
                # what the recorded step left that every later step carries (the optimizer's
                # state, made by its first step): each point of the profile has it too
                grown = 0
                if finished.start_allocated is not None:
                    grown = max(0, link.allocated() - finished.start_allocated)
                profile = step_profile(finished, link, self.copy_exposure, tail_peak, grown)
                # a recording that staged (:meth:`_stage_starts`) is the staged profile: the
                # stages weighed on it are that one extended along the chain
                candidates = tuple(
                    StageCandidate(stage, batch, (modules, parent), times)
                    for stage, modules, parent, batch, times
                    in stage_candidates(finished, link, self.recompute_convolutions, self.stage))
                self.recorder.peak(link)   # what a probe of the link allocated there is no step's
        self._cached = None    # checked in its first step only
        lifecycle = self.lifecycle
        if self.plan_in_background is None and lifecycle.state != FIXED:
            # a GPU's training thread goes on while the plan is made; elsewhere it is made at the
            # step boundary that asks for it
            self.plan_in_background = isinstance(link, CudaLink)
            if self.plan_in_background:
                lifecycle.runner = ProcessRunner(say=lambda text: self.say(text))
                if lifecycle.recording:   # the first plan is asked for after the recording
                    lifecycle.runner.warm()
        # a step rescued (rescue.py) ran to its end, past a peak its plan did not model
        status = (OUT_OF_MEMORY if out_of_memory else FAILED) if failed else \
            RESCUED if finished.rescued else OK
        decision = lifecycle.end_step(StepOutcome(
            status, recorded=not self._offload_rest, profile=profile, stage_candidates=candidates,
            offloadable=tuple(g.offloadable for g in finished.groups), unpacks=finished.unpacks,
            mark=link.mark() if lifecycle.trial is not None else None,
            flush_counts={} if lifecycle.state == FIXED else self._flush_counts_now(),
            # on a device the host feeds (on the CPU the recording's "device" forward is the
            # host's own time: nothing to compare)
            host_forward_ms=finished.host_forward_ms if isinstance(link, CudaLink) else None))
        self._offload_rest = False
        self._step.profiling = decision.run == RECORD
        self._apply(decision, finished, failed)

    def _apply(self, decision, finished: _Step | None = None, failed: bool = False) -> None:
        """What the lifecycle decided, carried out: its lines said, the stage it took, the profile
        written, the plan cached (or forgotten), the step's floor kept, the next step's prefetch
        schedule; its error raised last."""
        for line in decision.lines:
            self.say(line)
        if self.lifecycle.stage is None:
            self.stage = None
        elif decision.staged:
            candidate = self.lifecycle.stage
            self.stage = StagePlan(candidate.stage, *candidate.payload)
            self._first_unpacks = [group.first_unpack for group in self.profile.groups]
        if decision.write_profile:
            self.write_profile()
        if decision.settled:
            self._store_plan()
        if decision.least_peak is not None:
            self._store_floor(decision.least_peak)
        if decision.fell_back and self._cache_key is not None:
            self._plan_cache.forget(self._cache_key)
        # a recording step fetches on demand (its memory is save_on_cpu's, and its baselines
        # count no group before its first unpack); so does a step run as recorded. A failed
        # step's unpacks are partial: the schedule stays that of the last whole step unless the
        # modes change.
        if decision.run != AS_RECORDED and self.modes is None and finished is not None:
            modes = [g.mode for g in finished.groups]
        else:
            modes = self.modes
        if self.freeze_gc and not self._gc_frozen and decision.run != RECORD:
            self._freeze_gc()
        if decision.run in (RECORD, AS_RECORDED):
            self._schedule = {}
        elif not failed or decision.changed:
            self._schedule = self._prefetch_schedule(modes)
        self.lender.plan_for(None if decision.run in (RECORD, AS_RECORDED) else self.profile,
                             modes, self.prefetch_distance, self.prefetch_margin,
                             self.lifecycle.target, self.lifecycle.budget)
        if decision.error is not None:
            raise decision.error

    def _stage_starts(self, step: _Step, module, args, parent) -> bool:
        """Leaf ``module`` (``parent`` running it) starts the stage in force, or, in a recording
        step with none, a stage this recording takes (:func:`stage.recording_stage`: its chain's
        backward alone would hold more than :data:`stage.RECORDING_STAGE_SHARE` of the budget,
        where plain plans would not fit). A stage the recording takes holds for the plans made
        from it, which are made on its staged profile (the one other stage weighed is that one
        extended: :func:`.recording.stage_candidates`); one line says so."""
        saved = len(step.groups)
        if self.stage is None:
            budget = self.lifecycle.budget
            if not step.profiling or self.staging is False or budget is None or saved or \
                    step.calls or not args or not isinstance(args[0], torch.Tensor) or \
                    stage_transformed():   # nothing is staged under a torch.func transform
                return False
            staged = recording_stage(module, parent, args[0], budget)
            if staged is None:
                return False
            chain, chunks = staged
            source = args[0]
            stage = planner_stage.Stage(len(chain), saved, saved, None,
                                        source.numel() * source.element_size(), chunks, 0.0,
                                        input_saved=self.saves_as_group(source))
            self.stage = StagePlan(stage, chain, parent)
            self.lifecycle.stage_in_recording(
                StageCandidate(stage, source.shape[0], (chain, parent)))
            self.say(f"the recording stages the first {len(chain)} layers in {chunks} "
                     f"micro-batches: their backward would hold more than "
                     f"{RECORDING_STAGE_SHARE:.0%} of the {describe_size(budget)} budget at once")
        return self.stage.runs(module, args, parent, saved)

    def _freeze_gc(self) -> None:
        """At the first step boundary past the recording (where the steps run as recorded
        while the first plan is made, or where a cached plan takes over): the process's objects
        collected once and frozen (``gc.freeze``), so that the collector's full collections,
        which the session's per-step records set off every few steps, traverse only what was
        made since: unfrozen they walk every object of PyTorch and the script, a pause of a
        step's length (benchmarks/results/plan-accuracy). The collection itself takes about as
        long, so it is paid in a step that runs as recorded (slow anyway), not in the first
        planned one. What is frozen is never collected: cycles the script drops later stay (a
        process-wide session's choice: ``MUCUDNN_OFFLOAD_FREEZE_GC=0``)."""
        self._gc_frozen = True
        gc.collect()
        gc.freeze()

    def _flush_counts_now(self) -> dict:
        """Each link in use and its caching allocator's flush count now."""
        return {link: self._plans_flushes(link) for link in self._links_in_use()}

    def _plans_flushes(self, link) -> int:
        """The link's flush count now, less those the lender caused (lend.py, rule 5)."""
        return self.lender.flushes_not_lent(link.flushes(), getattr(link, "device", None))

    def _saw_flushes(self, step: _Step, link, point: int) -> None:
        """A planned step's unpack after backward ``point``'s op (-1: the forward): where a
        trial times its plan, the link's flush count now says whether it flushed there."""
        if not step.profiling and self.lifecycle.watches_flush_points:
            self.lifecycle.saw_flushes(link, self._plans_flushes(link), point)

    def _say_unmoved(self, step: _Step) -> None:
        """One line, once, when a step kept groups its plan moves (no recipe found, not dense):
        its peak is then over the plan's."""
        unmoved = [g for g in step.groups if g.wanted != KEEP and g.mode == KEEP]
        if unmoved and not step.profiling and not self._offload_rest and not self._unmoved_said:
            self._unmoved_said = True
            first = unmoved[0]
            # a planned step names no group: the profile's name for it, where there is one
            profiled = self.profile.groups if self.profile is not None else ()
            name = first.producer or (profiled[first.gid].producer if first.gid < len(profiled)
                                      else "unnamed")
            self.say(f"{len(unmoved)} saved tensors the plan offloads or recomputes were kept "
                     f"({sum(g.nbytes for g in unmoved) / 2**20:.1f} MiB; first: group "
                     f"{first.gid}, {name}, wanted {first.wanted})")

    # --- the plan cache ---------------------------------------------------------------------
    def _cache_options(self) -> dict:
        """The options that change which plan is made or how it runs (plancache.PlanKey's)."""
        lifecycle = self.lifecycle
        return {"headroom": self.headroom, "lookahead": self.lookahead,
                "recompute": self.recompute, "recompute_convolutions": self.recompute_convolutions,
                "staging": self.staging, "copy_exposure": self.copy_exposure,
                "trials": self.trials, "keep_apart": self.keep_apart,
                "min_bytes": self.min_bytes, "plan_time_limit_s": self.plan_time_limit_s,
                "record_steps": lifecycle.record_steps, "replans": lifecycle.replans,
                "replan_step": self.replan_step}

    def _look_up_plan(self, device: torch.device, first: tuple | None = None) -> None:
        """At the first step's first leaf module (``first``: the module, its container and its
        arguments), or its first save where that module had no tensor to say the device, where a
        budget is planned for: the plan an earlier run of the same script settled on, from the
        plan cache (``plan_cache``; by default ``MUCUDNN_PLAN_CACHE``'s on a GPU, none
        elsewhere), in force from here on. A staged entry's stage is the chain of as many
        modules that first module starts (:func:`.stage.chain_of`), where it still is one. The
        rescue is armed for this step as the plan in force then says (rescue.py, rule 5)."""
        self._cache_due = False
        self._load_cached_plan(device, first)
        self.rescuer.arm()

    def _load_cached_plan(self, device: torch.device, first: tuple | None) -> None:
        """:meth:`_look_up_plan`'s look-up: the cached plan in force, where there is one that
        fits this step's first module."""
        cache = self._plan_cache
        if cache is None and device.type == "cuda":
            cache = self._plan_cache = PlanCache.from_environment(self.say)
        if cache is None or not cache.enabled or self.lifecycle.state != RECORDING \
                or self.steps or self._step.groups:
            return
        if device.type == "cuda":
            properties = torch.cuda.get_device_properties(device)
            gpu_name, gpu_memory = properties.name, properties.total_memory
        else:
            gpu_name, gpu_memory = device.type, 0
        self._cache_key = PlanKey.make(
            self.budget, self._cache_options(), gpu_name=gpu_name, gpu_memory=gpu_memory,
            torch_version=torch.__version__, cudnn_version=torch.backends.cudnn.version())
        entry = cache.load(self._cache_key)
        if entry is None:
            floor = cache.load_floor(self._cache_key)
            if floor is not None and floor.rules_out(self.budget):
                self.warn(floor.line(self.budget))
            return
        candidate = None
        if entry.stage is not None:
            module, parent, args = first if first is not None else (None, None, ())
            chain = chain_of(module, parent, entry.stage.modules)
            if chain is None:
                self.say(f"the cached offload plan stages its first {entry.stage.modules} "
                         "layers, which this step's first module does not start; recording "
                         "anew")
                return
            candidate = StageCandidate(entry.stage, args[0].shape[0], (chain, parent))
        self._cached = entry
        if entry.proven:
            self.rescuer.proven.append(entry.plan)
        self._step.profiling = False     # this step runs the plan
        self._first_unpacks = [group.first_unpack for group in entry.profile.groups]
        self._apply(self.lifecycle.start_cached(
            entry.plan, entry.profile, recorded_profile=entry.recorded_profile, stage=candidate,
            kept_after_trial=entry.kept_after_trial))

    def _check_cached_group(self, step: _Step, group: _Group, ended: bool = False) -> None:
        """The first step under a cached plan: ``group``, first saved now (``ended``: at the
        step's end), is checked against the entry's signature; where it differs, the session
        records anew from the next step, this group and the rest of this step offloaded as a
        recording step offloads them. A module that saves its own output (ReLU) finds its
        recipe, and its name, when it returns (``late_recipe``): those are checked at the
        step's end."""
        recipe, producer = UNCHECKED, None
        if group.recipe is not None:
            # named from its recipe, as the recording named it (a group without one is named
            # from the calls a planned step may not record)
            producer = group.producer
            if self.recorder.may_recompute(step, group.gid):
                recipe = tuple(source.gid for source in group.recipe.sources)
        elif ended and self.recorder.may_recompute(step, group.gid):
            recipe = None
        reason = self._cached.signature.check_group(
            group.gid, group.nbytes, producer, group.offloadable, recipe)
        if reason is not None:
            self._not_cached(reason)

    def _check_cached_step(self, step: _Step) -> None:
        reason = self._cached.signature.check_step(
            len(step.groups), step.unpacks, [g.first_unpack for g in step.groups],
            [g.last_unpack for g in step.groups])
        if reason is not None:
            self._not_cached(reason)
            return
        for group in step.groups:
            self._check_cached_group(step, group, ended=True)
            if self._cached is None:
                return

    def _not_cached(self, reason: str) -> None:
        self._cached, self._offload_rest = None, True
        self._apply(self.lifecycle.record_anew(reason))

    def _store_plan(self) -> None:
        """The plan in force settled: kept for the next run of the script (a staged one with its
        stage and the profile recorded before it)."""
        if self._cache_key is None or self.plan is None:
            return
        staged = self.stage is not None
        self._plan_cache.store(self._cache_key, CachedPlan.make(
            self.plan, self.profile, kept_after_trial=self.kept_after_trial,
            recorded_profile=self.recorded_profile if staged else None,
            stage=self.stage.stage if staged else None,
            proven=self.rescuer.is_proven(self.plan)))
        self._stored_plan = self.plan
        self._plan_cache.forget_floor_below(self._cache_key, self.budget)

    def _store_floor(self, least_peak: int | None) -> None:
        """No plan meets the budget (``least_peak``: the least peak any plan reached; None: a
        step with every saved tensor offloaded ran out of memory): kept for a later run of the
        step under any budget, which is told before its first step where it rules that out."""
        if self._cache_key is None:
            return
        self._plan_cache.store_floor(self._cache_key, StepFloor(
            int(self.budget), least_peak, min(self.headroom, LEAST_HEADROOM)))

    def plan_proven(self, plan) -> None:
        """``plan`` ran its first armed steps with none running out of memory (rescue.py, rule
        5): where it is the plan the cache holds for this run, its entry says so from now on."""
        if plan is self._stored_plan and plan is self.plan:
            self._store_plan()

    def write_profile(self) -> bool:
        """``profile_to``: the budget, the target, the recorded profile (its dataclass's fields),
        the plan's description (None: no plan met the target) and its release points with their
        margin, whether the session fell back to offloading everything after planned steps ran
        out of memory (``fell_back``: the plan is then the last one tried), how a plan kept after
        a trial was made (``kept_after_trial``) and the modes in force, as one JSON document
        written atomically; each plan made (or kept after a trial) rewrites it. Never raises: a
        path that cannot be written is one line (the step goes on)."""
        if not self.profile_to or self.profile is None:
            return False
        import dataclasses
        import json
        from ..outputs import write_text_atomically
        def plain(value):  # a NumPy or torch scalar given as the budget, a link's speeds, ...
            if hasattr(value, "item"):
                return value.item()
            raise TypeError(f"{type(value).__name__} is not JSON serializable")

        try:
            plan = self.plan
            document = {"budget": self.budget, "target": self.target,
                        "plan": plan.describe() if plan is not None else None,
                        # where its offloads leave the device, and the margin that put them there
                        "releases": list(plan.releases) if plan is not None else None,
                        "release_margin": plan.release_margin if plan is not None else None,
                        "fell_back": self.fell_back, "modes": self.modes,
                        # a plan kept after a trial is made from this profile as its label says
                        "kept_after_trial": self.kept_after_trial,
                        "format": 2,   # profiles.FORMAT: what profiles.load_profile reads
                        "profile": dataclasses.asdict(self.profile)}
            if self.stage is not None:   # the profile is the staged one, made from the recorded
                document.update(stage=dataclasses.asdict(self.stage.stage),
                                recorded_profile=dataclasses.asdict(self.recorded_profile))
            write_text_atomically(self.profile_to, json.dumps(document, default=plain) + "\n")
        except (OSError, ValueError, TypeError) as exc:
            self.say(f"the offload profile was not written to {self.profile_to}: {exc}")
            return False
        return True
