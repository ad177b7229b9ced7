"""Recipes replayed from autograd's graph: what lets a steady planned step record no calls.

A planned step finds each recipe from the calls its module hooks and op recorder record
(recorder.py, recipes.py), which costs the host a Python record at every leaf module a recipe
runs and the op recorder at every torch function outside them. Once a step under the plan's
modes has found every recipe they need, the same recipes are checked in the later steps against
the graph autograd builds anyway, at the pack of each group the plan recomputes, and those steps
record nothing (benchmarks/results/host-overhead.md, "The floor under the session").

Rules:

1. A template (:class:`RecipeTemplate`) is made from a recipe found in a planned step that
   recorded its calls, where autograd's graph shows that recipe exactly: each call made one node
   (nn.Identity none: its node is its input's), the saved tensor's ``grad_fn`` the last call's,
   whose next edges are the call's inputs in order (the node of the call each reads, or the node
   a source group's tensor had at its pack) followed by the module's parameters (their
   ``AccumulateGrad`` nodes, or the nodes of tensors made in the step) and nothing else. It keeps
   each node's type and its saved arguments that are no tensors, each module's plain attributes,
   and the saved tensor's version. No template: a recipe through a view (``_ViewOf``, an
   instance norm's), a max pooling's indices, under autocast, through an eval-mode batch norm
   (its statistics are copied at its call) or a transposed convolution (its output size), from a
   source without a node (a tensor that does not require grad), through an op other than an add
   or a concatenation, or an op whose output is neither the saved tensor nor a group's.
2. A planned step replays where every group its modes recompute has a template or a recipe made
   of module calls only, learnt under the same modes (recorder.py, ``recorded_modules``). It
   records the calls of the modules whose output no pack shows ("watched": an output neither the
   saved tensor nor a group's, such as a downsample's batch norm before the residual add) and of
   the recipes with no template, and no other call, and leaves the op recorder off. The pack of a
   group the plan recomputes checks the saved tensor's graph against the group's template: rule
   1's edges against this step's groups and the module's parameters now, each node's type and
   arguments, each module's plain attributes as learnt, the saved tensor's version as learnt,
   each watched output alive at the version it was returned at, and each source group still at
   the version saved. Where it holds, the recipe is the template's calls on this step's groups,
   each module's state read at the pack (the same forward, after its call; the parameters are
   the tensors the graph shows); else the group is kept. Every group of the step is kept once a
   leaf module of a type not known to change nothing unseen returned its own input
   (:func:`passes_on_plainly`: ``.data`` may have changed it). A step that kept such a group has
   the next steps record their calls again, and the session never replays under those modes
   again.
3. Nodes are named by their sequence numbers (``Node._sequence_nr()``: per thread, never reused)
   and a source by its node's and its own output number (two chunks of one tensor share a
   node), read at each group's pack: the session holds no node (a node holds its saved tensors'
   packs, which hold their group: a cycle through autograd's C++ objects the collector cannot
   free). A step in which a module ran or a group was packed on another thread than the ``with``'s
   (which numbers its nodes apart) does not replay.
4. A step that replays runs lean (``OffloadSession._lean_allowed``) where the module hooks would
   do nothing else at its modules: no offload or copy kept apart (nothing to copy or poll
   between ops), no stage, rescue, lending, trace or cached plan to check, the op recorder off,
   a container running its first leaf module on the ``with``'s thread. From that leaf to the
   return of the outermost container then running (the root), a module call runs the hooks'
   short path: the whole one for a module whose calls the step records (rule 2), else a thread
   check, and at its return rule 2's test of a leaf returning its own input and
   ``recorder.module_returns`` where it returns a recorded call's output; containers are not
   stacked, so the stack is the root alone again at the short path's end (the root's return or
   call, a module called once the step's backward has begun, a step starting).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, itemgetter

import torch.nn as nn

from .records import _TRANSPOSED, CHEAP, _Call, _Group, _ModuleState, _Recipe, _Step

#: the ops a template may include, by the node each makes: the residual add (recorder.ADDS'
#: functions, in place or not) and a recorded concatenation (records._joined)
_OP_NODES = ("AddBackward0", "CatBackward0")


@dataclass(frozen=True, eq=False)
class _TemplateCall:
    """One call of a template: the module (or op) it reruns, as its recorded call ran it, and the
    type of the autograd node it made. ``watched``: its output is a tensor other than the saved
    one, whose version no later pack shows: a step that replays records its module's calls
    (rule 2)."""

    module: object            # the leaf module, or None for an op
    name: str
    op: object                # an op's function (None for a module)
    keywords: dict | None
    in_place: bool
    node: type | None         # the type of the autograd node it made (None: it made none)
    params: tuple             # the module's parameter names, as its recorded state named them
    watched: bool
    attributes: tuple         # the node's saved arguments that are no tensors (rule 2)
    #: the values of the module's own plain attributes, its mode among them, and what reads
    #: them from its ``__dict__`` (:func:`_hyperparameters`)
    hyper_values: tuple
    hyper_reader: object


@dataclass(frozen=True, eq=False)
class RecipeTemplate:
    """A recipe as calls on groups by number (rule 1): ``inputs[i]`` as a recipe's, each slot an
    int: an earlier call's index, or a source group ``g`` as ``-1 - g`` (:func:`_source_slot`);
    ``version``: the saved tensor's version at its pack."""

    calls: tuple
    inputs: tuple
    passes: tuple     # each call: it makes no node of its own (nn.Identity)
    version: int

    @property
    def watched_modules(self) -> set:
        """The ids of the modules whose calls a step that replays it records (rule 2)."""
        return {id(call.module) for call in self.calls if call.watched}


