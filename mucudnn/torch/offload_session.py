"""The offload session of mucudnn.torch (docs/torch.md): saved-tensor hooks that keep, offload or
recompute each tensor autograd saves, as a plan says, after a first step that records a profile.
Its parts: the host links (link.py), the records of a step (records.py), the recorder of a step's
calls and profile (recorder.py) and its recipes (recipes.py), and the plan's lifecycle
(lifecycle.py, the controller; plan_runner.py, which makes its plans; session_plans.py, its
PyTorch side), and the saved-tensor hooks (saved_tensors.py: packs and unpacks); this module
enters and leaves, runs the module hooks and the steps' ends, and holds each group's device
tensor for as long as the rules below say.

Invariants:
- A tensor is restored bit for bit: an offloaded one is copied to a host tensor of the same dtype,
  shape and strides and back (dense tensors only; others are kept); a recomputed one re-runs its
  recipe, deterministic modules (:data:`CHEAP`, and :data:`CONVOLUTIONS` unless told not to)
  and tensor adds (:data:`ADDS`, ResNet's ``out += identity``) on its sources under ``no_grad``,
  with batch norm rerun on copies of its running statistics (its output in training mode does
  not read them, and the model's statistics are not updated twice). A source is a saved group,
  kept or itself recomputed: rebuilding a group first rebuilds its recomputed sources that are
  not on the device (a chain, as ``torch.utils.checkpoint`` reruns a segment), each once; a
  group saved as a view over exactly a tensor's elements (an instance norm's reshaped input) is
  a source of that tensor, viewed back to its shape (:class:`_ViewOf`).
  A convolution reruns the kernel its forward ran where the framework picks kernels per shape
  (PyTorch's cuDNN plan cache, ``cudnn.benchmark`` or not); a workspace allocation that fails
  during a rerun can make it pick another, whose result may differ in the last bits
  (``recompute_convolutions=False`` rules convolutions out).
- Nothing is recomputed from a source that changed since it was saved (its version counter), and
  every call of a recipe read each of its inputs at the version the recipe rebuilds or reads.
- Groups: every pack of the same tensor object (same version) is one group, moved or recomputed
  once. Parameters, views of them, one-dimensional leaves (buffers) and tensors under
  ``min_bytes`` pass through (:class:`_Passed`).
- A recipe's module reruns as its forward ran (:class:`_ModuleState`): its mode, the tensors in
  its ``_parameters`` then (``functional_call``'s), an eval-mode batch norm's statistics then;
  without hooks (a user's global hooks see the user's forward only).
- A copy of a saved tensor (an offload, a keep-apart copy) is made once the op that saved it
  has run (:meth:`.host_copies.StepCopies.copy_pending`): an op may write a tensor after saving it.
- Autograd checks no saved tensor's version where saved-tensor hooks run: the session does, at
  each unpack, and raises PyTorch's error for a tensor changed in place since its pack (seen
  through the tensor, its view's base, its kept alias or a recipe's parameters while they live).
- The session holds a group's device tensor (kept, fetched, prefetched or recomputed) no longer
  than the planner's liveness says (planner.py): autograd holds one :class:`_Packed` per pack,
  and the device tensor goes when the last of them is freed (autograd frees a node's saved
  tensors once it ran), at the last unpack of a moved or recomputed group, and never while a
  recomputed group that reads it may still be unpacked. Nothing else (steps, recipes, calls)
  refers to a device tensor strongly, except a link while a copy reads or writes it: an
  offloaded tensor until its copy to the host is done (``CudaLink.poll``), a fetch's until the
  compute stream is ordered after its copy.
- Steps: a pack after an unpack starts a new step, and so does a module or pack after a forward
  whose graph autograd dropped without a backward (:meth:`_Step.abandoned`); group ``g`` is the
  ``g``-th tensor the step saves, unpack ``i`` its ``i``-th unpack (planner.py's clocks). A
  group of an ended step unpacked later is restored on demand, outside any step's clock.
- Entering a session inside itself (a forward calling the model again) is part of the outer
  ``with``; leaving the outermost by any exception leaves grad mode, hooks and staging as they
  were. A planned step whose groups differ from the profile's (another size) keeps those groups.
"""

from __future__ import annotations

