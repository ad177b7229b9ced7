"""The recorder of mucudnn.torch's offload session: what a step's forward ran (leaf modules, and
the ops of :data:`ADDS` and :data:`CONCATS` through :class:`_OpRecorder`), timed on the link's
clock in a recording step; the recipes that rebuild a saved tensor from saved groups are found
from these records by its :class:`~.recipes.RecipeFinder` (recipes.py), and a recording step's
profile is made from them by recording.py. The session owns one :class:`StepRecorder` and calls
it from its hooks."""

from __future__ import annotations

import bisect
import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from .compiled import refuse_if_compiling
from .link import SameMemoryLink
from .planner import KEEP, RECOMPUTE
from .recipes import RecipeFinder, _changes_in_place
from .records import (CHEAP, CONVOLUTIONS, _INSTANCE_NORMS, _Call, _Group, _ModuleState, _Read,
                      _Step, _joined)
from .replay import template_of
from .stage import _AUTOCAST_DEVICES, ChainRecorder, autocast_state

#: Ops a recipe may include besides modules (recorded by :class:`_OpRecorder`): the sum of two
#: tensors, deterministic and elementwise (ResNet's residual ``out += identity``, which Python runs
#: as ``add_``); True where the op changes its first operand.
ADDS = {torch.Tensor.add_: True, torch.Tensor.__iadd__: True, torch.Tensor.add: False,
         torch.Tensor.__add__: False, torch.add: False}
#: Concatenations a recipe may include too (a U-Net's skip joined to its upsampled input, which
#: the next convolution saves): a copy of their operands, deterministic.
CONCATS = (torch.cat, torch.concat)
#: the module of nn.Module's global hooks (read at every leaf module call of a recording step)
_GLOBAL_HOOKS = torch.nn.modules.module