def _source_slot(gid: int) -> int:
    """A template's slot of the step's group ``gid`` (its tensor at the version saved); the
    group of a slot ``slot < 0`` is ``-1 - slot``."""
    return -1 - gid


def node_number(tensor) -> tuple[int, int] | None:
    """The sequence number of ``tensor``'s autograd node and which of its outputs it is (two
    chunks of one tensor share a node), or None (a leaf, no grad)."""
    node = tensor.grad_fn
    return None if node is None else (node._sequence_nr(), tensor.output_nr)


def _walk(inputs: tuple, passes: tuple, tensor, step: _Step, params) -> list | None:
    """The nodes of a recipe's calls (``inputs``: each call's slots), the last the saved
    ``tensor``'s, where the graph shows each call reading its slots and then its parameters
    (``params[i]``, in order) and nothing else (rule 1), else None. A call that ``passes`` its
    input on (nn.Identity) makes no node: its node is its input's. (At every pack of a group a
    step replays: no generators, each lookup once.)"""
    count = len(inputs)
    nodes: list = [None] * count
    outputs: list = [0] * count   # which output of its node each call's output is
    nodes[-1], outputs[-1] = tensor.grad_fn, tensor.output_nr
    numbers = step.nodes
    for index in range(count - 1, -1, -1):
        node = nodes[index]
        if node is None:
            return None
        slots = inputs[index]
        if passes[index]:
            slot = slots[0]
            if slot < 0:
                if (node._sequence_nr(), outputs[index]) != numbers.get(-1 - slot):
                    return None
            elif nodes[slot] is None:
                nodes[slot], outputs[slot] = node, outputs[index]
            else:
                return None
            continue
        if outputs[index]:   # a call's output is its node's only (first) one
            return None
        edges = node.next_functions
        row = params[index]
        taken = len(slots)
        if len(edges) < taken + len(row):
            return None
        for (edge, output), slot in zip(edges, slots):
            if slot < 0:
                if edge is None or (edge._sequence_nr(), output) != numbers.get(-1 - slot):
                    return None
            elif nodes[slot] is None:
                # each call's output is read once in a recipe
                nodes[slot], outputs[slot] = edge, output
            else:
                return None
        for param in row:
            # a parameter: its AccumulateGrad node; a tensor made in the step (a tied or
            # reparametrized weight): its own node
            edge = edges[taken][0]
            taken += 1
            if edge is None or getattr(edge, "variable", None) is not param and \
                    edge is not param.grad_fn:
                return None
        while taken < len(edges):
            if edges[taken][0] is not None:
                return None
            taken += 1
    return nodes


