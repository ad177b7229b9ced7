"""The offload session's saved-tensor hooks (docs/torch.md): autograd's pack hook, which makes a
group of each tensor the step saves (or passes it through) and keeps, offloads or marks it for
recomputation as the step's modes say, and its unpack hook, which hands each group back (kept,
fetched, prefetched on the plan's schedule, or rebuilt by its recipe) and keeps the step's clock
of unpacks. :class:`SavedTensorHooks` is a part of
:class:`~mucudnn.torch.offload_session.OffloadSession`, which owns the state these read: its step,
links, recorder, copies, rescuer, modes and plan (the module docstring of offload_session.py
states the invariants they keep).

Rules:

1. A parameter, a view of one, a one-dimensional leaf (a buffer), a tensor under ``min_bytes``, a
   tensor of another layout than strided, and every save in a backward or a recipe's rerun pass
   through (:class:`~.records._Passed`): autograd keeps them, and the unpack checks their
   version as autograd would.
2. Every pack of the same tensor object at the same version is one group (found by the tensor's
   address, shape, strides, dtype and device, and its weak reference); group ``g`` is the
   ``g``-th the step saves.
3. A group's mode is the plan's for it where it can be carried out, else kept: an offload needs a
   dense tensor, a recomputation a recipe whose sources are not offloaded.
4. The unpack of a group of an ended step restores it on demand, outside any step's clock.
"""

from __future__ import annotations

import weakref
from time import perf_counter

import torch
import torch.nn as nn

from .compiled import refuse_if_compiling
from .link import SameMemoryLink, dense
from .planner import KEEP, OFFLOAD, RECOMPUTE
from .records import _SEQUENCE_NR, _Group, _Packed, _Passed, _rebuild_order, recompute
from .recorder import _current_node, _in_backward, _in_place
from .replay import node_number, replayed


def autograd_keeps(tensor: torch.Tensor, min_bytes: int) -> bool:
    """Rule 1: ``tensor``, saved outside a backward and a rerun, is autograd's to keep, no group
    of the session's (the first test of every pack)."""
    # nn.Parameter's isinstance is a Python metaclass call: a tensor of type Tensor is none.
    # A leaf of one dimension without grad is a module's buffer (batch norm's running
    # statistics, which a later train-mode forward changes in place without a version bump,
    # and which an eval-mode backward reads as they are then): autograd keeps it, as ever.
    # A view of a parameter (a linear layer saves its weight transposed) holds none of its
    # own memory: moving it frees nothing. A tensor of another layout than strided (sparse,
    # mkldnn) has no address to key it by.
    base = tensor._base
    return tensor.is_leaf and (tensor.requires_grad or tensor.dim() <= 1) or (
        type(tensor) is not torch.Tensor and isinstance(tensor, nn.Parameter)) or \
        tensor.layout is not torch.strided or tensor.nbytes < min_bytes or \
        base is not None and base.is_leaf and base.requires_grad


