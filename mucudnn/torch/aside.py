"""A session standing aside (docs/torch.md, "Standing aside"): where the plan in force keeps every
saved tensor, a step under it is PyTorch's own step plus the session's hooks, a Python call at
every module and every save that changes nothing (ResNet-152 N=128 on an H200: 1.18-1.23x
PyTorch's step with them, 1.00x standing aside: benchmarks/results/plan-accuracy). Once such a
plan has run settled, the session removes its hooks, watches the module calls from one global
hook, and comes back where the steps change.

Rules:

1. Due at a step's start (the step before ended, :meth:`StandAside.step_ended`) once the last
   :data:`QUIET_STEPS` steps ended under the same modes, each settled (watched or planned: no
   trial, no plan being made), keeping every group, ending ok, and flushing the caching
   allocator's cache in none of them; and where the session stages nothing, lends nothing,
   forces nothing, traces nothing, arms no rescue for the next step, and neither its op recorder
   nor its rescue mode is on a stack. Only a session with a budget (a lifecycle that plans).
2. Standing aside (:meth:`StandAside.stand`, on the ``with``'s thread, at that step's first leaf
   module call): the session's global module hooks are removed and its saved-tensor hooks popped
   (only where they are the innermost: a script's own, pushed since, would be popped instead, so
   the session then stays); what the step saved before that point stays the session's and
   unpacks as ever. The steps are then PyTorch's: every tensor kept, as the plan kept it, and
   autograd checks each saved tensor's version itself.
3. It watches from one global forward pre-hook (a Python call at each module call; none of the
   model's own hooks, so copies, pickles and scripts of the model carry nothing of the
   session's). At each module call with grad mode on, on the ``with``'s thread, the session
   comes back where the call is the root's (the outermost module running when the step's first
   leaf module ran: the model; or that leaf where none ran it) and the caching allocator flushed
   its cache since the root's last call (the plan's memory no longer fits: the flush count is
   read once a root call) or the root's first tensor argument has another shape, dtype or
   device than in the step it stood aside at (another batch; a root called with keyword
   tensors alone is watched for flushes alone); or where a module with parameters that is none
   of the root's runs (the script trains another model, which the session would plan). Under
   ``torch.compile`` the hook refuses (compiled.py), as the session's hooks do.
4. Coming back (:meth:`StandAside.come_back`) installs the session's hooks again, at that module
   call, only where the stacks are as the session left them: its ``with`` entered (a fitted
   model's forward enters it inside the root's call: its next ``with`` installs them), no
   backward running, the saved-tensor hooks' innermost the one that was under the session's,
   the torch function modes as many as below them; else it waits for a later call. Hooks that
   cannot be pushed (inside ``torch.func``'s transforms) leave it aside, to try again. The
   lifecycle then watches the steps as before (the flushes it sees again lower the plan); the
   steps that ran aside are none of its steps. A session that came back :data:`MOST_RETURNS`
   times in a row within :data:`QUIET_STEPS` root calls of standing aside stands aside no more
   (a loop that alternates models or input sizes within a step); a return after a longer stretch
   aside (an epoch's last, smaller batch) starts that count again.
5. The ``with``'s exit, and the session's end, leave no hook of the session's behind: while
   standing aside the watch stays across a fitted model's ``with`` (each forward enters it
   anew), and the outermost exit of a session entered once for the process removes it.
"""

from __future__ import annotations

import torch

from .compiled import refuse_if_compiling
from .lifecycle import PLANNED, WATCHING
from .planner import KEEP
from .recorder import _current_node

#: the settled steps, each ending ok without a flush under the same keep-everything modes, after
#: which the session stands aside (:data:`~.planner.WATCH_STEPS` steps after a trial, and as
#: many again: a plan whose caching allocator is still settling flushes within them)
QUIET_STEPS = 8

#: the quick returns (each within :data:`QUIET_STEPS` root calls of standing aside) in a row
#: after which a session stands aside no more (rule 4)
MOST_RETURNS = 3

_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