def template_of(recipe: _Recipe, tensor, step: _Step) -> RecipeTemplate | None:
    """The template of ``recipe``, just found for the saved ``tensor`` in a planned step that
    recorded its calls, where rule 1 allows one, else None."""
    if recipe.view is not None or recipe.indices:
        return None
    inputs = []
    for slots in recipe.inputs:
        row = []
        for slot in slots:
            if isinstance(slot, _Group):
                if step.nodes.get(slot.gid) is None:
                    return None
                row.append(_source_slot(slot.gid))
            elif isinstance(slot, int):
                row.append(slot)
            else:                      # a view of a group
                return None
        inputs.append(tuple(row))
    last = len(recipe.calls) - 1
    watched = []
    for index, call in enumerate(recipe.calls):
        if call.autocast:
            return None
        output = call.output() if call.output is not None else None
        watched.append(index < last and output is not tensor)
        if call.module is None:
            if watched[-1] or call.keywords and set(call.keywords) - {"alpha", "dim"}:
                return None
        elif call.state is None or call.state.running is not None or \
                type(call.module) in _TRANSPOSED:
            return None
    states = [call.state for call in recipe.calls]
    passes = tuple(type(call.module) is nn.Identity for call in recipe.calls)
    nodes = _walk(tuple(inputs), passes, tensor, step,
                  [tuple(state.params.values()) if state is not None else () for state in states])
    if nodes is None:
        return None
    calls = []
    for call, node, watch, passing in zip(recipe.calls, nodes, watched, passes):
        kind = None if passing else type(node)
        if call.module is None and (kind is None or kind.__name__ not in _OP_NODES):
            return None
        state = call.state
        calls.append(_TemplateCall(call.module, call.name, call.op, call.keywords,
                                   call.in_place, kind, tuple(state.params) if state else (),
                                   watch,
                                   _attributes(node) if kind is not None else (),
                                   *_hyperparameters(call.module)))
    return RecipeTemplate(tuple(calls), tuple(inputs), passes, tensor._version)


def replayed(template: RecipeTemplate | None, tensor, step: _Step, in_place) -> _Recipe | None:
    """The saved ``tensor``'s recipe in a step that replays, from its group's ``template`` where
    the graph and the step's recorded calls hold it (rule 2), else None. ``in_place``:
    recorder.py's ``_in_place`` (a module's ``inplace`` now). (At every pack of a recomputed
    group: loops, no generators; the cheap tests first.)"""
    if template is None or step.replay_doubt or tensor._version != template.version:
        return None
    calls = template.calls
    params = []
    for call in calls:
        module = call.module
        if module is None:
            params.append(())
            continue
        if module._forward_pre_hooks or module._forward_hooks or \
                in_place(module) != call.in_place:
            return None
        # the module rerun with its own attributes as they were learnt: what the forward read
        try:
            if call.hyper_reader(module.__dict__) != call.hyper_values:
                return None
        except KeyError:
            return None
        parameters = module._parameters
        row = []
        for name in call.params:
            param = parameters.get(name)
            if param is None:
                return None
            row.append(param)
        params.append(row)
    nodes = _walk(template.inputs, template.passes, tensor, step, params)
    if nodes is None:
        return None
    groups = step.groups
    recipe_inputs = []
    for slots in template.inputs:
        row = []
        for slot in slots:
            if slot < 0:
                gid = -1 - slot
                if gid >= len(groups):
                    return None
                group = groups[gid]
                source = group.ref()
                if group.live_packs == 0 or (source is not None and
                                             source._version != group.version):
                    return None
                row.append(group)
            else:
                row.append(slot)
        recipe_inputs.append(tuple(row))
    recipe_calls = []
    for call, node in zip(calls, nodes):
        # the op the graph shows, with the arguments it was learnt with
        kind = call.node
        if kind is not None and (type(node) is not kind or
                                 _attributes(node) != call.attributes):
            return None
        if call.watched and not _watched_holds(step, call, node):
            return None
        module = call.module
        recipe_calls.append(_Call(module, call.name, (), None, None, in_place=call.in_place,
                                  op=call.op, keywords=call.keywords, recomputable=True,
                                  state=_ModuleState.of(module) if module is not None else None))
    return _Recipe(recipe_calls, recipe_inputs)