class SavedTensorHooks:
    """Autograd's pack (:meth:`_pack`) and unpack (:meth:`_unpack`) hooks of an
    :class:`~mucudnn.torch.offload_session.OffloadSession`, and the rebuilding of recomputed
    groups."""

    @staticmethod
    def _key(tensor):
        # torch.Size is a tuple (same hash, equal to the tuple of its sizes) and ``stride()`` one;
        # the address of its first element is its storage's and its offset's in one read
        return (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype, tensor.device)

    def _find(self, step, tensor, key=None):
        """The live group of ``tensor`` (``key``: its :meth:`_key`, where known): one whose packs
        were all freed (a graph dropped during the forward) gave its device and host tensors up,
        so saving the tensor again starts a new group."""
        if key is None:
            # each group's ``ref`` is its tensor's weak reference (the one CPython hands out
            # while it lives) and ``by_ref`` names every group by it: a tensor none names has no
            # group, and no key to make
            if id(weakref.ref(tensor)) not in step.by_ref:
                return None
            key = self._key(tensor)
        group = step.by_key.get(key)
        if group is not None and group.ref() is tensor and group.version == tensor._version \
                and group.live_packs > 0:
            return group
        return None

    def _pack(self, tensor: torch.Tensor):
        # run as :func:`_past_the_op_recorder` runs the module hooks, spelled out (at every save:
        # a Python call fewer); torch.compiler.is_compiling() by its own name, as dynamo needs
        if torch.compiler.is_compiling():
            refuse_if_compiling("a mucudnn.torch session's pack hook")
        # a parameter or a buffer (:meth:`_group_for`'s first test, read before the op recorder
        # is set aside: inside a leaf module, where most saves are, it is aside already), where
        # no copy waits for a save: most of a step's saves, passed at the least cost
        if tensor.is_leaf and (tensor.requires_grad or tensor.dim() <= 1) and \
                not self._step.pending:
            return _Passed(tensor)
        if self.recorder.ops is None:
            group = self._group_for(tensor)
            return _Passed(tensor) if group is None else _Packed(group, group.owner)
        with torch._C.DisableTorchFunction():
            group = self._group_for(tensor)
            return _Passed(tensor) if group is None else _Packed(group, group.owner)

    def saves_as_group(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``, saved in a step's forward, would be a group of the session's
        (rule 1, and a device the session moves)."""
        return not autograd_keeps(tensor, self.min_bytes) and self.link_for(tensor) is not None

    def _group_for(self, tensor: torch.Tensor) -> _Group | None:
        # a rerun, or inside a backward (_in_backward, without its call): a checkpoint's
        # recomputation is not ours
        if self._rerunning or _current_node() is not None:
            return None
        if self._step.pending:
            self.copies.copy_pending(self._step, _SEQUENCE_NR())
        if autograd_keeps(tensor, self.min_bytes):
            return None
        link = self.link_for(tensor)
        if link is None:
            return None
        link.poll()   # offloaded tensors whose copies are done go back now, not at the next offload
        step = self._step
        if not step.live or step.unpacks or self._empty_cache_due:   # as in :meth:`_before_module`
            self._at_step_start()
        if self._cache_due:
            self._look_up_plan(tensor.device)
        step = self._step
        key = self._key(tensor)
        group = self._find(step, tensor, key)
        if group is None:
            group = self._new_group(step, tensor, link, key)
        group.packs += 1
        return group

    def _new_group(self, step, tensor, link, key) -> _Group:
        gid = len(step.groups)
        if not gid:
            step.host_start = perf_counter()
        if step.releases:   # most steps move nothing
            self.copies.let_go_due(step, gid)
        if step.ooms is None:
            step.ooms = link.ooms()
        recorder = self.recorder
        if recorder.finds_recipes(step):
            # the node a later recipe's graph names this group by (replay.py, rule 3)
            if self.on_with_thread():
                step.nodes[gid] = node_number(tensor)
            else:
                step.foreign = True
        recipe = None
        if recorder.may_recompute(step, gid):
            template = step.replays.get(gid) if step.replays is not None else None
            if template is not None:
                recipe = replayed(template, tensor, step, _in_place) if not step.foreign else None
            elif step.replays is not None:   # its modules' calls are recorded (replay.py)
                recipe = recorder.recipes.recipe(tensor, step)
            else:
                recipe = recorder.recipes.recipe(tensor, step)
                if recipe is not None:
                    recorder.learn_template(step, gid, recipe, tensor)
        base = tensor._base
        group = _Group(gid, KEEP, tensor.nbytes, tensor.device,
                       weakref.ref(tensor), tensor._version, "", dense(tensor),
                       recipe=recipe, step_ref=weakref.ref(step),
                       base=weakref.ref(base) if base is not None else None,
                       saved_seq=_SEQUENCE_NR())
        # named from its calls (a step without them, or recording only its recipes': unnamed)
        if recipe is not None:
            group.producer = recipe.producer
        elif step.records_only is None and recorder.records_calls(step):
            group.producer = recorder.producer(step, tensor)
        if self._cached is not None:   # the first step under a cached plan: is it the same?
            self._check_cached_group(step, group)
        group.wanted = self._wanted(group)
        group.mode = self._mode_for(group)
        step.groups.append(group)
        step.by_key[key] = group
        step.by_ref[id(group.ref)] = group
        if recorder.finds_recipes(step) and step.replays is None:
            recorder.recipes.alias(step, group, tensor)
        if step.profiling:
            if gid == 0:
                # no device kept behind in a first recording step: online tuning synchronizes
                # there (every new convolution measured), so the device catches up at each, and
                # its times are not the profile's anyway (the least of the recording's steps are)
                link.start_timing(leads=self.lifecycle.recorded_steps > 0)
            link.keep_device_behind()
            group.pack_mark = link.mark()
            step.marks.append(("pack", gid, group.pack_mark, link.allocated(),
                               self.recorder.peak(link)))
        if self.trace is not None:
            self._event("pack", gid, group.mode)
        if group.mode == OFFLOAD:
            # copied once the op saving it has run (:meth:`.host_copies.StepCopies.copy_pending`)
            step.pending.append((group, tensor, _SEQUENCE_NR()))
        elif group.mode == KEEP:
            if self.copies.keeps_apart(step, group):   # a copy: once the op has run, as an offload
                step.pending.append((group, tensor, _SEQUENCE_NR()))
            else:
                group.tensor = tensor.detach()
                group.kept_version = group.tensor._version
        else:
            for source in recipe.sources:
                source.readers += 1
        if self.lender.plan is not None and not step.profiling:
            self.lender.at_point(self.lender.plan.forward, gid, group.device)
        return group

    def _mode_for(self, group: _Group) -> str:
        """The wanted mode where it can be carried out (else kept)."""
        wanted = group.wanted
        if wanted == OFFLOAD and not group.offloadable:
            return KEEP
        if wanted == RECOMPUTE:
            if group.recipe is None:
                return KEEP
            for source in group.recipe.sources:   # a loop, no generator: at every new group
                if source.mode == OFFLOAD:
                    return KEEP
        return wanted

    def _wanted(self, group: _Group) -> str:
        wanted = KEEP
        if self.force is not None:
            wanted = self.force
        elif self._step.profiling or self._offload_rest:
            wanted = OFFLOAD
        elif (modes := self.modes) is not None:   # each read once: the lifecycle's attributes
            profile = self.profile
            if group.gid < len(modes) and (profile is None or (
                    group.gid < len(profile.groups)
                    and profile.groups[group.gid].nbytes == group.nbytes)):
                wanted = modes[group.gid]
            elif not self._mismatch_said:
                self._mismatch_said = True
                self.say(f"this step saves other tensors than the profiled one (group "
                         f"{group.gid}); keeping those")
        return wanted

    def _unpack(self, packed):
        if not isinstance(packed, _Packed):
            return packed.check() if isinstance(packed, _Passed) else packed
        group, step = packed.group, packed.step
        if step.pending:   # its forward is over: every op saving a pending group has run
            self.copies.copy_pending(step)
        group.check_version()
        if step is not self._step:
            # a graph of a step that has ended (a forward kept for later, its backward after
            # the next step's): its group is restored as ever, and is no part of this step
            return self._restored(group)
        if self.rescuer.armed:
            self.rescuer.node()
        index = step.unpacks
        step.unpacks += 1
        if not index and step.host_start is not None:
            step.host_forward_ms = (perf_counter() - step.host_start) * 1e3
        link = self.link_for_group(group)
        link.poll()   # the forward's last offloads end during the backward
        if step.releases:   # the first unpack: the forward is over
            self.copies.let_go_due(step, None)
        peak_before = self.recorder.peak(link) if step.profiling else 0
        # autograd's final callback can only be queued from inside a backward (an unpack can also
        # come from Python reading ``grad_fn._saved_*``): at the first unpack inside one
        if not step.watching and _in_backward():
            step.watching = True

            def backward_done(step=step, link=link):
                step.backward_done = True
                self.lender.withdraw()
                # its graph may outlive it (``retain_graph``, nodes it never ran), holding
                # packs that hold the step: the step holds none of its nodes (:attr:`_Step.node`)
                step.node, step.node_groups = None, []
                if step.profiling:      # the backward's last ops follow its last unpack
                    step.end_mark = link.mark()
            _at_end_of_backward(backward_done)
        if group.first_unpack is None:
            group.first_unpack = index
        # what a node unpacked stays alive (autograd holds it) until the node is done, so in the
        # model its last unpack is the node's last
        node = _current_node()
        if node is None or node is not step.node:
            step.node, step.node_groups = node, []
        step.node_groups.append(group)
        for unpacked in step.node_groups:
            unpacked.last_unpack = index
        # a flush since the last read came in the op after the last unpack (the forward: before
        # the first), or in what that unpack fetched or rebuilt
        self._saw_flushes(step, link, index - 1)
        due = self._schedule.get(index)
        scheduled = [step.groups[gid] for gid in due if gid < len(step.groups)] if due else ()
        if group in scheduled:   # the one needed now goes first on the copy stream
            self.copies.prefetch(group, index)
        if group.mode == OFFLOAD and group.tensor is None and group.fetch is None:
            # on demand: not prefetched
            group.fetch = self.copies.copy(step, link, "h2d", group.nbytes, lambda: link.fetch(
                group.host, group.device, self.copies.inline(step)))
            self._event("fetch", group.gid, index)
        for other in scheduled:
            self.copies.prefetch(other, index)
        tensor = self._materialize(group, link)
        if self.lender.plan is not None and not step.profiling:
            self.lender.at_point(self.lender.plan.backward, index, group.device)
        if self.trace is not None:
            self._event("unpack", group.gid, index)
        if step.profiling:
            at = max(link.allocated(), self.recorder.peak(link))   # with this group fetched
            link.keep_device_behind()
            step.marks.append(("unpack", index, link.mark(), at, peak_before))
        group.unpacks += 1
        group.drop_device()    # a moved group's last unpack: autograd holds the rest of its use
        return tensor

    def _restored(self, group: _Group) -> torch.Tensor:
        """A group of an ended step, unpacked: its values, on demand (no schedule, no profile)."""
        link = self.link_for_group(group)
        if group.mode == OFFLOAD and group.tensor is None and group.fetch is None:
            group.fetch = link.fetch(group.host, group.device)
        tensor = self._materialize(group, link)
        group.unpacks += 1
        group.drop_device()
        return tensor

    def link_for_group(self, group):
        return self._link or self._links.get(group.device.index) or SameMemoryLink()

    def _materialize(self, group: _Group, link) -> torch.Tensor:
        if group.tensor is not None:
            return group.tensor
        if group.mode == OFFLOAD:
            group.tensor, group.fetch = link.wait(group.fetch), None
        elif group.mode == RECOMPUTE:
            # its recomputed sources not on the device first, each once (then held until its
            # own last unpack and while a recomputed group may read it: ``readers``); none of
            # theirs is moved meanwhile (rescue.py, rule 2)
            with self.rescuer.pinning(_rebuild_order(group)) as order:
                self._rebuild(order, link)
        return group.tensor

    def _rebuild(self, order: list[_Group], link) -> None:
        """The groups of a rebuild order (:func:`~.records._rebuild_order`) recomputed in turn,
        each one's sources that a rescue moved to the host fetched back first."""
        for rebuilt in order:
            original = rebuilt.ref()   # as autograd refuses a saved tensor changed in place
            if original is not None and original._version != rebuilt.version:
                raise RuntimeError(f"mucudnn.torch: saved tensor {rebuilt.gid} changed after "
                                   "it was saved; cannot recompute it")
            for source in rebuilt.recipe.sources:
                if source.mode == OFFLOAD and source.tensor is None:
                    source.tensor = link.wait(source.fetch or link.fetch(
                        source.host, source.device, self.copies.inline(rebuilt.owner)))
                    source.fetch = None
            rebuilt.tensor = self._recompute_group(rebuilt, link)

    def _recompute_group(self, group: _Group, link) -> torch.Tensor:
        """``group``'s tensor rebuilt by its recipe (:func:`~.records.recompute`); the session's
        hooks leave the rerun's modules and saves alone meanwhile."""
        self._rerunning = True
        try:
            tensor = recompute(group)
        finally:
            self._rerunning = False
        if self.trace is not None:
            self._event("recompute", group.gid,
                        tuple(source.gid for source in group.recipe.sources))
        return tensor


def _at_end_of_backward(callback) -> None:
    """Run ``callback`` when the running backward finishes without an error."""
    engine = getattr(torch.autograd.Variable, "_execution_engine", None)
    if engine is not None and hasattr(engine, "queue_callback"):
        engine.queue_callback(callback)
    else:   # no way to tell: take every backward as finished
        callback()