def input_signature(args) -> tuple | None:
    """The first tensor among a call's positional arguments (or in a list or tuple among them): its
    shape, dtype and device; None where there is none."""
    for value in args:
        if isinstance(value, (list, tuple)):
            value = next((item for item in value if isinstance(item, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            return tuple(value.shape), value.dtype, value.device
    return None


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
        self._quick_returns = 0   # rule 4's, in a row
        self._root_calls = 0      # the root's calls (grad mode on) since it stood aside
        self._quiet = 0           # rule 1's steps so far
        self._modes = None        # the settled modes the next step runs (None: not such)
        self._flushes: dict = {}  # the links' flush counts at the last step's end
        self._watch = None        # the global pre-hook's handle
        self._signature = None    # the root's first call's input (rule 3)
        self._members: frozenset = frozenset()   # the ids of the root's modules
        self._watch_flushes = None
        self._hooks_below = None  # the saved-tensor hooks under the session's (rule 4)

    # --- rule 1 ---------------------------------------------------------------------------------
    def step_ended(self, failed: bool) -> None:
        """The session's step ended (``failed``: it raised, or ran out of memory) and the
        lifecycle decided the next one: the step counts towards rule 1 where it ran under the
        settled modes the step before decided, keeping everything, and the next runs them too
        (its flushes: the counts the lifecycle was told)."""
        session = self.session
        lifecycle = session.lifecycle
        flush_counts = lifecycle.flush_counts
        flushed = any(count > self._flushes.get(link, count)
                      for link, count in flush_counts.items())
        self._flushes = flush_counts
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
                and self._quick_returns < MOST_RETURNS
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
        """Stands aside now, watching ``root``'s calls (``signature``: the
        :func:`input_signature` of its call running now, the step's first, which the watch
        compares later ones with; None: its first watched call's)."""
        session = self.session
        for handle in session._handles:
            handle.remove()
        session._handles = []
        session._hooks.__exit__(None, None, None)
        session._hooks = None
        session._containers = []
        self._hooks_below = _TOP_HOOKS(False)
        self.standing, self.root = True, root
        self.stood_aside += 1
        self._quiet = self._root_calls = 0
        self._signature = signature
        self._members = frozenset(id(module) for module in root.modules())
        self._watch_flushes = session._flush_counts_now()
        self._watch = torch.nn.modules.module.register_module_forward_pre_hook(self.watch)
        session._event("aside", session.steps)
        if self.stood_aside == 1:
            session.say("the offload plan keeps every saved tensor and ran settled: the session "
                        "removed its hooks, and the steps run as PyTorch's own until the "
                        "model's input changes or the caching allocator flushes (it comes back "
                        "then)")

    # --- rules 3 and 4 ----------------------------------------------------------------------------
    def watch(self, module, args):
        """The global forward pre-hook while the session stands aside (rule 3): at every module
        call, so the root's test comes first and costs a comparison."""
        if module is not self.root:
            if module._parameters and id(module) not in self._members and \
                    torch.is_grad_enabled() and self.session.on_with_thread():
                self.come_back("another model trains")
            return None
        # the root's call, traced by dynamo before its modules': a compiled model is refused
        refuse_if_compiling("a mucudnn.torch session's watch")
        if not torch.is_grad_enabled() or not self.session.on_with_thread():
            return None
        self._root_calls += 1
        signature = input_signature(args)
        if self._signature is None:   # the first call aside (a keyword-only root: every one)
            self._signature = signature
        if self.session._flush_counts_now() != self._watch_flushes:
            self.come_back("the caching allocator flushed its cache")
        elif signature != self._signature:
            self.come_back("the model's input changed")
        return None

    def come_back(self, why: str) -> None:
        """Rule 4: the session's hooks installed again where the stacks are as it left them, the
        watch removed, and ``why`` said in one line; else nothing (a later call tries again)."""
        session = self.session
        if not self.standing or not self._stacks_as_left():
            return
        if session._depth > 0:
            try:
                session._install_hooks()
            except RuntimeError:   # hooks disabled here (torch.func): aside, for now
                return
        self.standing = False
        self.came_back += 1
        self._quick_returns = self._quick_returns + 1 if self._root_calls <= QUIET_STEPS else 0
        self._remove_watch()
        session._event("back", session.steps)
        more = "" if self._quick_returns < MOST_RETURNS else \
            f"; back {MOST_RETURNS} times in a row soon after it stood aside, it stands aside " \
            "no more"
        session.say(f"{why}: the session's hooks are back{more}")

    def _stacks_as_left(self) -> bool:
        """Outside the ``with``, or inside it with no backward running and the saved-tensor
        hooks and torch function modes as the session left them when it stood aside."""
        session = self.session
        if session._depth == 0:
            return True
        return _current_node() is None and _TOP_HOOKS(False) == self._hooks_below and \
            torch._C._len_torch_function_stack() == session._function_modes_below

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