def returns_own_input(module, args, output) -> bool:
    """Rule 2's test of a leaf ``module``'s return: it returned its own first argument, and is
    of no type known to change it in sight of its version counter or not at all."""
    return bool(args) and output is args[0] and not passes_on_plainly(module)


def passes_on_plainly(module) -> bool:
    """``module``, which returned its own input, is of a type known to change it in sight of
    its version counter or not at all: nn.Identity, an in-place activation of PyTorch's."""
    kind = type(module)
    return kind is nn.Identity or kind in CHEAP and bool(module.__dict__.get("inplace"))


#: node type -> what reads its saved arguments that are no tensors, in name order (a tensor's
#: has a ``_raw_saved_`` twin, which reads it without unpacking: rule 2 never unpacks)
_ATTRIBUTE_READERS: dict = {}


def _reader(get, names: tuple):
    """What reads ``names`` with ``get`` (:func:`operator.attrgetter` or
    :func:`operator.itemgetter`) into a tuple of their values, however many there are."""
    if not names:
        return lambda _: ()
    if len(names) == 1:
        one = get(names[0])
        return lambda value: (one(value),)
    return get(*names)


def _attributes(node) -> tuple:
    """``node``'s saved arguments that are no tensors (a batch norm's eps and mode, a pooling's
    kernel, an add's alpha), in name order."""
    kind = type(node)
    read = _ATTRIBUTE_READERS.get(kind)
    if read is None:
        read = _ATTRIBUTE_READERS[kind] = _reader(attrgetter, tuple(
            name for name in dir(node)
            if name.startswith("_saved_") and not hasattr(node, "_raw" + name)))
    return read(node)


_PLAIN = (bool, int, float, str, tuple, type(None))


def _hyperparameters(module) -> tuple[tuple, object]:
    """The values of ``module``'s own attributes of plain values (an activation's slope, a
    pooling's kernel, a batch norm's eps and momentum, its mode): what its forward reads besides
    tensors; and what reads them from a ``__dict__`` by name (a KeyError where one is gone);
    ((), None) for an op."""
    if module is None:
        return (), None
    names = tuple([name for name, value in module.__dict__.items()
                   if isinstance(value, _PLAIN) and name[0] != "_"])
    return tuple([module.__dict__[name] for name in names]), _reader(itemgetter, names)


def _watched_holds(step: _Step, call: _TemplateCall, node) -> bool:
    """A watched call's output (rule 2) is a recorded call of its module in ``step`` that made
    ``node``, alive and at the version it returned at: nothing changed it since, out of
    autograd's sight (``no_grad``, ``.data``), before the later calls read it."""
    number = node._sequence_nr()
    for recorded in reversed(step.calls):
        if recorded.module is not call.module or recorded.output is None:
            continue
        output = recorded.output()
        if output is not None and output.grad_fn is not None and \
                output.grad_fn._sequence_nr() == number:
            return output._version == recorded.output_version
    return False