import threading
import weakref
from collections import defaultdict

import torch

from . import planner
from .aside import StandAside, input_signature
from .compiled import refuse_if_compiling
from .lend import WorkspaceLender
from .link import CudaLink, SameMemoryLink
from .planner import OFFLOAD, RECOMPUTE
from .records import _Step
from .replay import returns_own_input
from .recorder import StepRecorder, _current_node, _has_children, _past_the_op_recorder
from .host_copies import StepCopies
from .lifecycle import SETTLED, Lifecycle
from .plan_worker import ProcessRunner
from .plancache import PlanCache
from .saved_tensors import SavedTensorHooks
from .session_plans import PlanLifecycle
from .stage import StagedForward, StagePlan
from .rescue import StepRescue


class OffloadSession(SavedTensorHooks, PlanLifecycle):
    """Saved-tensor hooks and leaf-module hooks (while entered) carrying out a plan.

    ``budget`` (bytes): the first ``record_steps`` (default
    :data:`~mucudnn.torch.planner.RECORD_STEPS`) steps record (every dense saved tensor
    offloaded on the compute stream, fetched on demand; the last is the profile, with each time
    the least any recorded), then a plan is made for ``budget * (1 - headroom)`` (room for the
    caching allocator's fragmentation; CBC at most ``plan_time_limit_s`` per solve) and applied
    from the step after it is ready. ``plan_in_background``: plans are made on a thread of their
    own, the steps meanwhile running as the recording ran (None, the default: where the link is a
    :class:`CudaLink`; else each plan is made at the step boundary that asks for it and is in
    force from the next step). ``plan_cache``: the :class:`~.plancache.PlanCache` a plan that
    settles is kept in and the first step looks its plan up in (None: ``MUCUDNN_PLAN_CACHE``'s
    on a GPU, none elsewhere): a run of the same script under the same key runs it from its
    first step, checked against it as it goes (recording anew where it differs); where it holds
    no plan but a floor an earlier run found under any budget (no plan met it, or it ran out of
    memory with everything offloaded: :class:`~.plancache.StepFloor`) that rules this budget
    out, one ``warn`` line says so before the first step runs. ``freeze_gc``:
    the first step boundary past the recording collects and freezes Python's garbage collector
    once (``gc.freeze``; what ``mucudnn run --offload`` asks). The lifecycle
    (:attr:`lifecycle`, :class:`~.lifecycle.Lifecycle`) holds ``budget``, ``profile``,
    ``plan``, ``modes``, ``target``, ``fell_back``, ``kept_after_trial`` and the replan counts.
    ``modes``: a fixed plan instead (one mode per group; tests, benchmarks). ``force``: every
    group in that mode where allowed.
    ``link``: the host link; default :class:`CudaLink` for CUDA tensors, CPU tensors stay.
    ``recompute``: recipes at all; ``recompute_convolutions``: recipes may rerun convolutions
    (:data:`CONVOLUTIONS`; see the module docstring). ``copy_exposure``: the planner's
    :data:`~mucudnn.torch.planner.COPY_EXPOSURE`. ``max_pending``: :class:`CudaLink`'s, the bytes
    of copies to the host in flight before the host thread waits for the oldest.
    ``trace``: a list that receives ``(event, gid, ...)`` tuples (tests). ``profile_to``: a
    path where each plan made (or the fall-back when none meets the budget) writes the recorded
    profile, the target and the modes as JSON (:meth:`write_profile`), so that the planner can be
    replayed on it off the GPU. ``strict``: a budget
    no plan meets raises :class:`~mucudnn.errors.InfeasibleError` (a solver failure its
    ``SolverError``); else ``say`` it and offload every saved tensor, as the recorded step did.
    A planned step that runs out of device memory (the link's ``ooms()`` grew, or ``rescue``
    below moved tensors; an exception it could not rescue propagates) shows the peak model fell
    short: the plan is made again for a lower target
    (``min(target, modelled peak) - replan_step * budget``), at most ``replans`` times, each with
    one line; after that, or when no plan meets the lower target, every later step offloads every
    saved tensor, with one line (``fell_back``). ``rescue``: in the first steps of each plan
    (True), every planned step (``"always"``) or never (False), an op the caching allocator
    refuses runs again once the step's kept tensors needed last are on the host, and the step
    goes on (rescue.py, :attr:`rescuer`); such a step counts as one that ran out of memory.
    ``lend`` (off by default: measured no faster, benchmarks/results/plan-accuracy): planned
    steps lend the preloaded shim workspace where the plan leaves room (lend.py, :attr:`lender`).
    ``trials``: where the plan moves bytes and :func:`planning.trial_plans` finds others its
    simulation says are faster (made at other copy exposures, and for smaller headrooms:
    :data:`planner.TRIAL_HEADROOM_SHARES`), run
    each :data:`planner.TRIAL_STEPS` steps and keep the fastest that did not flush the caching
    allocator's cache (:meth:`.trial.Trial.kept`), with one line (the plan made runs while
    the others are made). ``keep_apart`` (off by default: it won no trial measured,
    benchmarks/results/plan-accuracy): the trial also runs its simulated fastest plan with the
    small kept groups copied apart from the step's large tensors
    (:meth:`.host_copies.StepCopies.keeps_apart`), and keeps it that way where it wins.
    ``stand_aside`` (on by default): once a plan that keeps every saved tensor has run settled,
    the session removes its hooks, the steps are PyTorch's own, and it comes back where the
    caching allocator flushes or the model's input changes (aside.py, :attr:`aside`).
    ``replay`` (on by default): once a planned step has found every recipe its plan needs, the
    next steps under that plan check the same recipes against autograd's graph at their packs
    and record no calls (replay.py).
    """

    #: a session entered anew at each forward (a fitted model's: fitted.py), whose ``with``'s
    #: exit is no end of its steps (aside.py, rule 5)
    enters_per_forward = False

    def __init__(self, budget: int | None = None, *, modes=None, force: str | None = None,
                 link: SameMemoryLink | None = None, lookahead: int = 2, recompute: bool = True,
                 min_bytes: int = 1 << 20, headroom: float = 0.1, trace: list | None = None,
                 say=None, strict: bool = True, replans: int = 3, replan_step: float = 0.1,
                 record_steps: int | None = None, plan_time_limit_s: float = 20,
                 recompute_convolutions: bool = True,
                 copy_exposure: float = planner.COPY_EXPOSURE, profile_to=None,
                 max_pending: int = 1 << 30, trials: bool = True, keep_apart: bool = False,
                 stage: bool | str = True, plan_in_background: bool | None = None,
                 plan_cache: PlanCache | None = None, freeze_gc: bool = False,
                 rescue: bool | str = True, warn=None, lend: bool = False,
                 stand_aside: bool = True, replay: bool = True):
        self.force, self.lookahead = force, lookahead
        if stage not in (True, False, "always"):
            raise ValueError(f"OffloadSession: stage={stage!r} is not True, False or 'always'")
        if rescue not in (True, False, "always"):
            raise ValueError(f"OffloadSession: rescue={rescue!r} is not True, False or 'always'")
        if force is not None and force not in planner.MODES:
            raise ValueError(f"OffloadSession: force={force!r} is not one of {planner.MODES}")
        if modes is not None and not isinstance(modes, str):
            modes = list(modes)
        if modes is not None and (isinstance(modes, str) or
                                  not all(mode in planner.MODES for mode in modes)):
            raise ValueError(f"OffloadSession: modes={modes!r} is not a sequence of modes "
                             f"{planner.MODES}, one per saved group (every group in one mode: "
                             "force=)")
        #: the plan's life (lifecycle.py): recording, the plan made and tried, watched, made
        #: again; budget, profile, plan, modes, target, fell_back, ... are its
        self.lifecycle = Lifecycle(
            budget, modes=modes, force=force, headroom=headroom, lookahead=lookahead,
            replans=replans, replan_step=replan_step, record_steps=record_steps, trials=trials,
            keep_apart=keep_apart, staging=stage, strict=strict,
            plan_time_limit_s=plan_time_limit_s)
        #: plans made on a thread of their own (None: decided at the first step's end, on a GPU)
        self.plan_in_background = plan_in_background
        if plan_in_background:
            self.lifecycle.runner = ProcessRunner(say=lambda text: self.say(text))
        #: CBC's limit per solve (the planning times it bounds: benchmarks/results/planning-time.md)
        self.plan_time_limit_s = plan_time_limit_s
        self.recompute, self.min_bytes = recompute, min_bytes
        self.recompute_convolutions = recompute_convolutions
        self.copy_exposure = copy_exposure
        self._link, self._links = link, {}
        self.max_pending = max_pending
        #: the copies of the steps' groups to the host and back (host_copies.py)
        self.copies = StepCopies(self)
        self.trace = trace
        self.profile_to = profile_to
        self.say = say or (lambda text: None)
        #: the lines a user must see (``say``'s where not given): a budget below the step's floor
        self.warn = warn or self.say
        self.steps = 0
        self._first_unpacks: list[int | None] = []   # per group, of the last whole step
        self._schedule: dict[int, list[int]] = {}
        self._step = _Step(profiling=budget is not None and modes is None and force is None)
        self._rerunning = False
        self._mismatch_said = False
        self._unmoved_said = False
        self._empty_cache_due = False   # after a failed step: at the next step's start
        self._handles = []
        self._hooks = None
        self._depth = 0                 # ``with`` blocks entered and not left
        #: torch function modes below the op recorder (where it was entered, or where it left)
        self._function_modes_below = 0
        self._with_thread = None        # the thread that entered the outermost ``with``
        #: records the steps' calls (modules and ops) and finds their recipes (recorder.py,
        #: recipes.py)
        self.recorder = StepRecorder(self)
        #: stage.py: whether plans may stage the leading chain; the stage in force (its profile
        #: is :attr:`profile`, the recorded one :attr:`recorded_profile`); the staged forward
        #: running; the recording's candidates; the containers running now, innermost last
        self.staging = stage
        self.stage: StagePlan | None = None
        self._staged: StagedForward | None = None
        #: staged forwards begun in this session's steps (its gradients then sum micro-batches)
        self.staged_forwards = 0
        self._containers: list = []
        #: the root module (the outermost container) of a step that replays, from its first
        #: leaf module to the root's return: the module hooks' short path runs (replay.py,
        #: rule 4); None otherwise
        self._lean_root = None
        #: whether steps that replay take that short path (False: every module call runs the
        #: hooks' whole path, as a step that records; for measuring it)
        self.lean_steps = True
        #: the steps that took it
        self.lean_steps_run = 0
        #: the plan cache (plancache.py; None: MUCUDNN_PLAN_CACHE's on a GPU), looked up at the
        #: first step's first leaf module or save (:meth:`_look_up_plan`); the key then, the
        #: entry whose plan the first step runs (checked group by group), and whether the rest
        #: of a step is offloaded as recorded (its cached plan did not fit it)
        self._plan_cache = plan_cache
        self._cache_due = self.lifecycle.recording
        self._cache_key = None
        self._cached = None
        #: the plan last stored in the plan cache (stored again once proven: rescue.py, rule 5)
        self._stored_plan = None
        self._offload_rest = False
        #: freeze Python's collector once the recording is over (:meth:`_freeze_gc`)
        self.freeze_gc = freeze_gc
        self._gc_frozen = False
        #: workspace lent to the shim where the plan in force leaves room (lend.py; ``lend``)
        self.lender = WorkspaceLender(on=lend)
        #: an op the allocator refuses, run again (rescue.py)
        self.rescuer = StepRescue(self, rescue)
        self.rescuer.arm()   # the first step: fixed modes are in force from it
        #: the hooks removed while a plan that keeps everything runs settled (aside.py)
        self.aside = StandAside(self, on=stand_aside)
        #: steady planned steps replay their recipes from autograd's graph (replay.py)
        self.replay = replay
        #: the root call's first tensor argument (aside.py, rule 3), read at the step's start;
        #: the module whose forward enters the session (a fitted model's), where one does
        self._root_signature = None
        self.outer_module = None

    # --- entering and leaving -------------------------------------------------------------
    def __enter__(self):
        refuse_if_compiling("entering a mucudnn.torch session")
        # re-entrant: a forward under the session calling the model again (a siamese wrapper
        # running itself) is part of the outer forward; only the outermost ``with`` installs
        # and removes the hooks
        self._depth += 1
        if self._depth > 1:
            return self
        self._with_thread = threading.get_ident()
        if not self.aside.standing:   # standing aside: its watch stays (aside.py, rule 5)
            self._install_hooks()
        return self

    def _install_hooks(self) -> None:
        """The saved-tensor hooks, the global module hooks, and the op recorder and rescue mode
        where due: at the outermost ``with``, and where the session comes back from standing
        aside inside it (aside.py)."""
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        hooks.__enter__()   # raises where saved-tensor hooks are off (torch.func): none pushed
        self._hooks = hooks
        self._containers = []
        hooks = torch.nn.modules.module
        self._handles = [hooks.register_module_forward_pre_hook(self._before_module),
                         hooks.register_module_forward_hook(self._after_module, always_call=True)]
        # the torch function modes below the session's: where the stack has this many again
        # at a step's start, the op recorder may go on top (:meth:`_start_ops_if_due`)
        self._function_modes_below = torch._C._len_torch_function_stack()
        if self._recipes_used():  # the ops a recipe may include (the residual add)
            self.recorder.start_ops()
        self.rescuer.sync()

    def on_with_thread(self) -> bool:
        """The calling thread entered the session's outermost ``with``: the stacks of modes the
        ``with`` pushes to and pops from are this thread's (a leaf module run on another thread,
        ``parallel_apply``'s replicas, has stacks of its own, which the ``with``'s exit never
        pops)."""
        return threading.get_ident() == self._with_thread

    def _recipes_used(self) -> bool:
        """Whether the steps run in this ``with`` may use recipes: recording ones (the profile's
        recipes), or a plan or ``force`` that recomputes. Otherwise no op is recorded, and the
        function mode that records them (a Python call per torch function) is not entered."""
        if not self.recompute or self.fell_back:
            return False
        if self.force is not None:
            return self.force == RECOMPUTE
        if self.modes is not None:
            return RECOMPUTE in self.modes
        return self.budget is not None

    def __exit__(self, *exc_info):
        self._depth -= 1
        if self._depth > 0:
            return
        # Any exception (KeyboardInterrupt too, which skips the modules' ``always_call`` hooks)
        # leaves grad mode, the hooks and the staged state as they were before the forward.
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.abort()
        self._containers, self._lean_root = [], None
        if self._step.pending:   # the forward is over: every op saving a pending group has run
            self.copies.copy_pending(self._step)
        self.recorder.stop_ops(exc_info)
        self.rescuer.leave()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._hooks is not None:   # None: standing aside (aside.py)
            self._hooks.__exit__(*exc_info)
            self._hooks = None
        self.aside.leave(ended=not self.enters_per_forward)
        if exc_info[0] is None:
            return
        self.lender.withdraw()
        if self._step.unpacks:
            # the forward failed before its first module or save: the step still open is the
            # last one, whose backward ran; it ends as it would have, and the failure is no plan's
            self._end_step()
        if self._step.groups:
            # the forward failed: this step never reaches its backward; the next one starts afresh
            self._end_step(failed=True,
                           out_of_memory=issubclass(exc_info[0], torch.OutOfMemoryError))

    # --- the host link per device ---------------------------------------------------------
    def link_for(self, tensor: torch.Tensor) -> SameMemoryLink | None:
        if self._link is not None:
            return self._link
        # ``is_cuda`` and ``get_device()`` read the tensor's device without making a
        # torch.device object (at every group's pack and unpack)
        if not tensor.is_cuda:
            return None
        link = self._links.get(tensor.get_device())
        if link is None:
            link = self._links[tensor.device.index] = CudaLink(tensor.device, self.max_pending)
        return link

    def _links_in_use(self) -> list[SameMemoryLink]:
        return [self._link] if self._link is not None else list(self._links.values())

    def _poll_links(self) -> None:
        # :meth:`_links_in_use`'s links, without building its list (at every leaf module call)
        if self._link is not None:
            self._link.poll()
            return
        for link in self._links.values():
            link.poll()

    def _known_link(self) -> SameMemoryLink | None:
        """The session's link, or the first it made for a device; None before any."""
        return self._link or next(iter(self._links.values()), None)

    def _any_link(self) -> SameMemoryLink:
        return self._known_link() or SameMemoryLink()


    # --- the global module hooks ------------------------------------------------------------
    @_past_the_op_recorder
    def _before_module(self, module, args):
        root = self._lean_root
        if root is not None:   # replay.py, rule 4: of a lean step, only what it records
            # the root again, inside its own forward; or the next step's first module (a root
            # whose forward a BaseException left never returns): the whole path
            if module is root or self._step.unpacks:
                self._end_lean()
            elif id(module) not in self._step.records_only:
                if not self.on_with_thread():
                    self._step.foreign = True   # its nodes are numbered apart (replay.py, rule 3)
                return None
        if self._step.pending:    # between ops: every op saving a pending group has run
            self.copies.copy_pending(self._step)
        if self._rerunning or not torch.is_grad_enabled() or _current_node() is not None:
            return   # a rerun, no_grad, or inside a backward (_in_backward, without its call)
        if _has_children(module):
            if not self._containers:   # the outermost: its call's input (aside.py, rule 3)
                self._root_signature = input_signature(args)
            self._containers.append(module)   # the parent of the leaves it runs
            return
        self._poll_links()   # between packs too: a module that saves nothing of ours
        # the first module of the next step: its calls belong there (where autograd holds the
        # step's groups and none unpacked, :meth:`_at_step_start` does nothing: not called)
        step = self._step
        if not step.live or step.unpacks or self._empty_cache_due:
            self._at_step_start()
            if self.aside.due():   # this step's hooks go here (aside.py, rule 2)
                if self.outer_module is not None:   # its call is no module call of the with's
                    root, signature = self.outer_module, None
                elif self._containers:
                    root, signature = self._containers[0], self._root_signature
                else:
                    root, signature = module, input_signature(args)
                self.aside.stand(root, signature)
                return
        parent = self._containers[-1] if self._containers else None
        if self._cache_due and args and isinstance(args[0], torch.Tensor) and (
                args[0].is_cuda or self._plan_cache is not None
                and not torch.cuda.is_available()):
            # the first step's first leaf module: a cached plan's stage starts here. One on the
            # host where a GPU is there (a preprocessing layer before the model's device) leaves
            # it to the first save, whose device names the plan's GPU in its key
            self._look_up_plan(args[0].device, (module, parent, args))
        step = self._step
        if not self.on_with_thread():
            step.foreign = True   # its nodes are numbered apart (replay.py, rule 3)
        if not step.records_only_decided and not step.profiling and \
                self.recorder.finds_recipes(step):
            self.recorder.recorded_modules(step)   # whether it replays: before the op recorder
        if not step.ops_looked_at:
            if self.recorder.ops is None:
                self._start_ops_if_due(step)
            else:
                self._stop_ops_if_unused(step)
            if step.replays is not None and self._lean_allowed(step):
                self._lean_root = self._containers[0]
                self.lean_steps_run += 1
        # a stage in force stages its chain; in a recording step only the one that step took
        # (:meth:`_stages_recording`: the recording would not fit otherwise)
        if self._staged is None and (self.stage is not None or step.profiling) and \
                self._stage_starts(step, module, args, parent):
            if step.profiling:
                # the forward starts here: at the chain's last start, since a forward that raised
                # before the step's first save (in the chain) leaves the step open for the next
                link = self.link_for(args[0])
                step.forward_start = link.mark() if link is not None else None
            self._staged = StagedForward(self.stage, args[0])   # grad mode off till its end
            self.staged_forwards += 1
            return self._staged.first_args(args)   # its output is made in micro-batches
        self.recorder.module_starts(step, module, args, parent)

    @_past_the_op_recorder
    def _after_module(self, module, args, output):
        root = self._lean_root
        if root is not None:   # replay.py, rule 4
            if module is root:   # the forward's end: the root's return, as the whole path has it
                self._end_lean()
            elif id(module) not in self._step.records_only:
                step = self._step
                # a leaf returning its own input (rule 2), and a module returning what a recorded
                # call returned (recorder.module_returns: it is that tensor's last maker)
                if returns_own_input(module, args, output) and not _has_children(module):
                    step.replay_doubt = True
                if step.outputs and isinstance(output, torch.Tensor) and \
                        id(weakref.ref(output)) in step.outputs:
                    self.recorder.module_returns(module, output)
                return None
        if self._step.pending:
            self.copies.copy_pending(self._step)
        if self.rescuer.armed:
            self.rescuer.watch(output)
        self.recorder.put_back(module)
        staged = self._staged
        if staged is not None and module in staged.modules:
            if not isinstance(output, torch.Tensor):   # it raised (this hook is always called)
                self._staged = None
                staged.abort()
            elif staged.ends_at(module):
                self._staged = None
                output = staged.finish(output)
                if self._step.profiling:   # what a longer stage would start from (recording.py)
                    self._step.stage_end_groups = len(self._step.groups)
                return output
            return None
        if self._containers and self._containers[-1] is module:
            self._containers.pop()
            return None
        if self._step.replays is not None and returns_own_input(module, args, output):
            self._step.replay_doubt = True   # replay.py, rule 2
        self.recorder.module_returns(module, output)
        return None

    def _lean_allowed(self, step: _Step) -> bool:
        """Whether ``step``, which replays, runs lean from this leaf module on (replay.py, rule
        4): the whole path would do nothing at its other modules but the checks the short path
        keeps: nothing is copied or polled (no offload, no copy kept apart), staged, lent,
        traced, rescued or looked up in a plan cache, its op recorder is off, and a container
        runs this leaf on the ``with``'s thread."""
        plan, modes = self.plan, self.modes
        return (self.lean_steps and bool(self._containers) and self.recorder.ops is None
                and not step.pending and not step.profiling and self.stage is None
                and self._staged is None and self.force is None and self.trace is None
                and self.lender.plan is None and not self.rescuer.armed
                and self._cached is None and not self._cache_due and not self._offload_rest
                and modes is not None and OFFLOAD not in modes
                and (plan is None or not plan.keep_apart) and self.on_with_thread())

    def _end_lean(self) -> None:
        """The short path ends (the root's call or return, a module called once the step's
        backward has begun, a step's start): the containers the root ran since it began were not
        stacked, so the stack is the root alone, as at the root's call."""
        root, self._lean_root = self._lean_root, None
        if root is not None:
            self._containers = [root]

    def _event(self, *event):
        if self.trace is not None:
            self.trace.append(event)

    # --- steps, profile, plan -------------------------------------------------------------
    def _end_step(self, failed: bool = False, out_of_memory: bool = False,
                  abandoned: bool = False) -> None:
        """The step is over: the next one saves its first tensor or runs its first module, or its
        forward raised (``failed``; ``out_of_memory`` when it ran out of device memory), or its
        graph was dropped without a backward (``abandoned``: the next step runs as it would
        have, recording or planned; nothing is learnt from this one).

        When the next step runs other modes (the plan made, each plan of a trial, the one kept
        after it, a plan made again, the fall-back), the links' caching allocators start it
        empty: between steps little is allocated (parameters, the optimizer's state), so each
        plan lays its tensors out from the same state rather than in the holes the last plan's
        layout left, and a trial compares plans, not the order it ran them in. After a failed
        step that waits for the next step's start: until the script lets go of the error, its
        traceback holds the failed forward's tensors.
        """
        self.lender.withdraw()
        if abandoned:
            for used in self._links_in_use():
                used.settle()
            self._step = _Step(profiling=self._step.profiling)
            self._event("abandoned", self.steps)
            self.rescuer.arm()
            return
        plan, modes = self.plan, self.modes
        rescued = self._step.rescued
        self.recorder.learn_recipe_modules(self._step, modes, failed)
        self._close_step(failed, out_of_memory)
        self.aside.step_ended(failed)
        if self.modes is not None and (self.modes != modes or self.plan is not plan):
            if failed:
                self._empty_cache_due = True
            else:
                self._empty_caches()
        self.rescuer.arm(ended=True, rescued=bool(rescued), failed=failed)

    def _at_step_start(self) -> None:
        """A module runs or a tensor is saved: if the step before has unpacked (its backward
        ran), this one is the next step's first, and that step ends here; a cache emptying
        left due by a failed step happens here too."""
        step = self._step
        if step.unpacks:
            self._end_lean()   # a step starting inside a lean step's forward (rule 4)
            self._end_step()
        elif not step.live and step.abandoned():   # live: held by autograd, not abandoned
            self._end_lean()
            self._end_step(failed=True, abandoned=True)
        if self._empty_cache_due:
            self._empty_caches()

    def _start_ops_if_due(self, step: _Step) -> None:
        """At ``step``'s first leaf module, once: the op recorder entered where the ``with`` was
        entered without it and the step's modes recompute. A new plan takes over at its step's
        first module or save, inside the ``with`` (the first planned step after steps run as
        recorded). Only where nothing the script entered since the ``with`` is above it on the
        stack of torch function modes (the script's own mode would leave first), and never from
        the pack hook (it runs inside an op, where a mode handling that op is off the stack);
        else the step's recipes through the recorded ops (a residual add) are not found, and
        their groups are kept, as said then. Only :meth:`on_with_thread`: a leaf module run on
        another thread leaves it to that step's next leaf module on the ``with``'s."""
        if not self.on_with_thread():
            return
        step.ops_looked_at = True
        if self._depth > 0 and self._recipes_used() and step.replays is None and \
                torch._C._len_torch_function_stack() == self._function_modes_below:
            self.recorder.start_ops()

    def _stop_ops_if_unused(self, step: _Step) -> None:
        """At ``step``'s first leaf module, once: the op recorder left where the plan is settled
        (:data:`.lifecycle.SETTLED`: a plan or the fall-back in force), the step's modes
        recompute nothing (a plan that keeps and offloads only) and it is on top of the stack of
        torch function modes. Such a step records no op, and with the recorder entered every
        torch function its forward calls (each one inside a leaf module that finds no recipe too)
        would be a Python call through it. A later step whose modes recompute enters it again (:meth:`_start_ops_if_due`) where the
        stack has as many modes as it left below the recorder (a mode the script entered since
        and left on keeps it out: that step's groups whose recipe needs an op are kept, with one
        line); that step's ops before its first leaf module are not recorded (their groups are
        kept in that step). Not in a trial, whose plans alternate. Only :meth:`on_with_thread`,
        as there."""
        if not self.on_with_thread():
            return
        step.ops_looked_at = True
        # a step that replays its recipes records no op (replay.py)
        if (step.replays is not None or not self._recipes_used() and self.state in SETTLED) \
                and self.recorder.stop_ops_on_top():
            self._function_modes_below = torch._C._len_torch_function_stack()

    def _empty_caches(self) -> None:
        self._empty_cache_due = False
        for link in self._links_in_use():
            link.empty_cache()
        self._event("empty_cache", self.steps)


    @property
    def prefetch_margin(self) -> float:
        """The plan's :func:`planner.prefetch_point` margin (0 without a plan: untimed)."""
        return self.plan.prefetch_margin if self.plan is not None else 0.0

    @property
    def prefetch_distance(self) -> int:
        """How many unpacks ahead offloaded groups are fetched: the plan's (it may prefetch less
        than ``lookahead`` to fit), else ``lookahead``."""
        return self.plan.lookahead if self.plan is not None else self.lookahead

    def _prefetch_schedule(self, modes) -> dict[int, list[int]]:
        """Unpack index -> offloaded groups to fetch then, relative to the first unpack of each as
        the last finished step unpacked them (vDNN's prefetch; one it never unpacked is fetched
        on demand): as many unpacks ahead as the planner's model has it
        (:func:`planner.prefetch_point` on the profile), else ``prefetch_distance``."""
        schedule = defaultdict(list)
        profile = self.profile
        for gid, (first, mode) in enumerate(zip(self._first_unpacks, modes)):
            if mode != OFFLOAD or first is None:
                continue
            distance = self.prefetch_distance
            if profile is not None and gid < len(profile.groups):
                distance = profile.groups[gid].first_unpack - planner.prefetch_point(
                    profile, gid, self.prefetch_distance, self.prefetch_margin)
            schedule[max(0, first - distance)].append(gid)
        # at each point in the order the groups were saved, so the one needed last is allocated
        # first and freed last: stack order for the caching allocator (needed-first order frees
        # them out of stack order, which leaves holes that make it flush its cache). The one
        # needed at that unpack goes first all the same (:meth:`_unpack`); planner.simulate
        # plays this.
        return dict(schedule)