class _OpRecorder(TorchFunctionMode):
    """Hands the ops of :data:`ADDS` and :data:`CONCATS` to the session's recorder, which records
    them while a step's forward records; every other function, and tensor attribute reads, pass
    straight through (a dict look-up each)."""

    def __init__(self, recorder: StepRecorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            recorded = func in ADDS
        except TypeError:         # an unhashable callable: no add
            recorded = False
        if recorded:
            refuse_if_compiling("a mucudnn.torch session's op recorder")
            return self.recorder.op(func, args, kwargs or {})
        if func in CONCATS:
            refuse_if_compiling("a mucudnn.torch session's op recorder")
            return self.recorder.concat(func, args, kwargs or {})
        return func(*args, **kwargs) if kwargs else func(*args)


def _past_the_op_recorder(hook):
    """A session's module hook run with torch function handling off while the session's
    :class:`_OpRecorder` is entered: its own reads of tensors (shapes, strides, storages) and
    copies are none of the recorder's, and each would be a Python call through it (most of the
    calls a forward makes). The pack hook (SavedTensorHooks._pack) runs the same way, written
    out there."""
    refusal = f"a mucudnn.torch session's {hook.__name__.strip('_').replace('_', ' ')} hook"
    quiet = hook.__name__ == "_after_module"

    @functools.wraps(hook)
    def run(session, *args):
        # spelled out here: dynamo recognises this call only by its own name
        if torch.compiler.is_compiling():
            if quiet:   # always_call runs it after the refused forward: said once
                return None
            refuse_if_compiling(refusal)
        if session.recorder.ops is None:
            return hook(session, *args)
        with torch._C.DisableTorchFunction():
            return hook(session, *args)
    return run


#: the most steps recording every call that :meth:`StepRecorder.learn_recipe_modules` learns
#: from before a step records only the learnt modules (a forward alternating between more
#: modules than this keeps being learnt, a step in every so many recording every call)
_MOST_LEARNING_STEPS = 8
#: the plans (their modes) whose learnt modules :meth:`StepRecorder.learn_recipe_modules` keeps,
#: the most recently run: a trial runs each of its plans in turn and keeps one of them, which then
#: runs again without another step recording every call (a trial and a lowering: at most 4 plans)
_LEARNT_PLANS = 4


@dataclass
class _RecipeModules:
    """The leaf modules whose calls the recipes of planned steps under one plan's modes ran
    (:meth:`StepRecorder.learn_recipe_modules`, which keeps one per modes)."""

    ids: frozenset = frozenset()   # the modules' ids, and those that saved a view of their input
    needed: int = 1     # steps recording every call to learn from before recording only ``ids``
    seen: int = 0       # of those, learnt from since the last step that lacked a module
    active: bool = False   # steps under its plan's modes record only ``ids``
    #: gid -> replay.RecipeTemplate for every group its modes recompute, learnt from a step
    #: that recorded every call; None: not every one has a template (replay.py, rule 1)
    templates: dict | None = None
    #: a step that replayed kept a group its modes recompute: never replayed again
    replay_failed: bool = False
    #: the ids of the modules whose calls a step that replays records (replay.py, rule 2)
    watched: frozenset = frozenset()


class StepRecorder:
    """Records the calls of the session's steps and finds their recipes; its state is the op
    recorder entered now and the measure of the call timed now. ``session``: the
    :class:`~mucudnn.torch.offload_session.OffloadSession` that owns it (its step, modes and
    links)."""

    def __init__(self, session):
        self.session = session
        self.ops: _OpRecorder | None = None
        #: the leaf modules running now whose forward took the op recorder off the stack of
        #: torch function modes (:meth:`_set_recorder_aside`), innermost last
        self.ops_set_aside: list = []
        #: link -> the most allocated in the current interval of its ``peak_allocated`` before
        #: a call's own measure (:meth:`_start_call`) started one of its own
        self._carried_peak: dict = {}
        self._measuring: tuple = (None, None)   # (call, link): the call measured now
        #: what :meth:`learn_recipe_modules` learnt, per modes (a tuple), the last run last; at
        #: most :data:`_LEARNT_PLANS`
        self._recipe_modules: dict[tuple, _RecipeModules] = {}
        self.recipes = RecipeFinder(session)

    def _records(self, module) -> bool:
        """A leaf module's forward in a step's forward (not a recipe's rerun, not in a
        backward, not under ``no_grad``)."""
        return not (self.session._rerunning or not torch.is_grad_enabled()
                    or _current_node() is not None or _has_children(module))

    # --- the op recorder, entered while the session's steps may use recipes ---------------
    def start_ops(self) -> None:
        self.ops = _OpRecorder(self)
        self.ops.__enter__()

    def stop_ops_on_top(self) -> bool:
        """The op recorder left (True) where it is on top of the stack of torch function modes
        and no leaf module's forward has set it aside: no mode the script entered since is above
        it, so leaving it pops it alone."""
        if self.ops is None or self.ops_set_aside or not self._ops_on_top():
            return False
        self.stop_ops((None, None, None))
        return True

    def _ops_on_top(self) -> bool:
        """The op recorder is the innermost torch function mode."""
        depth = torch._C._len_torch_function_stack()
        return bool(depth) and torch._C._get_function_stack_at(depth - 1) is self.ops

    def stop_ops(self, exc_info) -> None:
        if self.ops is not None:
            if not self.ops_set_aside:   # else a leaf module's forward left without its hook
                self.ops.__exit__(*exc_info)
            self.ops, self.ops_set_aside = None, []

    def put_back(self, module) -> None:
        """The op recorder back on top of the torch function modes, where ``module``'s forward
        set it aside (:meth:`_set_recorder_aside`)."""
        if self.ops_set_aside and self.ops_set_aside[-1] is module:
            self.ops_set_aside.pop()
            torch._C._push_on_torch_function_stack(self.ops)

    # --- leaf modules -----------------------------------------------------------------------
    def module_starts(self, step: _Step, module, args, parent) -> None:
        """Leaf ``module``'s forward starts in ``step``'s forward (``parent``: the container
        running it): a call of the step where it records calls. (At every leaf module call:
        :meth:`records_calls`, :meth:`_read` and an untimed :meth:`_start_call` spelled out.)"""
        finds = step.finds_recipes
        if not (step.profiling or (finds if finds is not None else self.finds_recipes(step))):
            return
        self._set_recorder_aside(module)
        if not step.profiling:
            only = step.records_only if step.records_only_decided else \
                self.recorded_modules(step)
            if only is not None and id(module) not in only:
                return
        if step.profiling and step.start_allocated is None:
            step.start_allocated = self.session._any_link().allocated()
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        recomputable = self._recomputable(module)
        call = _Call(
            module, type(module).__name__,
            (_Read(weakref.ref(source), source._version),) if source is not None else (),
            None, None, in_place=_in_place(module),
            recomputable=recomputable, autocast=_autocast_now() if recomputable else (),
            state=_ModuleState.of(module) if recomputable else None)
        if step.profiling:
            self._start_call(call)
        else:   # the step's next call (``step`` is the session's), untimed
            call.index = len(step.calls)
            step.calls.append(call)
        if step.profiling and self.session.staging:
            if step.chain is None:
                step.chain = ChainRecorder()
            step.chain.enter(module, args, parent, len(step.groups), call, self.session._key,
                             self.session.saves_as_group)

    def module_returns(self, module, output) -> None:
        """Leaf ``module``'s forward returned ``output`` (not a tensor: it raised)."""
        step = self.session._step
        finds = step.finds_recipes   # :meth:`records_calls`, without its call once decided
        if not (step.profiling or (finds if finds is not None else self.finds_recipes(step))) \
                or not self._records(module):
            return
        only = step.records_only
        if only is not None and id(module) not in only:
            # a module not recorded that returns a tensor a recorded call returned (its input,
            # perhaps changed through ``.data``, which no version counter sees) is that tensor's
            # last maker, as where it is recorded: a call no recipe reruns, so no recipe
            # rebuilds the tensor as it was before this module ran
            if isinstance(output, torch.Tensor) and id(weakref.ref(output)) in step.outputs:
                call = _Call(module, type(module).__name__, (), None, None)
                self._start_call(call)
                self._returned(call, output)
            return
        if step.chain is not None:
            step.chain.leave(module, output, len(step.groups))
        for call in reversed(step.calls):
            if call.module is module and not call.done:
                self._returned(call, output)
                break
        if isinstance(output, torch.Tensor) and self.session.recompute:
            self.late_recipe(output)

    def _start_call(self, call: _Call) -> None:
        """``call`` is the step's next; in a recording step it starts now on the link's clock.
        A recomputable one is also measured from here to its return: the most the link allocates
        meanwhile above what it held here is what its rerun allocates at most
        (:attr:`_Call.rise`), and the interval of :meth:`_peak` it falls in carries on. Not
        measured on its own: a call inside a measured one (its allocations are that call's), or
        one before the step's first pack (no link yet to read)."""
        if self.session._step.profiling:
            link = self.session._known_link()
            if call.recomputable and link is not None and self._measuring[0] is None:
                self._carry_peak(link)
                call.allocated_before = link.allocated()
                self._measuring = (call, link)
            call.start = self.session._any_link().mark()   # after the measure's own host work
        call.index = len(self.session._step.calls)
        self.session._step.calls.append(call)

    def peak(self, link: SameMemoryLink) -> int:
        """``link.peak_allocated()``: the most allocated since the previous read, including what
        the call measured meanwhile read of it (and counting this interval in that call's
        rise)."""
        device = link.peak_allocated()
        call, measured = self._measuring
        if measured is link:
            call.rise = max(call.rise, device - call.allocated_before)
        return max(device, self._carried_peak.pop(link, 0))

    def _carry_peak(self, link: SameMemoryLink) -> None:
        """Starts a measured call's interval of ``link``'s peak (or ends it), the most allocated
        in :meth:`_peak`'s interval so far carried on to its next read."""
        self._carried_peak[link] = self.peak(link)

    def _recomputable(self, module) -> bool:
        """Of a recomputable type, and without hooks of its own: a rerun would run them again
        (``spectral_norm``'s power iteration changes the weight and its buffers)."""
        if module._forward_pre_hooks or module._forward_hooks:
            return False
        if type(module) in _INSTANCE_NORMS:
            return getattr(module, "running_mean", None) is None
        return type(module) in CHEAP or (self.session.recompute_convolutions
                                         and type(module) in CONVOLUTIONS)

    def _set_recorder_aside(self, module) -> None:
        """Takes the op recorder off the stack of torch function modes while leaf ``module``'s
        forward runs, where it is on top: no op inside a leaf module is recorded (it is part of
        the module's call), and each torch function it calls would be a Python call through
        the recorder. :meth:`_after_module` (called even where the forward raises an Exception)
        puts it back. Only where no hook runs after the session's pre-hook (the module's own, a
        global one registered later): one entering a mode there and leaving it in a forward hook
        would find the recorder put back on top of it, and pop the recorder. (A forward left by
        a BaseException leaves the recorder aside until that module runs again: until then no
        op is recorded, and no recipe through one is found.)"""
        if self.ops is None or module._forward_pre_hooks or module._forward_hooks:
            return
        # the session's global module hooks are the last registered: each runs after the other
        # global ones (a module's own hooks run after all of them); where each is the only one,
        # it is the session's
        pre, post = _GLOBAL_HOOKS._global_forward_pre_hooks, _GLOBAL_HOOKS._global_forward_hooks
        if len(pre) != 1 or len(post) != 1:
            before, after = self.session._handles
            if next(reversed(pre), None) != before.id or next(reversed(post), None) != after.id:
                return
        depth = torch._C._len_torch_function_stack()   # :meth:`_ops_on_top`, without its call
        if depth and torch._C._get_function_stack_at(depth - 1) is self.ops:
            torch._C._pop_torch_function_stack()
            self.ops_set_aside.append(module)

    def _returned(self, call: _Call, output) -> None:
        call.done = True
        step = self.session._step
        if isinstance(output, torch.Tensor):
            call.output = weakref.ref(output)
            # ascending, though calls may return out of order (a leaf module running one it
            # does not register returns after it)
            outputs = step.outputs
            indices = outputs.get(id(call.output))
            if indices is None:
                outputs[id(call.output)] = [call.index]
            else:
                bisect.insort(indices, call.index)
            call.output_version = output._version
            call.output_bytes = output.numel() * output.element_size()
            call.output_shape = tuple(output.shape)
        if step.profiling:
            call.end = self.session._any_link().mark()
            if self._measuring[0] is call:
                self._carry_peak(self._measuring[1])
                self._measuring = (None, None)

    def _records_op(self) -> bool:
        """Ops are recorded in a step's forward as modules are, and only before its backward
        began: an op after it (``total += loss.detach()``) neither is the next step's nor
        ends this one; nor inside a leaf module's forward, whose call they are part of (a
        recipe finding an op there would skip the rest of the module)."""
        session = self.session
        return (session.recompute and not session._rerunning and not session._step.unpacks
                and session._step.replays is None
                and self.records_calls(self.session._step) and torch.is_grad_enabled()
                and not _in_backward()
                and RecipeFinder._running_module(self.session._step)[1] is None)

    def op(self, func, args, kwargs):
        """``func(*args, **kwargs)``, recorded as a call when it is an op of :data:`ADDS` on two
        distinct plain tensors of one device (``alpha`` the only keyword) in a recording forward:
        a recipe may then include it (ResNet's ``out += identity``)."""
        if len(args) != 2 or not set(kwargs) <= {"alpha"} or not self._records_op():
            return func(*args, **kwargs)
        first, second = args
        if type(first) is not torch.Tensor or type(second) is not torch.Tensor or \
                first is second or first.device != second.device:
            return func(*args, **kwargs)
        call = _Call(None, func.__name__, (_Read.of(first), _Read.of(second)), None, None,
                     in_place=ADDS[func], op=func, keywords=dict(kwargs), recomputable=True,
                     autocast=_autocast_now())
        return self._run_op(call, func, args, kwargs)

    def concat(self, func, args, kwargs):
        """``func(*args, **kwargs)``, recorded as a call when it joins two or more distinct plain
        tensors of one device (a list or tuple; ``dim`` positional or a keyword, nothing else) in
        a recording forward: a recipe may then include it (a U-Net's ``torch.cat((up, skip))``)."""
        tensors = args[0] if args else kwargs.get("tensors")
        dims = args[1:] + ((kwargs["dim"],) if "dim" in kwargs else ())   # given once at most
        dim = dims[0] if dims else 0
        if len(args) > 2 or len(dims) > 1 or not set(kwargs) <= {"tensors", "dim"} or \
                not isinstance(dim, int) or not isinstance(tensors, (list, tuple)) or \
                len(tensors) < 2 or not self._records_op():
            return func(*args, **kwargs)
        if any(type(t) is not torch.Tensor or t.device != tensors[0].device for t in tensors) or \
                len({id(t) for t in tensors}) != len(tensors):
            return func(*args, **kwargs)
        call = _Call(None, func.__name__, tuple(_Read.of(t) for t in tensors), None, None,
                     op=_joined, keywords={"dim": dim}, recomputable=True,
                     autocast=_autocast_now())
        return self._run_op(call, func, args, kwargs)

    def _run_op(self, call: _Call, func, args, kwargs):
        """``func(*args, **kwargs)`` as the recorded ``call``: started, run, returned."""
        self._start_call(call)
        output = None
        try:
            output = func(*args, **kwargs)
        finally:
            self._returned(call, output)
        return output

    def producer(self, step: _Step, tensor: torch.Tensor) -> str:
        """The name of what made ``tensor`` as it is saved: an in-place module running now on
        it (ReLU(inplace=True) saves its output), else the last call that returned it, else
        "op"."""
        _, running = RecipeFinder._running_module(step)
        if _changes_in_place(running, tensor):
            return running.name
        made_by = RecipeFinder._made_by(step, tensor, len(step.calls))
        return step.calls[made_by].name if made_by is not None else "op"

    def may_recompute(self, step: _Step, gid: int) -> bool:
        """Whether group ``gid`` of ``step`` needs a recipe: in a recording step (the profile's),
        or where its step's plan or ``force`` recomputes it. Finding one is most of what a
        kept group costs the host in the forward."""
        if not self.finds_recipes(step):
            return False
        modes = self.session.modes   # read once: the lifecycle's
        return step.profiling or modes is None or gid < len(modes) and modes[gid] == RECOMPUTE

    def recorded_modules(self, step: _Step) -> frozenset | None:
        """The ids of the only leaf modules whose calls planned ``step`` records, decided at its
        first leaf module: those :meth:`learn_recipe_modules` learnt under the same modes, once
        it learnt from enough steps; None (every module's) until then, under other modes, and in
        the first step under a cached plan (it checks each recipe against the cache's). A call
        not recorded is to a recipe what an op is: what it made is no recipe's, and what it
        changed in place no longer has the version a recorded call left it at; a module not
        recorded that returns a tensor a recorded call returned is noted as its last maker
        (:meth:`module_returns`). So a recipe is found only where it holds, and a step that
        keeps a group its plan recomputes has the next steps record every call again."""
        step.records_only_decided = True
        modes = self.session.modes
        if modes is None or self.session._cached is not None or not self._recipe_modules:
            return step.records_only
        learnt = self._recipe_modules.get(tuple(modes))
        if learnt is not None and learnt.active:
            if learnt.templates is not None and self.session.replay and not step.foreign:
                step.replays, step.records_only = learnt.templates, learnt.watched
            else:
                step.records_only = learnt.ids
        return step.records_only

    def learn_recipe_modules(self, step: _Step, modes, failed: bool) -> None:
        """``step``, run under ``modes``, is over. A planned step that recorded every call, saved
        the groups ``modes`` names and recomputed every one they recompute adds the modules its
        recipes ran, and those that saved a view of their input (a recipe through the view is
        found from the call that saved it), to what later steps under those modes record; they
        record only those once learnt from :attr:`_RecipeModules.needed` such steps. A step that
        recorded only those and kept a group its plan recomputes (a forward that changed: another
        module in its place, a forward alternating between two) has the next steps record every
        call, twice as many of them as before (up to :data:`_MOST_LEARNING_STEPS`), each adding
        its modules: a forward alternating between K (at most that many) is learnt whole. A step
        that recorded every call but is not the plan's (another size of batch: the plan names
        none of its groups; a recipe through an op its recorder could not see) teaches
        nothing."""
        if failed or step.profiling or not step.finds_recipes or modes is None:
            return
        key = tuple(modes)
        learnt = self._recipe_modules.pop(key, None) or _RecipeModules()
        self._recipe_modules[key] = learnt   # the last run last
        if len(self._recipe_modules) > _LEARNT_PLANS:
            del self._recipe_modules[next(iter(self._recipe_modules))]
        if step.records_only is not None:
            for group in step.groups:   # a loop, no generator: at every step's end
                if group.wanted == RECOMPUTE and group.mode != RECOMPUTE:   # a module lacked
                    learnt.active, learnt.seen = False, 0
                    learnt.needed = min(2 * learnt.needed, _MOST_LEARNING_STEPS)
                    if step.replays is not None:   # a template did not hold (replay.py)
                        learnt.replay_failed, learnt.templates = True, None
                    break
            return
        # a group is recomputed only where wanted, and wanted only where ``modes`` recompute it:
        # as many recomputed as ``modes`` recompute is none kept and none of another size
        recomputed = [group for group in step.groups if group.mode == RECOMPUTE]
        if len(step.groups) != len(key) or len(recomputed) != key.count(RECOMPUTE):
            return
        learnt.ids = learnt.ids.union(
            (id(call.module) for group in recomputed for call in group.recipe.calls
             if call.module is not None), step.view_savers)
        learnt.seen += 1
        learnt.active = learnt.seen >= learnt.needed
        # replayed where a template holds; the others (a max pooling's indices) found from
        # their modules' calls, recorded in those steps too: never through an op or a view
        templates = {group.gid: step.templates.get(group.gid) for group in recomputed}
        searched = [group.recipe for group in recomputed if templates[group.gid] is None]
        if learnt.replay_failed or step.foreign or len(searched) == len(recomputed) or any(
                recipe.view is not None or any(call.module is None for call in recipe.calls)
                or any(not isinstance(slot, (int, _Group)) for slots in recipe.inputs
                       for slot in slots) for recipe in searched):
            learnt.templates = None
        else:
            learnt.templates = templates
            learnt.watched = frozenset().union(
                *(t.watched_modules for t in templates.values() if t is not None),
                (id(call.module) for recipe in searched for call in recipe.calls))

    def learn_template(self, step: _Step, gid: int, recipe, tensor: torch.Tensor) -> None:
        """Group ``gid``'s ``recipe``, just found for ``tensor`` in a planned step recording every
        call, as a template later steps may replay (replay.py, rule 1)."""
        if not step.profiling and step.records_only is None and not step.foreign and \
                self.session.replay:
            step.templates[gid] = template_of(recipe, tensor, step)

    def records_calls(self, step: _Step) -> bool:
        """Whether ``step`` records its calls (modules and ops): for its times and its profile
        (recording), or for recipes (:meth:`finds_recipes`). A step that needs neither spends
        its forward's host time on its packs alone."""
        finds = step.finds_recipes   # :meth:`finds_recipes`, without its call once decided
        return step.profiling or (finds if finds is not None else self.finds_recipes(step))

    def finds_recipes(self, step: _Step) -> bool:
        """Whether :meth:`may_recompute` may hold for any group of ``step``: where not, its
        groups need neither recipes nor the aliases recipes start from (:meth:`_alias`). Decided
        at its first module or group, once the step before has ended (modes change only there)."""
        if step.finds_recipes is None:
            if not self.session.recompute:
                step.finds_recipes = False
            elif step.profiling or self.session.modes is None:
                step.finds_recipes = self.session.force in (None, RECOMPUTE)
            else:
                step.finds_recipes = RECOMPUTE in self.session.modes
        return step.finds_recipes

    def late_recipe(self, output: torch.Tensor) -> None:
        """A module that saves its own output (ReLU) packs it before its forward hook names the
        output: its recipe is found here, and a group meant to be recomputed, kept until now
        (nothing unpacks during the forward), drops its tensor."""
        step = self.session._step
        if not self.finds_recipes(step):
            return
        group = self.session._find(step, output)
        if group is None or group.recipe is not None or not self.may_recompute(step, group.gid):
            return
        if step.replays is not None and step.replays.get(group.gid) is not None:
            return   # replayed at its pack, or kept (replay.py)
        recipe = self.recipes.recipe(output, step)
        if recipe is None:
            return
        self.learn_template(step, group.gid, recipe, output)
        group.recipe, group.producer = recipe, recipe.producer
        if group.wanted == RECOMPUTE and group.mode == KEEP and \
                self.session._mode_for(group) == RECOMPUTE:
            group.mode, group.tensor = RECOMPUTE, None
            for source in recipe.sources:
                source.readers += 1
            self.session._event("mode", group.gid, RECOMPUTE)

#: PyTorch's test of autocast on any device type (one call, where :data:`_AUTOCAST_DEVICES`
#: are each a call); False only where it is off on each of them (an older PyTorch: none)
_ANY_AUTOCAST = getattr(torch._C, "_is_any_autocast_enabled", None)


def _autocast_now() -> tuple:
    """:func:`~.stage.autocast_state`, without building it where autocast is off everywhere (at
    every recomputable module call of a step that records calls)."""
    if _ANY_AUTOCAST is not None and not _ANY_AUTOCAST():   # off on every device type
        return ()
    for device in _AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            return autocast_state()
    return ()


#: module types whose ``inplace`` attribute, if any, is an instance's own: no class in their
#: order defines one and their attribute look-up is nn.Module's (:func:`_in_place`)
_PLAIN_LOOKUP: set = set()
_ABSENT = object()


def _in_place(module: nn.Module) -> bool:
    """``bool(getattr(module, "inplace", False))``, without the AttributeError nn.Module's
    ``__getattr__`` makes for a module without one (a convolution, a batch norm) at every
    module call of a step that records calls."""
    kind = type(module)
    if kind not in _PLAIN_LOOKUP:
        if kind.__getattribute__ is not object.__getattribute__ or \
                getattr(kind, "__getattr__", None) is not nn.Module.__getattr__ or \
                any("inplace" in vars(cls) for cls in kind.__mro__):
            return bool(getattr(module, "inplace", False))
        _PLAIN_LOOKUP.add(kind)
    value = module.__dict__.get("inplace", _ABSENT)
    if value is not _ABSENT:
        return bool(value)
    if "inplace" in module._parameters or "inplace" in module._buffers or \
            "inplace" in module._modules:   # where nn.Module's ``__getattr__`` finds it
        return bool(getattr(module, "inplace"))
    return False


def _has_children(module: nn.Module) -> bool:
    """``module.children()`` is not empty: read from the dict it iterates, without a generator
    where it is empty, a leaf's (this runs at every module call of a step's forward)."""
    modules = module._modules
    return bool(modules) and any(child is not None for child in modules.values())


#: PyTorch's function that gives the autograd node whose backward runs now (an older one: none)
_CURRENT_AUTOGRAD_NODE = getattr(torch._C, "_current_autograd_node", None)


if _CURRENT_AUTOGRAD_NODE is not None:
    #: the autograd node whose backward runs now, or None (PyTorch's own function: this runs at
    #: every pack, unpack and module of a step)
    _current_node = _CURRENT_AUTOGRAD_NODE

    def _in_backward() -> bool:
        """Inside an autograd node's backward (where a step's forward never runs)."""
        return _CURRENT_AUTOGRAD_NODE() is not None
else:
    def _current_node():
        """The autograd node whose backward runs now: None, never known here."""
        return None

    def _in_backward() -> bool:
        """Inside an autograd node's backward: never known here."""
        return False
