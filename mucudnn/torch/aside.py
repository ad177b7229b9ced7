"""A session standing aside (docs/torch.md, "Standing aside"): where the plan in force keeps every
saved tensor, a step under it is PyTorch's own step plus the session's hooks, a Python call at
every module and every save that changes nothing (ResNet-152 N=128 on an H200: 1.18-1.23x
PyTorch's step with them, 1.00x standing aside: benchmarks/results/plan-accuracy). Once such a
plan has run settled, the session removes its hooks and watches from one hook on the model's
outermost module, and comes back where the steps change.

Rules:

1. Due at a step's start (the step before ended, :meth:`StandAside.step_ended`) once the last
   :data:`QUIET_STEPS` steps ended under the same modes, each settled (watched or planned: no
   trial, no plan being made), keeping every group, ending ok, and flushing the caching
   allocator's cache in none of them; and where the session stages nothing, lends nothing,
   forces nothing, traces nothing, arms no rescue for the next step, and neither its op recorder
   nor its rescue mode is on a stack. Only a session with a budget (a lifecycle that plans).
2. Standing aside (:meth:`StandAside.stand`, on the ``with``'s thread, at that step's first module
   or save): the session's global module hooks are removed and its saved-tensor hooks popped
   (only where they are the innermost: a script's own, pushed since, would be popped instead, so
   the session then stays); what the step saved before that point stays the session's and
   unpacks as ever. The steps are then PyTorch's: every tensor kept, as the plan kept it, and
   autograd checks each saved tensor's version itself.
3. It watches from one forward pre-hook on the root: the outermost module running when the last
   step's first leaf module ran (the model), or that leaf where none ran it (a copy of the root
   made meanwhile, an EMA model's, gets a watch that removes itself at its first call). At each of the
   root's calls with grad mode on, on the ``with``'s thread, the session comes back where its
   device's caching allocator flushed its cache since the last call (the plan's memory no longer
   fits: :meth:`watch` reads the flush count once a call) or the root's first tensor argument has
   another shape, dtype or device than when it stood aside (another batch: another plan). Under
   ``torch.compile`` the hook refuses (compiled.py), as the session's hooks do.
4. Coming back (:meth:`StandAside.come_back`): the watch is removed and, inside the session's
   ``with``, its hooks installed again at that root call; outside it (a fitted model's forward
   enters the session inside the root's call), its next ``with`` installs them. The lifecycle
   then watches the steps as before (the flushes it sees again lower the plan); the steps that
   ran aside are none of its steps.
5. The ``with``'s exit, and the session's end, leave no hook of the session's behind: while
   standing aside the watch stays across a fitted model's ``with`` (each forward enters it
   anew), and the outermost exit of a session entered once for the process removes it.
"""

from __future__ import annotations

import torch

from .compiled import refuse_if_compiling
from .lifecycle import PLANNED, WATCHING
from .planner import KEEP

#: the settled steps, each ending ok without a flush under the same keep-everything modes, after
#: which the session stands aside (:data:`~.planner.WATCH_STEPS` steps after a trial, and as
#: many again: a plan whose caching allocator is still settling flushes within them)
QUIET_STEPS = 8

_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def input_signature(args) -> tuple | None:
    """The root call's first tensor argument's shape, dtype and device (None: no tensor)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype, value.device
    return None


class _Watch:
    """The root's forward pre-hook while the session stands aside (rule 3): its
    :meth:`StandAside.watch`. A copy of the module (``copy.deepcopy``, an EMA copy; a pickle)
    copies its hooks: the copy's watch has no session, and removes itself at its first call."""

    __slots__ = ("aside",)

    def __init__(self, aside):
        self.aside = aside

    def __call__(self, module, args):
        if self.aside is None:
            hooks = module._forward_pre_hooks
            for key in [key for key, hook in hooks.items() if hook is self]:
                del hooks[key]
            return None
        return self.aside.watch(module, args)

    def __deepcopy__(self, memo):
        return _Watch(None)

    def __reduce__(self):
        return _Watch, (None,)


