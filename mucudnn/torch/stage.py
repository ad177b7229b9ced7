"""Staging (docs/torch.md, "Staging"): the step's leading chain of per-sample layers run without
saving anything, and in the backward again in micro-batches, each rerun and differentiated at once.

A CNN's first layers hold its largest activations, and their backward its largest gradients: VGG-16
(N = 256) saves 7.7 GiB in its first block, and the backward of its second convolution holds
three 3.06 GiB tensors at once (its output's gradient, its input, its input's gradient), a floor
no choice of keep, offload or recompute per saved tensor lowers. Staged, that block's backward
holds a micro-batch's share of them.

Invariants:
- A chain is the children of one ``nn.Sequential`` run by its own forward (each child's input is
  the one before's output, and nothing else reads them), from the step's first leaf module, each
  of :data:`STAGEABLE` without hooks of its own: every sample's output reads that sample alone,
  and a rerun on a slice of the batch gives that slice of the output.
- Its first layer does not change its input in place (the input is saved for the backward).
- The chunked backward's gradients equal the whole batch's up to the order of the sums over the
  batch (each chunk's parameter gradient is added to the others'; micro-batched convolutions
  the same): equal in float64 to rounding, not bit for bit.
- A chain holds no module twice (it ends before a module it holds): its stage ends where as many
  of its modules returned as it has.
- A staged forward that cannot be finished as planned (its output a view, another chain than
  recorded) is run again with autograd: the step is then as unstaged.
- A rerun (the backward's, or the fallback's) reads the tensors the staged forward read (a
  convolution's weight and bias as they were at its forward: ``torch.func.functional_call`` swaps
  them for the parameters), returns their gradients to them (to second order where the backward
  is differentiated again, ``create_graph``), and calls each module's forward without any hook:
  a user's hooks see the user's forward only. One of these tensors changed in place since the
  forward is PyTorch's error, as a convolution that saved it would raise.
- A staged forward left before its end (a module raised, an interrupt) is aborted: grad mode as it
  was at its start.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn

from ..errors import ChangedInPlaceError, inplace_message
from . import planner
from . import planner_stage

#: per-sample, deterministic, no state changed by a forward: a slice of the batch in, that slice
#: of the output out
STAGEABLE = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU,
             nn.Sigmoid, nn.Tanh, nn.Hardswish, nn.GELU, nn.MaxPool1d, nn.MaxPool2d,
             nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.Identity)
#: where a chain may end: its activations shrink there
POOLS = (nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d)
#: the stageable modules whose forward reads tensors besides its input: the weight and the bias
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
#: the rank of a batched input of each stageable layer that also takes an unbatched one
BATCHED_DIM = {nn.Conv1d: 3, nn.Conv2d: 4, nn.Conv3d: 5, nn.MaxPool1d: 3, nn.MaxPool2d: 4,
               nn.MaxPool3d: 5, nn.AvgPool1d: 3, nn.AvgPool2d: 4, nn.AvgPool3d: 5}
#: device types whose autocast state a call records and its rerun restores (a convolution
#: recorded under bf16 autocast reads bf16 tensors and fp32 weights)
_AUTOCAST_DEVICES = ("cuda", "cpu")


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """(device, dtype) of each device with autocast on: a rerun runs under the same."""
    return tuple((device, torch.get_autocast_dtype(device)) for device in _AUTOCAST_DEVICES
                 if torch.is_autocast_enabled(device))


def autocast_as(recorded: tuple, stack: contextlib.ExitStack) -> None:
    """Enters on ``stack`` the autocast state ``recorded`` (:func:`autocast_state`) where the
    current one differs."""
    recorded = dict(recorded)
    for device in _AUTOCAST_DEVICES:
        enabled = device in recorded
        if enabled != torch.is_autocast_enabled(device) or (
                enabled and recorded[device] != torch.get_autocast_dtype(device)):
            stack.enter_context(torch.autocast(device, dtype=recorded.get(device),
                                               enabled=enabled))


def _plain_sequential(module: nn.Module | None) -> bool:
    return isinstance(module, nn.Sequential) and type(module).forward is nn.Sequential.forward


def stageable(module: nn.Module) -> bool:
    """Of :data:`STAGEABLE`, with its class's forward and no hooks of its own, returning a tensor
    (not a pooling layer that returns its indices too: a tuple no chain ends in)."""
    return type(module) in STAGEABLE and not module._forward_pre_hooks \
        and not module._forward_hooks and "forward" not in vars(module) \
        and not getattr(module, "return_indices", False)


@dataclass(eq=False)
class _Link:
    module: nn.Module
    groups_before: int
    call: object              # its _Call in the recording (its times)
    groups_after: int = -1


@dataclass(eq=False)
class ChainRecorder:
    """A recording step's leading chain (module docstring), as its leaf modules run: fed each
    leaf module's start and return, with the running containers (innermost last) and the
    groups saved so far."""

    links: list = field(default_factory=list)
    parent: nn.Module | None = None
    open: bool = True
    input_key: tuple | None = None
    input_bytes: int = 0
    #: whether a staged step saves the chain's input as a group (planner_stage.Stage.input_saved)
    input_saved: bool = True
    batch: int = 0

    def enter(self, module: nn.Module, args, parent: nn.Module | None, groups: int,
              call, key, saved=lambda tensor: True) -> None:
        """Leaf ``module`` starts (``call``, its record); ``key(tensor)``: a tensor's group key;
        ``saved(tensor)``: whether the session makes a group of it where it is saved."""
        if not self.open:
            return
        links = self.links
        if not stageable(module) or not _plain_sequential(parent) or (
                links and (parent is not self.parent or links[-1].groups_after != groups
                           or any(link.module is module for link in links)
                           or not _follows(parent, links[-1].module, module))):
            self.open = False
            return
        if not links:
            source = args[0] if args else None
            if not isinstance(source, torch.Tensor) or source.dim() < 2 or \
                    getattr(module, "inplace", False):
                self.open = False
                return
            self.parent, self.input_key = parent, key(source)
            self.input_bytes = source.numel() * source.element_size()
            self.input_saved = saved(source)
            self.batch = source.shape[0]
        links.append(_Link(module, groups, call))

    def leave(self, module: nn.Module, output, groups: int) -> None:
        if not self.open or not self.links or self.links[-1].module is not module:
            return
        if isinstance(output, torch.Tensor) and output.dim() >= 2 and \
                output.shape[0] == self.batch:
            self.links[-1].groups_after = groups
        else:   # a tuple (pooling's indices), or another batch: the chain ends before it
            self.links.pop()
            self.open = False

    def candidates(self, input_group: int | None, time_ms
                   ) -> list[tuple[planner_stage.Stage, list, tuple]]:
        """Stages ending at the chain's first :data:`planner_stage.STAGE_ENDS` pooling layers that
        saved groups: (planner_stage.Stage with chunks to be chosen, its modules, each of its
        calls' time). ``input_group``: the group the chain's input was saved as (None: none);
        ``time_ms(call)``: a call's compute time, None where untimed (it counts 0)."""
        found = []
        for end, link in enumerate(self.links):
            if link.groups_after < 0 or not isinstance(link.module, POOLS):
                continue
            first, after = self.links[0].groups_before, link.groups_after
            saved_input = input_group is not None and first <= input_group < after
            if after - first - saved_input <= 0:   # it saved nothing but its input
                continue
            times = [time_ms(each.call) for each in self.links[:end + 1]]
            found.append((planner_stage.Stage(
                end + 1, first, after, input_group, self.input_bytes, 1,
                sum(ms or 0.0 for ms in times),
                input_saved=input_group is not None or self.input_saved),
                [each.module for each in self.links[:end + 1]], tuple(times)))
            if len(found) == planner_stage.STAGE_ENDS:
                break
        return found

    def extending(self, recorded: "StagePlan", groups_at_end: int, time_ms
                  ) -> list[tuple[planner_stage.Stage, list, tuple]]:
        """The stages that extend ``recorded``, the stage the recording took (its chain up to
        the first pooling layer, :func:`leading_chain`), by this chain where it goes on right
        after it: ending at its pooling layers, as many as make :data:`planner_stage.STAGE_ENDS`
        ends with ``recorded``'s (:meth:`candidates`' triples). ``groups_at_end``: the groups the
        step had saved when ``recorded``'s output was made (its input, if that is a group, and
        none before it: a recording stages only from its first save)."""
        modules, stage = recorded.modules, recorded.stage
        if not self.links or modules is None or self.parent is not recorded.parent or \
                self.links[0].groups_before != groups_at_end or \
                sum(isinstance(module, POOLS) for module in modules) != 1 or \
                not _follows(self.parent, modules[-1], self.links[0].module) or \
                any(link.module is module for link in self.links for module in modules):
            return []
        # this chain's own stages, from its first module on, are the extension past ``recorded``
        input_group = stage.first_group if groups_at_end > stage.first_group else None
        return [(replace(own, modules=len(modules) + own.modules, first_group=stage.first_group,
                         input_group=input_group, input_bytes=stage.input_bytes,
                         recorded_chunks=stage.chunks,
                         input_saved=input_group is not None or stage.input_saved),
                 modules + more, times)
                for own, more, times
                in self.candidates(None, time_ms)[:planner_stage.STAGE_ENDS - 1]]


#: A recording step stages the leading chain (:func:`recording_chunks`) where the chain's backward
#: would hold more than this share of the budget at once: three of its largest tensors (an
#: output's gradient, the input read again, the input's gradient), which no choice of keep,
#: offload or recompute lowers. Below it the recording runs unstaged and the planner weighs the
#: staged plans against the plain ones on its profile. The nearer that floor comes to the plan's
#: target, the less room a plain plan leaves its saved tensors: its steps flush the caching
#: allocator, and the session lowers it to the staged plan after a few steps (measured between
#: 0.53 and 0.65 of the budget: ``benchmarks/results/plan-accuracy/README.md``, "A recording
#: staged only where its plain plans would not fit")
RECORDING_STAGE_SHARE = 0.6
#: A staged recording stages on through each next block whose backward alone would hold more
#: than this share of the budget (three of its largest tensors): staged to the block before
#: alone, the recording itself runs out of memory in that block's backward
RECORDING_FLOOR_SHARE = 0.5
#: A staged recording runs its chain in the fewest of these micro-batches whose share of three of
#: the chain's largest tensors is within this share of the budget
RECORDING_CHUNKS = (2, 4, 8, 16, 32)
RECORDING_CHUNK_SHARE = 0.25


def _children_from(module: nn.Module, parent: nn.Module | None) -> list[nn.Module] | None:
    """``module`` and the children after it in its container ``parent``, where ``parent`` is a
    plain ``nn.Sequential`` holding it and ``module`` does not change its input in place (the
    input is saved for the backward); else None."""
    if not _plain_sequential(parent) or getattr(module, "inplace", False):
        return None
    children = list(parent._modules.values())
    start = next((index for index, child in enumerate(children) if child is module), None)
    return None if start is None else children[start:]


def leading_chain(module: nn.Module, parent: nn.Module | None, ends: int = 1
                  ) -> list[nn.Module] | None:
    """The chain a step's first leaf ``module`` starts, read from its container ``parent``
    before it runs: ``module`` and the children after it, each :func:`stageable`, none twice,
    up to and including the ``ends``-th pooling layer (where the activations shrink); None where
    ``parent`` is no plain ``nn.Sequential``, the first changes its input in place, or no such
    pooling layer ends it (the module docstring's chain, as a recording would find it)."""
    chain: list[nn.Module] = []
    pools = 0
    for child in _children_from(module, parent) or ():
        if child is None or not stageable(child) or any(child is seen for seen in chain):
            return None
        chain.append(child)
        if isinstance(child, POOLS):
            pools += 1
            if pools == ends:
                return chain
    return None


def chain_of(module: nn.Module, parent: nn.Module | None, count: int
             ) -> list[nn.Module] | None:
    """The chain of ``count`` modules a step's first leaf ``module`` starts in its container
    ``parent``, as a recording found it (a cached staged plan's, :class:`StagePlan`): ``module``
    and the children after it, each :func:`stageable`, none twice, the last a pooling layer; None
    where they are not (another model, a hook added since, ``parent`` no plain
    ``nn.Sequential``, the first changing its input in place)."""
    following = _children_from(module, parent) if count >= 1 else None
    if following is None or len(following) < count:
        return None
    chain = following[:count]
    if any(child is None or not stageable(child) for child in chain) or \
            len(set(map(id, chain))) < count or not isinstance(chain[-1], POOLS):
        return None
    return chain


def recording_stage(module: nn.Module, parent: nn.Module | None, source: torch.Tensor,
                    budget: int) -> tuple[list[nn.Module], int] | None:
    """The chain a recording step stages from its first leaf ``module`` (``parent`` running it,
    ``source`` its input) under ``budget`` bytes, and its micro-batches; None where it stages
    none. The leading chain to its first pooling layer where :func:`recording_chunks` stages it,
    and on through each next pooling layer (up to :data:`planner_stage.STAGE_ENDS` in all) whose
    block's backward alone would hold more than :data:`RECORDING_FLOOR_SHARE` of the budget too:
    three of its largest tensors (its input among them) at the whole batch. Staged to the first
    pooling layer alone, such a recording runs out of memory in that block's backward (VGG-16 at
    N = 176 under 4.5 GiB)."""
    chain = leading_chain(module, parent)
    chunks = recording_chunks(chain, source, budget) if chain is not None else None
    if chunks is None:
        return None
    for ends in range(2, planner_stage.STAGE_ENDS + 1):
        longer = leading_chain(module, parent, ends)
        sizes = _sample_bytes(longer, source) if longer is not None else None
        if sizes is None or \
                3 * max(sizes[len(chain):]) * source.shape[0] <= RECORDING_FLOOR_SHARE * budget:
            break
        chain = longer
    # the micro-batches for the whole chain: a later block's tensors may be the larger
    return chain, recording_chunks(chain, source, budget) or chunks


def _sample_bytes(modules: list[nn.Module], source: torch.Tensor) -> list[int] | None:
    """The bytes of one sample of the chain ``modules``' input and of each module's output (on
    the meta device: the shapes without a kernel; under autocast the full precision's, the
    larger); None where a module returns no tensor."""
    value = torch.empty((1,) + tuple(source.shape[1:]), dtype=source.dtype, device="meta")
    sizes = [value.numel() * value.element_size()]
    with torch.no_grad():
        for module in modules:
            read = tuple(None if each is None else each.to("meta") for each in _weights(module))
            value = _call(module, read, value)
            if not isinstance(value, torch.Tensor):
                return None
            sizes.append(value.numel() * value.element_size())
    return sizes


def recording_chunks(modules: list[nn.Module], source: torch.Tensor, budget: int) -> int | None:
    """The micro-batches a recording step stages the leading chain ``modules`` in, its input
    ``source``, under ``budget`` bytes: None where three of the chain's largest tensors take at
    most :data:`RECORDING_STAGE_SHARE` of the budget (the recording runs unstaged, and the
    planner weighs staging after it); else the fewest of :data:`RECORDING_CHUNKS` (at most the
    batch) whose share of them is within :data:`RECORDING_CHUNK_SHARE`. The sizes are the
    chain's on one sample (its shapes, on the meta device, without hooks) times the batch."""
    batch = source.shape[0] if source.dim() >= 2 else 0
    if batch < 2 or not batched(modules, source):   # an unbatched image: no batch to split
        return None
    # on the meta device: the shapes without a kernel (nor a convolution of one sample for the
    # shim to tune)
    sizes = _sample_bytes(modules, source)
    if sizes is None:
        return None
    held = 3 * max(sizes) * batch
    if held <= RECORDING_STAGE_SHARE * budget:
        return None
    fitting = [c for c in RECORDING_CHUNKS
               if c <= batch and held / c <= RECORDING_CHUNK_SHARE * budget]
    return fitting[0] if fitting else min(RECORDING_CHUNKS[-1], batch)


def _follows(parent: nn.Module, before: nn.Module, module: nn.Module) -> bool:
    children = list(parent._modules.values())
    return any(a is before and b is module for a, b in zip(children, children[1:]))


class StagePlan:
    """A stage in force: its modules (weakly), the container that runs them, its micro-batches."""

    def __init__(self, stage: planner_stage.Stage, modules: list[nn.Module], parent: nn.Module):
        self.stage = stage
        self._modules = [weakref.ref(module) for module in modules]
        self._parent = weakref.ref(parent)
        self.first = modules[0]

    @property
    def modules(self) -> list[nn.Module] | None:
        modules = [ref() for ref in self._modules]
        return None if any(module is None for module in modules) else modules

    @property
    def parent(self) -> nn.Module | None:
        return self._parent()

    def runs(self, module: nn.Module, args, parent: nn.Module | None, saved: int) -> bool:
        """Whether ``module``'s call (``parent`` running it, ``saved`` groups saved so far in the
        step) starts the stage now: where the recording's chain started (a batch smaller than
        ``chunks`` runs in one chunk a sample)."""
        if module is not self.first or parent is None or parent is not self._parent() \
                or saved != self.stage.first_group or not torch.is_grad_enabled() or not args \
                or not isinstance(args[0], torch.Tensor) or args[0].dim() < 2:
            return False
        modules = self.modules
        return modules is not None and batched(modules, args[0]) and \
            all(stageable(m) for m in modules) and all(
            _follows(parent, a, b) for a, b in zip(modules, modules[1:])) and \
            len(set(map(id, modules))) == len(modules) and not _transformed()


def batched(modules: list[nn.Module], source: torch.Tensor) -> bool:
    """Whether ``source`` is a batch for the chain ``modules``: of the batched rank of its first
    convolution or pooling layer (each keeps the rank), which take an unbatched input too, whose
    first dimension is no batch."""
    dim = next((BATCHED_DIM[type(m)] for m in modules if type(m) in BATCHED_DIM), None)
    return dim is None or source.dim() == dim


def _transformed() -> bool:
    """Under a ``torch.func`` transform (``vmap``, ``grad``): the staged chain's
    ``autograd.Function`` cannot stand for the chain there (under ``vmap`` the batched weights got
    no gradient through it), so nothing is staged."""
    active = getattr(torch._C, "_are_functorch_transforms_active", None)
    return active is not None and active()


class StagedForward:
    """A staged forward running: grad mode off from its first module to its last's return, or
    to :meth:`abort`. Its modules run on the batch's first sample alone (:meth:`first_args`: the
    container's own forward calls them, so they run; on one sample they cost little), and the
    stage's output is made in micro-batches at its end (:meth:`finish`): a full-batch forward's
    largest tensors (VGG-16's first block at N = 256: 3.06 GiB each, two at once) never exist,
    nor the holes they leave in the caching allocator's blocks."""

    def __init__(self, plan: StagePlan, source: torch.Tensor):
        self.plan, self.source = plan, source
        self.modules = plan.modules
        self.returned = 0   # how many of its modules returned
        self.autocast = autocast_state()
        self.grad_mode = torch.is_grad_enabled()
        self.running = True
        torch.set_grad_enabled(False)

    def first_args(self, args: tuple) -> tuple:
        """What the chain's first module is called with: the batch's first sample (module
        docstring)."""
        return (self.source[:1],) + tuple(args[1:])

    def _output_in_chunks(self) -> torch.Tensor:
        """The chain's output on the whole batch, made a micro-batch at a time (the backward's
        micro-batches) under ``no_grad`` and joined."""
        size = chunk_size(self.source.shape[0], self.plan.stage.chunks)
        with torch.no_grad():
            parts = [run_chain(self.modules, self.weights, part, self.autocast)
                     for part in self.source.split(size)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

    def ends_at(self, module: nn.Module) -> bool:
        """``module``, one of the chain's, returned: whether the chain has (as many returned as
        it holds, in the order of the Sequential, which runs each once)."""
        self.returned += 1
        return self.returned == len(self.modules)

    def abort(self) -> None:
        """The forward left the chain before its end (a module raised; any exception, an
        interrupt): grad mode as it was at its start, nothing held. Once: a second call, or one
        after :meth:`finish`, changes nothing."""
        if self.running:
            self.running = False
            torch.set_grad_enabled(self.grad_mode)
        self.source = self.output = None

    def finish(self, sampled: torch.Tensor) -> torch.Tensor:
        """The stage's output, in the graph: through :class:`_StagedChain`, or, where it cannot
        stand for the chain (a view, or not a tensor of the batch: as ``sampled``, the chain's
        output on the first sample, is), the chain run again with autograd. ``sampled`` is let
        go: the output is made in micro-batches (:meth:`_output_in_chunks`)."""
        self.running = False
        torch.set_grad_enabled(self.grad_mode)
        self.weights = [_weights(module) for module in self.modules]
        self.params = params = _distinct(self.weights)
        if not isinstance(sampled, torch.Tensor) or sampled._base is not None or \
                sampled.shape[0] != 1:
            return run_chain(self.modules, self.weights, self.source, self.autocast)
        output = self._output_in_chunks()
        if not (self.source.requires_grad or any(p.requires_grad for p in params)):
            return output
        self.versions = [param._version for param in params]
        self.output = output
        staged = _StagedChain.apply(self, self.source, *params)
        self.source = None   # the saved group holds it now (kept, offloaded or dropped)
        return staged

    def check_versions(self) -> None:
        """PyTorch's error where a tensor the forward read changed in place since."""
        for param, version in zip(self.params, self.versions):
            if param._version != version:
                raise ChangedInPlaceError(
                    inplace_message(param, version, "read by a staged chain") + "; under "
                    "autocast PyTorch alone differentiates with the cast it saved: "
                    "OffloadSession(stage=False) does too")


def _weights(module: nn.Module) -> tuple:
    """The tensors ``module``'s forward reads now besides its input (a convolution's weight and
    bias: the parameters, or what ``torch.func.functional_call`` put in their place)."""
    return (module.weight, module.bias) if isinstance(module, CONVOLUTIONS) else ()


def _distinct(weights: list[tuple]) -> list[torch.Tensor]:
    seen, params = set(), []
    for each in weights:
        for tensor in each:
            if tensor is not None and id(tensor) not in seen:
                seen.add(id(tensor))
                params.append(tensor)
    return params


def _call(module: nn.Module, read: tuple, value: torch.Tensor) -> torch.Tensor:
    """``module``'s forward on ``value`` reading ``read`` (:func:`_weights`), without hooks."""
    return module._conv_forward(value, *read) if read else module.forward(value)


def chunk_size(batch: int, chunks: int) -> int:
    """Samples per micro-batch of a stage in ``chunks`` of ``batch`` (the last may hold fewer)."""
    return -(-batch // chunks)


def run_chain(modules: list[nn.Module], weights: list[tuple], value: torch.Tensor,
              autocast: tuple) -> torch.Tensor:
    """The chain's forward on ``value``, each module reading ``weights`` (:func:`_weights`, at the
    staged forward) and called without hooks (not ``module(value)``): no hook of the user's, no
    global one, no session's sees a rerun."""
    with contextlib.ExitStack() as stack:
        autocast_as(autocast, stack)
        for module, read in zip(modules, weights, strict=True):
            value = _call(module, read, value)
    return value


class _StagedChain(torch.autograd.Function):
    """The stage's output (made under ``no_grad``) with the stage's backward: per micro-batch of
    its input, the chain rerun and differentiated; parameter gradients summed over them."""

    @staticmethod
    def forward(ctx, run: StagedForward, source, *params):
        ctx.run = run
        ctx.save_for_backward(source)
        output, run.output = run.output, None
        return output

    @staticmethod
    def backward(ctx, grad):
        """Grad mode on here: the backward runs with ``create_graph``, and its gradients are
        made differentiable (the rerun reads the source's chunks and the weights themselves)."""
        source, = ctx.saved_tensors
        run: StagedForward = ctx.run
        run.check_versions()
        params = run.params
        higher = torch.is_grad_enabled()
        wants_source = ctx.needs_input_grad[1]
        wanted = [p for p, need in zip(params, ctx.needs_input_grad[2:]) if need]
        sums: list[torch.Tensor | None] = [None] * len(wanted)
        pieces = []
        size = chunk_size(source.shape[0], run.plan.stage.chunks)
        for part, part_grad in zip(source.split(size), grad.split(size)):
            with torch.enable_grad():
                value = part if higher and wants_source else \
                    part.detach().requires_grad_(wants_source)
                out = run_chain(run.modules, run.weights, value, run.autocast)
                got = torch.autograd.grad(out, ([value] if wants_source else []) + wanted,
                                          part_grad, allow_unused=True, create_graph=higher)
            if wants_source:
                pieces.append(got[0] if got[0] is not None else torch.zeros_like(part))
                got = got[1:]
            for index, each in enumerate(got):
                if each is not None:   # in place only where no graph records the sum
                    sums[index] = each if sums[index] is None else \
                        sums[index] + each if higher else sums[index].add_(each)
            del out, got
        by_param = dict(zip(map(id, wanted), sums))
        source_grad = torch.cat(pieces) if wants_source else None
        return (None, source_grad) + tuple(by_param.get(id(p)) for p in params)
