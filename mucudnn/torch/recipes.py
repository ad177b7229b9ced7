"""The recipes of mucudnn.torch's offload session: the recomputable calls (at most
:data:`MAX_CHAIN`) that rebuild a saved tensor from the step's saved groups, found from the calls
:class:`~.recorder.StepRecorder` recorded (:meth:`RecipeFinder.recipe`), and the aliases a recipe
starts from where a module saved a view of its input (:meth:`RecipeFinder.alias`). A recipe is
found only where it holds: each call it reruns left the tensor it read at the version read, and
each of its sources is a group saved at that version (records.py keeps the rules of the records
these read)."""

from __future__ import annotations

import bisect
import weakref

import torch

from .records import (MAX_POOLS, _Alias, _Call, _Group, _Read, _Recipe, _Step, _ViewOf,
                      _same_elements)

#: the most calls (modules and ops) one recipe reruns from its sources
MAX_CHAIN = 4


class RecipeFinder:
    """Finds the recipes and aliases of the session's steps from the calls its recorder recorded.
    ``session``: the :class:`~mucudnn.torch.offload_session.OffloadSession` that owns it (its
    step and groups, :meth:`~.saved_tensors.SavedTensorHooks._find`)."""

    def __init__(self, session):
        self.session = session

    def recipe(self, tensor: torch.Tensor, step: _Step) -> _Recipe | None:
        """The recomputable calls (at most ``MAX_CHAIN``) that rebuild ``tensor`` as it is now
        from saved groups, or None."""
        recipe, calls = _Recipe(), step.calls
        # An in-place module (ReLU(inplace=True)) saves its output, the tensor it was given, while
        # it runs: it ends the recipe, and what made its input (batch norm, an add) comes before.
        index, running = self._running_module(step)
        if _changes_in_place(running, tensor):
            if not running.recomputable:
                return None
            slot = self._rebuild(step, recipe, tensor, running.reads[0], index, own=True, depth=1)
            if slot is None:
                return None
            recipe.calls.append(running)
            recipe.inputs.append((slot,))
            return recipe
        # A max pooling saves the indices of its maxima, made by no call: the pooling rebuilds
        # them from its input, as it rebuilds its output
        if running is not None and tensor.dtype is torch.int64 and \
                _pool_indices(running, tensor):
            read = running.reads[0]
            slot = self._rebuild(step, recipe, read.ref(), read, index, depth=1)
            if slot is None:
                return None
            recipe.calls.append(running)
            recipe.inputs.append((slot,))
            recipe.indices = True
            return recipe
        now = _Read.of(tensor)
        if self._rebuild(step, recipe, tensor, now, len(calls), own=True) is not None:
            return recipe
        # An instance norm saves its input C reshaped, a view made inside it: no call output that
        # view, but C's maker (the convolution) rebuilds C, viewed back as saved; only where the
        # view holds C as the module was given it (the view shares C's version counter: a
        # module changing it in place before saving it, ``sigmoid_``, saves another value)
        read = self._viewed_input(running, tensor)
        if read is None or tensor._version != read.version:
            return None
        recipe = _Recipe(view=(tuple(tensor.shape), tuple(tensor.stride())))
        if self._rebuild(step, recipe, read.ref(), read, index, own=True) is None:
            return None
        return recipe

    @staticmethod
    def _running_module(step: _Step) -> tuple[int | None, _Call | None]:
        """The leaf module call whose forward is running now (its index and itself), or
        (None, None)."""
        calls = step.calls
        for index in range(len(calls) - 1, -1, -1):   # most often the last: a loop, no generator
            call = calls[index]
            if call.module is not None:
                return (None, None) if call.done else (index, call)
        return None, None

    def alias(self, step: _Step, group: _Group, tensor: torch.Tensor) -> None:
        """When ``tensor``, saved as ``group``, is a view of the running module's first input
        ``C`` over exactly C's elements, both contiguous (an instance norm's ``(1, N*C, ...)``
        view of the convolution's output): ``group`` holds C's values, for recipes that read C
        once its own object is gone (:attr:`_Step.by_view`)."""
        running = self._running_module(step)[1]
        read = self._viewed_input(running, tensor)
        if read is None:
            return
        step.view_savers.add(id(running.module))
        source = read.ref()
        step.by_view[id(read.ref)] = _Alias(
            read.ref, _ViewOf(group, tuple(source.shape), tuple(source.stride())))

    @staticmethod
    def _viewed_input(running: _Call | None, tensor: torch.Tensor) -> _Read | None:
        """The read of ``running``'s first input ``C`` where ``tensor`` is another view of
        exactly C's elements, both contiguous (:func:`_same_elements`), else None."""
        if running is None or not running.reads:
            return None
        read = running.reads[0]
        return read if _same_elements(read.ref(), tensor) else None

    @staticmethod
    def _made_by(step: _Step, made, before: int) -> int | None:
        """The index of the last call before ``calls[before]`` that returned ``made``: a tensor,
        or the weak reference of a freed one (None: no such call)."""
        ref = made if isinstance(made, weakref.ref) else weakref.ref(made)
        indices = step.outputs.get(id(ref), ())
        at = bisect.bisect_left(indices, before)
        return indices[at - 1] if at else None

    @staticmethod
    def _view_source(step: _Step, read: _Read) -> _ViewOf | None:
        """The :class:`_ViewOf` slot that reads ``read``'s tensor from a group saved as a view of
        it (:meth:`_alias`), where that group is live and at the read's version, else None."""
        alias = step.by_view.get(id(read.ref))
        if alias is None or alias.ref is not read.ref:
            return None
        group = alias.view.group
        if group.live_packs == 0 or group.version != read.version:
            return None
        return alias.view

    def _rebuild(self, step: _Step, recipe: _Recipe, tensor, read: _Read, before: int,
                 own: bool = False, depth: int = 0):
        """Where ``recipe`` gets ``tensor`` (None once freed) at the version of ``read``: a saved
        group of it at that version (a source), else a saved view over its elements at that
        version (a :class:`_ViewOf` of its source group), else the recomputable
        call before ``calls[before]`` that made it so, appended after what rebuilds its own
        reads (that call's index in the recipe); None where none exists. ``own``: the tensor
        being saved, or an in-place call's input (the tensor it changed): not a source, since
        the group of that tensor holds its later version. ``depth``: calls waiting for this one
        (each counts against ``MAX_CHAIN``)."""
        if not own:
            if tensor is not None:
                group = self.session._find(step, tensor)
            else:                  # freed: its group (if saved), by its weak reference
                group = step.by_ref.get(id(read.ref))
                if group is not None and (group.ref is not read.ref or group.live_packs == 0):
                    group = None   # let go (a graph dropped during the forward)
            if group is not None:
                # a group of it at another version holds another value (a change by no call,
                # ``identity.mul_(2)``, or after the read)
                return group if group.version == read.version else None
            # none of its own: a group saved as a view of it (an instance norm's input), where
            # the recipe starts instead of rerunning what made it (the convolution)
            view = self._view_source(step, read)
            if view is not None:
                return view
        calls = step.calls
        # the last call before ``before`` that output ``tensor``: it must have left it at the
        # version read (an op or module that changed it since, recorded or not, made another
        # value). A freed tensor is that call's output by its weak reference (one per object:
        # an instance norm saves a reshaped view of its input, whose own object is gone).
        index = self._made_by(step, tensor if tensor is not None else read.ref, before)
        if index is None:
            return None
        call = calls[index]
        if not call.recomputable or not call.reads or call.output_version != read.version or \
                call in recipe.calls or len(recipe.calls) + depth >= MAX_CHAIN:
            return None
        slots = []
        for input_read in call.reads:
            source = input_read.ref()
            slot = self._rebuild(step, recipe, source, input_read, index,
                                 own=source is not None and source is tensor, depth=depth + 1)
            if slot is None:
                return None
            slots.append(slot)
        if len(recipe.calls) + depth >= MAX_CHAIN:
            return None
        recipe.calls.append(call)
        recipe.inputs.append(tuple(slots))
        return len(recipe.calls) - 1




def _pool_indices(call: _Call, tensor: torch.Tensor) -> bool:
    """``tensor``, an int64 tensor saved while ``call`` (a running module's) runs, is the indices
    its max pooling (:data:`MAX_POOLS`, its forward PyTorch's: an exact type without hooks of its
    own) saves with its input, which it keeps to itself (``return_indices`` False): as many
    dimensions as the input, the same leading ones (batch, channels), on its device."""
    module = call.module
    pooling = MAX_POOLS.get(type(module))
    if pooling is None or not call.recomputable or module.return_indices or not call.reads:
        return False
    source = call.reads[0].ref()
    spatial = pooling[1]
    return source is not None and source is not tensor and source.dim() == tensor.dim() and \
        source.dim() > spatial and source.shape[:-spatial] == tensor.shape[:-spatial] and \
        source.device == tensor.device


def _changes_in_place(call: _Call | None, tensor: torch.Tensor) -> bool:
    """``call`` (a running module's) changes ``tensor``, its first input, in place:
    ReLU(inplace=True) saves its output, the tensor it was given."""
    return call is not None and call.in_place and bool(call.reads) \
        and call.reads[0].ref() is tensor