class StandAside:
    """Whether and when ``session`` (an :class:`~.offload_session.OffloadSession`) stands aside,
    and the watch that brings it back (the module docstring's rules). ``on``: False never
    stands aside."""

    def __init__(self, session, on: bool = True):
        self.session = session
        self.on = on
        self.standing = False
        self.root = None          # the module the watch hooks (rule 3)
        self.stood_aside = 0      # times the session stood aside, and came back
        self.came_back = 0
        self._quiet = 0           # rule 1's steps so far
        self._modes = None        # the settled modes the next step runs (None: not such)
        self._flushes: dict = {}  # the links' flush counts at the last step's end
        self._watch = None        # the root's hook handle
        self._signature = None
        self._watch_flushes = None

    # --- rule 1 ---------------------------------------------------------------------------------
    def step_ended(self, failed: bool) -> None:
        """The session's step ended (``failed``: it raised, or ran out of memory) and the
        lifecycle decided the next one: the step counts towards rule 1 where it ran under the
        settled modes the step before decided, keeping everything, and the next runs them too."""
        session = self.session
        lifecycle = session.lifecycle
        counts = {link: link.flushes() for link in session._links_in_use()}
        flushed = any(count > self._flushes.get(link, count) for link, count in counts.items())
        self._flushes = counts
        ran = self._modes
        modes = session.modes
        settled = (lifecycle.budget is not None and lifecycle.state in (WATCHING, PLANNED)
                   and lifecycle.trial is None and not lifecycle.awaiting and modes is not None
                   and KEEP in modes and all(mode == KEEP for mode in modes))
        self._modes = list(modes) if settled else None
        if ran is not None and not failed and not flushed and self._modes == ran:
            self._quiet += 1
        else:
            self._quiet = 0

    def due(self) -> bool:
        """Rule 1: the session may stand aside at this step's start."""
        session = self.session
        return (self.on and not self.standing and self._quiet >= QUIET_STEPS
                and session.stage is None and session._staged is None and session.force is None
                and session.trace is None and session.lender.plan is None
                and session._cached is None and not session._offload_rest
                and not session.rescuer.armed and session.recorder.ops is None
                and session._hooks is not None and session.on_with_thread()
                and torch._C._len_torch_function_stack() == session._function_modes_below
                and self._hooks_innermost())

    def _hooks_innermost(self) -> bool:
        """The session's saved-tensor hooks are the innermost pushed (rule 2)."""
        if _TOP_HOOKS is None:   # an older PyTorch: the stack cannot be read, so never
            return False
        top = _TOP_HOOKS(False)
        return top is not None and top[0] == self.session._pack and \
            top[1] == self.session._unpack

    # --- rule 2 ---------------------------------------------------------------------------------
    def stand(self, root, signature) -> None:
        """Stands aside now, watching from ``root``'s calls (``signature``: the
        :func:`input_signature` of its call running now, the step's first, which the watch
        compares later ones with)."""
        session = self.session
        for handle in session._handles:
            handle.remove()
        session._handles = []
        session._hooks.__exit__(None, None, None)
        session._hooks = None
        session._containers = []
        self.standing, self.root = True, root
        self.stood_aside += 1
        self._quiet = 0
        self._signature = signature
        self._watch_flushes = self._flush_counts()
        self._watch = root.register_forward_pre_hook(_Watch(self))
        session._event("aside", session.steps)

    def _flush_counts(self) -> tuple:
        return tuple(link.flushes() for link in self.session._links_in_use())

    # --- rules 3 and 4 ----------------------------------------------------------------------------
    def watch(self, module, args):
        """The root's forward pre-hook while the session stands aside (rule 3)."""
        refuse_if_compiling("a mucudnn.torch session's watch")
        if not torch.is_grad_enabled() or not self.session.on_with_thread():
            return None
        flushes = self._flush_counts()
        if flushes != self._watch_flushes or input_signature(args) != self._signature:
            self.come_back()
        return None

    def come_back(self) -> None:
        """Rule 4: the watch removed and, inside the ``with``, the session's hooks installed."""
        if not self.standing:
            return
        self.standing = False
        self.came_back += 1
        self._remove_watch()
        session = self.session
        session._event("back", session.steps)
        if session._depth > 0:
            session._install_hooks()

    def _remove_watch(self) -> None:
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    # --- rule 5 -----------------------------------------------------------------------------------
    def leave(self, ended: bool) -> None:
        """The session's outermost ``with`` is left; ``ended``: for good (a session entered once
        for the process), not a fitted forward's, which the next forward enters again."""
        if ended and self.standing:
            self.standing = False
            self._remove_watch()
