"""The plan's lifecycle in mucudnn.torch's offload session: what a step's end makes of it (the
profile recorded, a plan made, a trial of plans run and one kept, flushes watched and the target
lowered, a plan made again after running out of memory, the fall-back to offloading everything),
and the profile written for a replay off the GPU. :class:`PlanLifecycle` is a part of
:class:`~mucudnn.torch.offload_session.OffloadSession` (its state is the session's, set up in
:meth:`~mucudnn.torch.offload_session.OffloadSession.__init__`); nothing else calls into it but
the session's step end (:meth:`PlanLifecycle._close_step`)."""

from __future__ import annotations

import gc
from dataclasses import replace

from ..errors import InfeasibleError, MucudnnError
from ..sizes import describe_size
from . import planner
from .link import SameMemoryLink
from .planner import KEEP
from .records import _Step, _Trial, offload_everything
from .recorder import stage_candidates, step_profile
from .stage import StagePlan


class PlanLifecycle:
    """The plan-lifecycle methods of :class:`~mucudnn.torch.offload_session.OffloadSession`."""

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
        # the first recording pins the host pool (seconds of the host waiting, which leave the
        # copies' own time uncertain); the profile is the last of ``record_steps``, with each time
        # the least of them all (planner.least_times)
        more_recording = finished.profiling and not failed and self._recordings_left > 1
        if finished.profiling and not failed:
            self._recordings_left -= 1
        self._step = _Step(profiling=finished.profiling and (failed or more_recording))
        if failed:
            # What the failed step's error still refers to (its traceback's frames, autograd's
            # unrun nodes) reaches its groups: they let go of their device tensors, and reference
            # cycles through those frames are collected now, before this step allocates; else
            # every later step starts with most of the failed step's memory still allocated.
            for group in finished.groups:
                group.tensor, group.fetch, group.readers = None, None, 0
            finished.node, finished.node_groups = None, []
            gc.collect()
        self.steps += 1
        if failed and finished.profiling:
            self.say("the recording step failed" + (" (out of device memory)" if out_of_memory
                                                    else "") + "; recording the next one")
            return
        if failed:
            trial, self._trial = self._trial, None
            if trial is not None and trial.current > 0:
                # a step of a plan after the first failed: the fastest of those that ran stays
                label = trial.labels[trial.current]
                self._end_trial(trial, trial.current,
                                f"the plan {label} ran out of device memory in its trial"
                                if out_of_memory else f"a step of the plan {label} failed in "
                                "its trial")
                self._schedule = self._prefetch_schedule(self.modes)
                return
            # its unpacks are partial: the prefetch schedule stays that of the last whole step
            if out_of_memory and not self.fell_back and self.budget is not None:
                if self._plan_again():
                    return
                # as the recording step ran: everything offloaded, fetched on demand
                self.fell_back = True
                recorded = self.profile.groups if self.profile is not None else finished.groups
                self.modes = offload_everything(recorded)
                self._schedule = {}
                self.write_profile()
                self.say(f"a step under the offload plan for {self.budget / 2**30:.2f} GiB ran "
                         "out of device memory; offloading every saved tensor from now on")
            return
        self._first_unpacks = [g.first_unpack for g in finished.groups]
        self._say_unmoved(finished)
        if finished.profiling and finished.groups:
            # what the recorded step left that every later step carries (the optimizer's state,
            # made by its first step): each point of the profile has it too
            grown = 0
            if finished.start_allocated is not None:
                grown = max(0, link.allocated() - finished.start_allocated)
            self._recorded.append(
                step_profile(finished, link, self.copy_exposure, tail_peak, grown))
            self._stage_candidates = stage_candidates(finished, link, self.recompute_convolutions)
            self.recorder.peak(link)   # what a probe of the link allocated there is no step's
            if not more_recording:
                # each time the least recorded: a host that fell behind in one recording
                # stretched its times there
                self.profile = planner.least_times(self._recorded)
                self._recorded = []
                self._make_plan()
        elif self._trial is not None and not finished.profiling:
            self._advance_trial(link, finished.unpacks)
        elif not finished.profiling and self.plan is not None and self.trials \
                and not self.fell_back:
            self._watch_flushes()
        # a recording step fetches on demand (its memory is save_on_cpu's, and its baselines
        # count no group before its first unpack); so does a fall-back
        self._schedule = {} if self.fell_back or self._step.profiling else self._prefetch_schedule(
            [g.mode for g in finished.groups] if self.modes is None else self.modes)

    def _say_unmoved(self, step: _Step) -> None:
        """One line, once, when a step kept groups its plan moves (no recipe found, not dense):
        its peak is then over the plan's."""
        unmoved = [g for g in step.groups if g.wanted != KEEP and g.mode == KEEP]
        if unmoved and not step.profiling and not self._unmoved_said:
            self._unmoved_said = True
            first = unmoved[0]
            # a planned step names no group: the profile's name for it, where there is one
            profiled = self.profile.groups if self.profile is not None else ()
            name = first.producer or (profiled[first.gid].producer if first.gid < len(profiled)
                                      else "unnamed")
            self.say(f"{len(unmoved)} saved tensors the plan offloads or recomputes were kept "
                     f"({sum(g.nbytes for g in unmoved) / 2**20:.1f} MiB; first: group "
                     f"{first.gid}, {name}, wanted {first.wanted})")

    @property
    def target(self) -> int | None:
        """What plans are made for: ``budget * (1 - headroom)``, lower after a planned step that
        ran out of memory or a plan that flushed, higher where no plan met it
        (:meth:`_plan_with_less_headroom`)."""
        if self._lowered_target is not None:
            return self._lowered_target
        return (planner.planning_target(self.budget, self.headroom) if self.budget is not None
                else None)

    def _plan_again(self) -> bool:
        """After a planned step ran out of memory: a plan for a lower target, if replans are left
        and one meets it (True), with one line."""
        if self.plan is None or self.profile is None or self.replans_left <= 0:
            return False
        self.replans_left -= 1
        self.replans_used += 1
        modelled = self.plan.peak
        target = min(self.target, modelled) - int(self.replan_step * self.budget)
        if target <= 0:     # nothing left to plan for: the fall-back (everything offloaded)
            return False
        try:
            plan = self._plan_for(target)
        except MucudnnError:
            return False
        self._lowered_target, self.plan, self.modes = target, plan, list(plan.modes)
        self.kept_after_trial = None
        self._watch_from_now()   # not the flush of the step that failed (a retry before it)
        self._schedule = self._prefetch_schedule(self.modes)
        self.write_profile()
        self.say(f"a step under the offload plan for {self.budget / 2**30:.2f} GiB ran out of "
                 f"device memory (modelled peak {modelled / 2**30:.2f} GiB); planning for "
                 f"{target / 2**30:.2f} GiB: {plan.describe()}")
        return True

    def _plan_for(self, target: int, explain: bool = True) -> planner.OffloadPlan:
        """The plan for ``target``. Where none meets it, :class:`InfeasibleError` (with
        ``explain``: saying the least peak, solved for) and :attr:`_no_plan_at` raised to it:
        no lower target is solved again."""
        if self._no_plan_at is not None and target <= self._no_plan_at:
            raise InfeasibleError(f"no plan within {describe_size(target)}: none within "
                                  f"{describe_size(self._no_plan_at)} either")
        try:
            return planner.plan_with_prefetch(self.profile, target, self.lookahead,
                                              self.plan_time_limit_s, explain=explain)
        except InfeasibleError:
            self._no_plan_at = max(target, self._no_plan_at or 0)
            raise

    def _make_plan(self, plan: planner.OffloadPlan | None = None) -> None:
        """The plan for :attr:`target` (``plan``: made for it already) in force, said in one
        line, and a trial of the others worth running against it (:func:`planner.trial_plans`;
        for smaller headrooms too, unless the target was lowered)."""
        target = self.target
        if plan is None and self._stage_candidates:
            plan = self._choose_stage(target)
        try:
            self.plan = plan or self._plan_for(target)
        except MucudnnError as exc:   # infeasible, or CBC failed
            self.plan = self._plan_with_less_headroom(exc)
            if self.plan is None:
                if self.strict:
                    raise
                # an unmodified script: go on as the recorded step ran (everything offloaded)
                self.say(f"{exc}; offloading every saved tensor")
                self.modes = offload_everything(self.profile.groups)
                self.write_profile()
                return
            target = self.target
            self.say(f"no offload plan for {self.budget / 2**30:.2f} GiB less its headroom "
                     f"({self.headroom:.0%}); planning for {target / 2**30:.2f} GiB, "
                     f"{1 - target / self.budget:.1%} less")
        self.modes = list(self.plan.modes)
        self._watch_from_now()
        self.say(f"offload plan for {self.budget / 2**30:.2f} GiB"
                 + (f" (planned for {target / 2**30:.2f} GiB)"
                    if self._lowered_target is not None else "")
                 + f": {self.plan.describe()}"
                 + (f"; {self.stage.stage.describe()}" if self.stage is not None else ""))
        self.write_profile()
        if not self.trials:
            return
        others = planner.trial_plans(
            self.profile, target, self.plan, self.lookahead, self.plan_time_limit_s,
            planner.trial_budgets(self.budget, self.headroom)
            if self._lowered_target is None else (),
            keep_apart=self.keep_apart)
        # alone, the plan is still run as a trial where a lower target can follow: whether it
        # flushes the caching allocator's cache (:meth:`_plan_below_flushes`)
        if others or (self.headroom and self.lowerings_left > 0):
            self._trial = _Trial([self.plan] + [plan for _, plan in others],
                                 ["as made"] + [label for label, _ in others],
                                 seen=self._flush_counts_now())
        if others:
            self.say("trying it against " + "; ".join(
                f"the plan {label} ({plan.describe()})" for label, plan in others)
                + f", {planner.TRIAL_STEPS} steps each")

    def _choose_stage(self, target: int) -> planner.OffloadPlan | None:
        """Whether a plan stages the leading chain (stage.py), weighed once on the recorded
        profile: the plain plan for ``target`` against each candidate's plan on its
        :func:`planner.staged_profile` (its micro-batches :func:`planner.stage_chunks`). A staged
        plan is taken where it is predicted faster by :data:`planner.STAGE_MIN_GAIN` or the
        plain one has none; where none has a plan, the candidate of the least peak, if lower
        than the plain profile's (its headroom is then lowered as ever). Taken, its profile
        becomes :attr:`profile`. Returns the plan taken (None: none meets ``target``)."""
        candidates, self._stage_candidates = self._stage_candidates, []

        def plan_on(profile):
            try:
                return planner.plan_with_prefetch(profile, target, self.lookahead,
                                                  self.plan_time_limit_s, explain=False)
            except MucudnnError:
                return None
        plain = plan_on(self.profile)
        options = []
        for stage, modules, parent, batch in candidates:
            chunks = planner.stage_chunks(self.profile, stage)
            if chunks is None or min(chunks, batch) < 2:
                continue
            stage = replace(stage, chunks=min(chunks, batch))
            staged = planner.staged_profile(self.profile, stage)
            options.append((plan_on(staged), staged, StagePlan(stage, modules, parent)))
        planned = [option for option in options if option[0] is not None]
        if planned:
            best = min(planned, key=lambda option: option[0].predicted_ms)
            if plain is not None and self.staging != "always" and \
                    best[0].predicted_ms >= plain.predicted_ms * (1 - planner.STAGE_MIN_GAIN):
                return plain
        elif plain is None and options:
            peaks = [planner.least_peak(option[1], self.lookahead) for option in options]
            lowest = min(peaks)
            best = options[peaks.index(lowest)]
            if lowest >= planner.least_peak(self.profile, self.lookahead) and \
                    self.staging != "always":
                return None
        else:
            return plain
        plan, staged, self.stage = best
        self.recorded_profile, self.profile = self.profile, staged
        self._no_plan_at = None
        self._first_unpacks = [group.first_unpack for group in staged.groups]
        return plan

    def _advance_trial(self, link: SameMemoryLink, unpacks: int) -> None:
        """A planned step of the trial ended (its backward ``unpacks`` points; a flush since the
        last unpack came after the last point's op): the next plan's turn after
        :data:`planner.TRIAL_STEPS` steps, and after the last plan's, :meth:`_Trial.kept` stays."""
        trial = self._trial
        for used in self._links_in_use():   # after the last unpack: its op, the optimizer's
            trial.saw_flushes(used, unpacks - 1)
        trial.marks[trial.current].append(link.mark())
        trial.flushes[trial.current].append(link.flushes())
        if len(trial.marks[trial.current]) < planner.TRIAL_STEPS:
            return
        if trial.current + 1 < len(trial.plans):
            trial.current += 1
            self.plan = trial.plans[trial.current]
            self.modes = list(self.plan.modes)
            return
        self._end_trial(trial, len(trial.plans), "offload plans tried")

    def _end_trial(self, trial: _Trial, ran: int, why: str) -> None:
        """:meth:`_Trial.kept` of the trial's first ``ran`` plans (each timed) stays, said in one
        line that starts with ``why``."""
        times = [trial.step_ms(index) for index in range(ran)]
        best = trial.kept(times)
        self._trial = None
        self._watch_from_now()   # the plan kept, or made for less below
        timed = ", ".join(f"{trial.labels[index]} {ms:.1f} ms a step{trial.flush_note(index)}"
                          for index, ms in enumerate(times))
        alone = len(trial.plans) == 1
        if ran == len(trial.plans) and all(trial.flushes_in(index) for index in range(ran)):
            lower = self._plan_below_flushes(min(plan.peak for plan in trial.plans))
            if lower is not None:
                self.say((f"the offload plan ran {times[0]:.1f} ms a step{trial.flush_note(0)}; "
                          "it flushed" if alone else f"{why}: {timed}; each flushed")
                         + " the caching allocator's cache, so planning for "
                         f"{self.target / 2**30:.2f} GiB")
                self._make_plan(lower)
                return
        if alone:   # it stays, flushing or not (no lower target): nothing to say
            return
        self.kept_after_trial = trial.labels[best] if best else None
        self.plan = trial.plans[best]
        self.modes = list(self.plan.modes)
        self.write_profile()
        self.say(f"{why}: {timed}; keeping the plan {trial.labels[best]}")

    def _flush_counts_now(self) -> dict:
        """Each link in use and its caching allocator's flush count now."""
        return {link: link.flushes() for link in self._links_in_use()}

    def _watch_from_now(self) -> None:
        """The watch (:meth:`_watch_flushes`) of the plan that comes into force: no step of it
        yet, and flushes counted from here."""
        self._flushing.clear()
        self._flush_counts = self._flush_counts_now()

    def _watch_flushes(self) -> None:
        """A planned step of the plan in force ended after its trial: once
        :data:`planner.WATCH_FLUSHING` of its last :data:`planner.WATCH_STEPS` steps flushed the
        caching allocator's cache, the plan for less (:meth:`_plan_below_flushes`) is made and
        tried, with one line; where none is left, the plan stays and nothing more is said."""
        counts = self._flush_counts_now()
        self._flushing.append(any(count > self._flush_counts.get(link, count)
                                  for link, count in counts.items()))
        self._flush_counts = counts
        flushed = sum(self._flushing)
        if flushed < planner.WATCH_FLUSHING:
            return
        steps = len(self._flushing)
        self._flushing.clear()
        lower = self._plan_below_flushes(self.plan.peak)
        if lower is None:
            return
        self.say(f"the offload plan flushed the caching allocator's cache in {flushed} of its "
                 f"last {steps} steps, so planning for {self.target / 2**30:.2f} GiB")
        self._make_plan(lower)

    def _plan_with_less_headroom(self, error: MucudnnError) -> planner.OffloadPlan | None:
        """Where no plan meets the target the headroom leaves (``error``, an
        :class:`InfeasibleError`): the plan for the budget less half the headroom, else a
        quarter, ..., down to :data:`planner.LEAST_HEADROOM`
        (:func:`planner.smaller_headrooms`, none below the least peak ``error`` found); the
        target then that one, and no lowering after a flush (a lower target has no plan).
        None where none meets even that, where CBC failed (a plan may exist), or where the
        target is not the headroom's. The headroom is a guess at the caching allocator's
        fragmentation; near the step's least peak the flushes and the replans after running
        out of memory measure it."""
        if self.budget is None or self._lowered_target is not None:
            return None
        plan = planner.plan_with_less_headroom(
            error, self.budget, self.headroom, lambda target: self._plan_for(target, explain=False))
        if plan is not None:
            self._lowered_target = plan.target
            self.lowerings_left = 0
        return plan

    def _plan_below_flushes(self, flushed_peak: int) -> planner.OffloadPlan | None:
        """After a trial whose every plan flushed the caching allocator's cache, or a plan kept
        after its trial that flushes (:meth:`_watch_flushes`; fragmentation the model does not
        see needs more room than its headroom): the plan for a target half
        the headroom lower (at most ``replans`` such lowerings, apart from the replans after
        running out of memory; None, the target unchanged, where none is left or no plan meets
        that target; after such a target, none is tried again: a lower one has no plan either).
        A flush costs a step more than the room does (benchmarks/results/pressure).

        A plan's time steps up at some peaks: where the plan for a quarter of the headroom lower
        is faster by :data:`planner.LOWERING_MIN_GAIN` and still peaks below ``flushed_peak``
        (the least predicted peak of the plans that flushed), it is made instead
        (:meth:`_nearer_lowering`)."""
        if self.lowerings_left <= 0 or not self.headroom:
            return None
        step = int(self.headroom / 2 * self.budget)
        target = self.target - step
        try:
            plan = self._plan_for(target)
        except MucudnnError:
            # no plan meets it, nor any lower one (or CBC failed): not solved again
            self.lowerings_left = 0
            return None
        target, plan = self._nearer_lowering(target + step // 2, target, plan, flushed_peak)
        self.lowerings_left -= 1
        self.replans_used += 1
        self._lowered_target = target
        return plan

    def _nearer_lowering(self, nearer: int, target: int, plan: planner.OffloadPlan,
                         flushed_peak: int) -> tuple[int, planner.OffloadPlan]:
        """``(nearer, its plan)`` where that plan peaks below ``flushed_peak`` (so it gives room
        all the same) and is predicted faster than ``plan`` (for ``target``) by
        :data:`planner.LOWERING_MIN_GAIN`; else ``(target, plan)``: a plan's time steps up at some
        peaks, and a lowering by half the headroom may pass a step that a quarter does not."""
        try:
            near = self._plan_for(nearer, explain=False)
        except MucudnnError:   # CBC failed (a lower target has a plan)
            return target, plan
        if near.peak < flushed_peak and \
                near.predicted_ms < plan.predicted_ms * (1 - planner.LOWERING_MIN_GAIN):
            return nearer, near
        return target, plan

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
