"""The records of one step of mucudnn.torch's offload session: the calls its forward made
(:class:`_Call`, what each read: :class:`_Read`, the module's state: :class:`_ModuleState`), the
recipes that rebuild a saved tensor from them (:class:`_Recipe`, :func:`rerun_as_recorded`), the
groups of saved tensors (:class:`_Group`; autograd holds a :class:`_Packed` or a
:class:`_Passed` for each save) and the step itself (:class:`_Step`). The rules these records
keep are offload_session.py's."""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ChangedInPlaceError, inplace_message
from .lifecycle import offload_everything  # noqa: F401 (the records' name for it)
from .link import Transfer
from .planner import KEEP, RECOMPUTE
from .stage import ChainRecorder, autocast_as

#: Modules whose recomputation is deterministic and cheap (SuperNeurons' choice: no convolution,
#: no dropout). Exact types: a subclass may override forward.
CHEAP = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.SiLU, nn.Sigmoid, nn.Tanh, nn.Hardswish,
         nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d,
         nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool2d, nn.Identity)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
#: Instance norms: cheap too, where they keep no running statistics (their default; a rerun
#: would update those a second time)
_INSTANCE_NORMS = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
#: Modules that may also be recomputed, at their measured cost (the planner weighs it against
#: moving their output; per-block checkpointing shows recomputing them can beat the host link).
#: A transposed one reruns at the output size it made (``output_size`` may have chosen it).
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d) + _TRANSPOSED
#: Max poolings whose indices a recipe rebuilds too: each saves its input and the indices of its
#: maxima (int64, twice an fp32 output's bytes) for its backward, made by one deterministic
#: kernel (``max_pool2d_with_indices``, ``max_pool3d_with_indices``) that a rerun on the same
#: input runs again. One-dimensional pooling runs the 2-D kernel on a view and saves its 4-D
#: indices: not one of these. Only where the module keeps its indices to itself
#: (``return_indices`` False): indices a script was given could be changed before the backward.
MAX_POOLS = {nn.MaxPool2d: (F.max_pool2d, 2), nn.MaxPool3d: (F.max_pool3d, 3)}


@dataclass(frozen=True, slots=True)
class _Read:
    """A tensor a call read, weakly, and its version then. An offloaded input is gone (autograd
    holds only what the pack hook returned) when a later recipe looks for it: its group is the
    one whose ``ref`` is this ``ref`` (CPython gives an object one weak reference without a
    callback, the same object after it died), never one by address, which the caching
    allocator gives the next tensor of its size (a downsampling convolution's output after the
    freed output of the block's last convolution)."""

    ref: weakref.ref
    version: int

    @classmethod
    def of(cls, tensor: torch.Tensor) -> _Read:
        """``tensor`` as a call reads it now."""
        return cls(weakref.ref(tensor), tensor._version)


@dataclass(eq=False, slots=True)
class _Call:
    """One leaf module's forward, or one recorded op (:data:`ADDS`; ``module`` None): what it
    read and wrote (weakly) and how long it took."""

    module: nn.Module | None
    name: str
    reads: tuple[_Read, ...]  # its tensor inputs (a module's first argument; an op's operands)
    output: weakref.ref | None
    start: object
    end: object = None
    moved: int = 0            # bytes copied inline to the host while it ran (recording step)
    done: bool = False        # its forward returned
    output_version: int = 0   # its output's version when it returned
    in_place: bool = False    # its output is its first input, changed
    op: object = None         # an op's function, called again with ``keywords`` to rerun it
    keywords: dict | None = None   # an op's (a module call has none: no dict per module call)
    #: a recipe may run it again: a module of an exact type the session recomputes
    #: (:meth:`OffloadSession._recomputable`), or a recorded op (deterministic, elementwise)
    recomputable: bool = False
    autocast: tuple = ()      # autocast_state() when it ran: its rerun runs under the same
    output_bytes: int = 0     # its output's bytes
    #: recording step, recomputable: bytes allocated when it started, and the most it allocated
    #: above them while it ran (its output and its workspace: what its rerun allocates)
    allocated_before: int = 0
    rise: int = 0
    output_shape: tuple = ()  # its output's shape (a transposed convolution reruns to it)
    index: int = -1           # its place in its step's calls
    #: a recomputable module's state as its forward read it (:class:`_ModuleState`)
    state: _ModuleState | None = None

    def run(self, values: list[torch.Tensor], indices: bool = False) -> torch.Tensor:
        """Its forward again on ``values`` (one per read), without side effects
        (:func:`rerun_as_recorded`), under the autocast state it ran under and with the module's
        state as it read it. ``indices``: a max pooling's indices instead of its output."""
        with contextlib.ExitStack() as stack:
            autocast_as(self.autocast, stack)
            if self.op is not None:
                return self.op(*values, **(self.keywords or {}))
            return rerun_as_recorded(self.module, values[0], self.state, self.output_shape,
                                     indices)


@dataclass(eq=False, slots=True)
class _ModuleState:
    """What a recomputable module's forward read besides its input, recorded when it ran, so
    that a rerun in the backward computes what it computed, whatever changed since: its mode
    (``model.eval()`` before the backward; a train- and an eval-mode forward in one step), the
    tensors in its ``_parameters`` (``torch.func.functional_call`` puts plain tensors there for
    the call; autograd holds them for the backward anyway) at their versions then, and an
    eval-mode batch norm's running statistics, copied (a later train-mode forward changes them
    in place)."""

    training: bool
    params: dict
    versions: tuple
    running: tuple | None = None     # (mean, var) copies: an eval-mode batch norm's

    @classmethod
    def of(cls, module: nn.Module) -> _ModuleState:
        params, versions = {}, []   # one pass, no generator: at every recomputable module call
        for name, value in module._parameters.items():
            if value is not None:
                params[name] = value
                versions.append(value._version)
        running = None
        if not module.training and isinstance(module, _BATCH_NORMS) and \
                module.running_mean is not None and module.running_var is not None:
            running = (module.running_mean.clone(), module.running_var.clone())
        return cls(module.training, params, tuple(versions), running)

    def check(self) -> None:
        """PyTorch's error where a parameter the forward read was changed in place since (an
        optimizer step before the backward): a rerun would compute another value."""
        for (name, value), version in zip(self.params.items(), self.versions):
            if value._version != version:
                raise ChangedInPlaceError(
                    inplace_message(value, version, name) + "; a module recomputed in the "
                    "backward reads it (under autocast PyTorch alone differentiates with the "
                    "cast it saved: OffloadSession(recompute=False) does too)")


@dataclass(frozen=True, eq=False)
class _ViewOf:
    """A recipe's input read through a saved group of another shape over the same elements: an
    instance norm saves its input ``C`` (a convolution's output, contiguous) reshaped to
    ``(1, N*C, ...)``, a view sharing C's storage and version counter, and C's own object is freed
    once the norm returns. ``group``'s tensor (its values; kept, fetched or recomputed, contiguous
    or made so) viewed with ``shape`` and ``stride`` is C."""

    group: _Group
    shape: tuple
    stride: tuple

    def of(self, tensor: torch.Tensor) -> torch.Tensor:
        """C from ``tensor``, the group's tensor: the group and C are contiguous over the same
        elements, so C's elements are the group's in order (a fetched tensor has the group's
        layout, not its storage: the view is taken from it, never from a storage pointer)."""
        return _viewed(tensor, self.shape, self.stride)


def _viewed(tensor: torch.Tensor, shape: tuple, stride: tuple) -> torch.Tensor:
    """``tensor``'s elements in order, viewed with ``shape`` and ``stride`` (a contiguous layout
    over the same elements: an instance norm's ``(1, N*C, ...)`` view and its input ``C``)."""
    return tensor.contiguous().view(shape).as_strided(shape, stride)


def _same_elements(source: torch.Tensor | None, tensor: torch.Tensor) -> bool:
    """``tensor`` is another view of exactly ``source``'s elements, both contiguous (an instance
    norm's reshaped input saved for its backward, and that input)."""
    return source is not None and source is not tensor and source.is_contiguous() and \
        tensor.is_contiguous() and source.dtype == tensor.dtype and \
        source.device == tensor.device and source.numel() == tensor.numel() and \
        source.storage_offset() == tensor.storage_offset() and \
        source.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()


@dataclass(frozen=True, eq=False)
class _Alias:
    """``group`` holds the values of the tensor whose weak reference is ``ref`` (the first read of
    the call that saved the group) as a :class:`_ViewOf` slot would read them."""

    ref: weakref.ref
    view: _ViewOf


@dataclass(eq=False)
class _Recipe:
    """Calls that rebuild a saved tensor from saved groups: ``calls`` run in order, the last
    makes the tensor; ``inputs[i]`` says where each read of ``calls[i]`` comes from: a source
    group, a source group viewed back to the shape read (:class:`_ViewOf`) or the index of an
    earlier call (each call's output is read once). ``view``: (shape, stride) the last call's
    output is viewed with to be the saved tensor (an instance norm saves its input, a
    convolution's output, reshaped), else None."""

    calls: list[_Call] = field(default_factory=list)
    inputs: list[tuple] = field(default_factory=list)
    view: tuple | None = None
    #: the saved tensor is the indices the last call (a :data:`MAX_POOLS` module's) made
    #: besides its output, not its output
    indices: bool = False
    #: :attr:`sources` as found from ``inputs`` when it had ``_sources_of`` entries (inputs are
    #: only appended to, while the recipe is found)
    _sources: list | None = field(default=None, repr=False)
    _sources_of: int = field(default=-1, repr=False)

    @property
    def producer(self) -> str:
        """The name of what made the saved tensor: its last call's (a max pooling's indices:
        its name and "indices")."""
        name = self.calls[-1].name
        return f"{name} indices" if self.indices else name

    @property
    def sources(self) -> list[_Group]:
        """The groups it reads, each once, in the order it first reads them: each must be kept
        (at the version it read) or recomputed, and on the device until the rebuilt tensor can no
        longer be unpacked. (Read at every pack, unpack and rebuild of a recomputed group: found
        once per length of ``inputs``; not to be changed by its readers.)"""
        if self._sources_of == len(self.inputs):
            return self._sources
        found = []
        for slots in self.inputs:
            for slot in slots:
                if isinstance(slot, _ViewOf):
                    slot = slot.group
                if isinstance(slot, _Group) and slot not in found:
                    found.append(slot)
        self._sources, self._sources_of = found, len(self.inputs)
        return found


@dataclass(eq=False, slots=True)
class _Group:
    gid: int
    mode: str
    nbytes: int
    device: torch.device
    ref: weakref.ref
    version: int
    producer: str
    offloadable: bool
    tensor: torch.Tensor | None = None      # on the device: kept, fetched or recomputed
    #: a kept ``tensor``'s version while it holds the saved value (an alias shares the saved
    #: tensor's version counter, a copy has its own: :meth:`OffloadSession._kept`); None:
    #: ``version``
    kept_version: int | None = None
    host: Transfer | None = None
    release: object = None                  # gives ``host`` back to the link's pool
    fetch: Transfer | None = None
    recipe: _Recipe | None = None
    packs: int = 0
    unpacks: int = 0
    first_unpack: int | None = None
    last_unpack: int | None = None
    pack_mark: object = None
    wanted: str = KEEP                      # the plan's mode; ``mode`` is what runs
    live_packs: int = 0                     # _Packed objects autograd still holds
    readers: int = 0                        # recomputed groups that may still read this one
    #: its step (which counts its live groups), weakly: the step holds its groups, and a
    #: group holding its step back would make every step a reference cycle that only the
    #: collector's full collections free (each pack holds the step instead: :class:`_Packed`)
    step_ref: weakref.ref | None = None
    #: the base of a view saved (weakly): it shares the view's version counter, and outlives
    #: the view object a forward made for the op (an in-place change through it is seen)
    base: weakref.ref | None = None
    #: :data:`_SEQUENCE_NR` at its pack: its op has run once a later pack reads a larger one
    saved_seq: int = 0

    @property
    def owner(self) -> _Step | None:
        """Its step, while anything holds it (the session, or a pack of the step autograd
        holds)."""
        return self.step_ref() if self.step_ref is not None else None

    def drop_device(self) -> None:
        """Let go of the device tensor where nothing may need it from the session again."""
        if self.readers or self.tensor is None and self.fetch is None:
            return
        if self.live_packs == 0 or (self.mode != KEEP and self.unpacks >= self.packs):
            self.tensor, self.fetch = None, None

    def pack_freed(self, step: _Step) -> None:
        self.live_packs -= 1
        if self.live_packs == 0:
            step.live -= 1
            if self.host is not None and self.release is not None:
                self.release(self.host)       # nothing can unpack this group again
                self.host = None
            if self.mode == RECOMPUTE:
                for source in self.recipe.sources:
                    source.readers -= 1       # this one can no longer be unpacked
                    source.drop_device()
            self.drop_device()

    def check_version(self) -> None:
        """PyTorch's error where the saved tensor was changed in place since its pack (as autograd
        raises without saved-tensor hooks): read through the tensor itself while it lives, or
        the kept alias, which shares its version counter."""
        original = self.ref()
        if original is None and self.base is not None:
            original = self.base()
        if original is not None and original._version != self.version:
            raise RuntimeError(inplace_message(original, self.version))
        kept = self.tensor if self.mode == KEEP else None
        if kept is not None and self.kept_version is not None and \
                kept._version != self.kept_version:
            raise RuntimeError(inplace_message(kept, self.kept_version))



class _Packed:
    """What autograd holds for one pack of a group: its lifetime is the saved tensor's. It holds
    the group's step too, which its unpack and its end count on (the group holds it weakly)."""

    __slots__ = ("group", "step")

    def __init__(self, group: _Group, step: _Step):
        self.group, self.step = group, step
        group.live_packs += 1
        if group.live_packs == 1:
            step.live += 1

    def __del__(self):
        self.group.pack_freed(self.step)


class _Passed:
    """What autograd holds for a saved tensor the session leaves alone (a parameter, a small
    tensor, one saved in a backward): the tensor without its autograd history (a node saving its
    own output, sigmoid, would otherwise hold itself through it: a cycle through C++ the
    collector cannot break, memory a dropped graph never gives back; autograd puts the history
    back at the unpack) and its version then: autograd checks no version where saved-tensor
    hooks run, so the unpack does (:meth:`check`)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor.detach() if tensor.grad_fn is not None else tensor
        self.version = tensor._version

    def check(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise RuntimeError(inplace_message(self.tensor, self.version))
        return self.tensor


@dataclass(eq=False)
class _Step:
    groups: list = field(default_factory=list)
    by_key: dict = field(default_factory=dict)
    by_ref: dict = field(default_factory=dict)   # id(group.ref) -> group (the group holds it)
    #: id of a read's weak reference -> _Alias: a group saved as a view of that tensor covering
    #: its elements (an instance norm's reshaped input), which holds its values while that
    #: group is live and at the read's version (the view shares its version counter)
    by_view: dict = field(default_factory=dict)
    unpacks: int = 0
    calls: list = field(default_factory=list)
    #: id of a call's output's weak reference (CPython's one per live tensor without a callback)
    #: -> the indices in ``calls`` of the calls that returned it, ascending
    outputs: dict = field(default_factory=dict)
    marks: list = field(default_factory=list)  # (kind, index, mark, allocated, peak before)
    profiling: bool = False
    ooms: int | None = None                          # the link's ``ooms()`` at its first pack
    #: the autograd node of the last unpack (not its tensors), while its backward runs: a
    #: graph that outlives the backward (``retain_graph``, nodes it never ran) holds packs that
    #: hold the step, a cycle through autograd's C++ nodes that the collector never frees
    node: object = None
    node_groups: list = field(default_factory=list)  # the groups that node unpacked
    backward_done: bool = False    # its backward ran to the end (autograd's final callback)
    watching: bool = False         # that callback is queued
    #: the host's clock (perf_counter s) at its first group's pack, and the ms from there to its
    #: first unpack: how long the host took to issue its forward (the script's own waits in it)
    host_start: float | None = None
    host_forward_ms: float | None = None
    finds_recipes: bool | None = None   # OffloadSession._finds_recipes, once decided
    #: the ids of the only leaf modules whose calls it records (StepRecorder.recorded_modules);
    #: None: every one's, where it records calls at all
    records_only: frozenset | None = None
    records_only_decided: bool = False
    #: the ids of the leaf modules that saved a view of their own input (StepRecorder.alias):
    #: recipes read through such a view, found from that module's call
    view_savers: set = field(default_factory=set)
    ops_looked_at: bool = False   # the op recorder entered or left as its modes need (OffloadSession)
    #: gid -> the sequence number of its tensor's autograd node at its pack (None: none), in a
    #: step that finds recipes, packed on the ``with``'s thread (replay.py, rule 3)
    nodes: dict = field(default_factory=dict)
    #: gid -> the template of the recipe found for it (None: none allowed), in a planned step
    #: that recorded every call (replay.py, rule 1)
    templates: dict = field(default_factory=dict)
    #: gid -> template, where this step replays its recipes (StepRecorder.recorded_modules)
    replays: dict | None = None
    #: a module ran or a group was packed on another thread than the ``with``'s: no node of this
    #: step is named for a replay (replay.py, rule 3)
    foreign: bool = False
    #: a leaf module of no type known to change nothing unseen returned its own input (which
    #: ``.data`` may have changed, out of any version counter's sight): no later pack of this
    #: step replays (replay.py, rule 2)
    replay_doubt: bool = False
    start_allocated: int | None = None   # the link's allocated bytes at its first module
    end_mark: object = None        # its backward's end (recording steps)
    #: recording steps that stage: where the chain's forward began, before the step's first save
    #: (the chain saves nothing, and its input is saved once its output is made)
    forward_start: object = None
    #: recording steps that stage: the groups saved when the chain's output was made
    stage_end_groups: int | None = None
    copies: list = field(default_factory=list)   # (direction, bytes, mark, mark): inline copies
    #: forward point -> (group, its offload's transfer) whose device tensors go there
    releases: dict = field(default_factory=dict)
    chain: ChainRecorder | None = None   # recording steps: its leading chain (stage.py)
    #: (group, tensor, autograd sequence number at its pack): copies due once its op has run
    pending: list = field(default_factory=list)
    live: int = 0                  # its groups that autograd still holds (a pack not freed)
    rescued: int = 0               # bytes moved to the host when it ran out of memory (rescue.py)

    def abandoned(self) -> bool:
        """Its forward saved groups, no backward unpacked any, and autograd holds none of them:
        its graph was dropped (a skipped non-finite loss, a validation forward with grad)."""
        return bool(self.groups) and not self.unpacks and not self.live


#: the sequence number the next autograd node will get (thread-local, one per node made): a pack
#: reads it after its node was made and before the op ran, the packs of a later op read a larger
#: one. Without it (an older PyTorch) pending copies wait for the next Python hook, and a
#: forward's rescue moves nothing (rescue.py: every group may still be being written).
_SEQUENCE_NR = getattr(torch._C._autograd, "_get_sequence_nr", None) or (lambda: 0)


def _rebuild_order(group: _Group) -> list[_Group]:
    """``group`` and its recomputed sources without a device tensor, transitively, each once,
    every source before its readers (iterative: a chain may be longer than Python's stack). A
    source read by two of them (a dense block's input, concatenated and also rebuilt through)
    comes before both: a group is placed when its expansion ends, never where first met."""
    order, placed, stack = [], set(), [(group, False)]   # groups hash by identity
    while stack:
        current, expanded = stack.pop()
        if current in placed:
            continue
        if expanded:
            placed.add(current)
            order.append(current)
            continue
        stack.append((current, True))
        for source in current.recipe.sources:
            if source.mode == RECOMPUTE and source.tensor is None and source not in placed:
                stack.append((source, False))
    return order


def recompute(group: _Group) -> torch.Tensor:
    """``group``'s tensor rebuilt by its recipe under ``no_grad``, from its sources' device
    tensors (each kept at the version saved, or itself rebuilt: :func:`_rebuild_order`); a
    call in place never changes a kept tensor (it gets a copy)."""
    recipe = group.recipe
    sources = recipe.sources
    for source in sources:
        # a recomputed source is a new tensor holding the value at the version saved
        held = source.version if source.kept_version is None else source.kept_version
        if source.tensor is None or (source.mode == KEEP and source.tensor._version != held):
            raise RuntimeError(f"mucudnn.torch: source {source.gid} of saved tensor "
                               f"{group.gid} changed after it was saved; cannot recompute it")
    # the sources' tensors and the views of them the recipe reads
    kept = [source.tensor for source in sources]
    values: list[torch.Tensor | None] = []
    last = len(recipe.calls) - 1
    with torch.no_grad():
        for index, (call, slots) in enumerate(zip(recipe.calls, recipe.inputs)):
            inputs = []
            for slot in slots:
                if isinstance(slot, _Group):
                    inputs.append(slot.tensor)
                elif isinstance(slot, _ViewOf):
                    inputs.append(slot.of(slot.group.tensor))
                    kept.append(inputs[-1])
                else:      # read once: the recipe lets go of it (or changes it) here
                    inputs.append(values[slot])
                    values[slot] = None
            # an in-place call changes its first input: never a kept tensor (an Identity
            # passes one on)
            if call.in_place and any(inputs[0] is tensor for tensor in kept):
                inputs[0] = inputs[0].clone()
            values.append(call.run(inputs, recipe.indices and index == last))
    return values[-1] if recipe.view is None else _viewed(values[-1], *recipe.view)


def _transposed_size(module: nn.Module, value: torch.Tensor) -> tuple[int, ...]:
    """The spatial size a transposed convolution makes of ``value`` with its own output padding
    (what it makes unless called with ``output_size``)."""
    n = len(module.kernel_size)
    return tuple((size - 1) * stride - 2 * pad + dilation * (kernel - 1) + extra + 1
                 for size, stride, pad, dilation, kernel, extra in zip(
                     value.shape[-n:], module.stride, module.padding, module.dilation,
                     module.kernel_size, module.output_padding))


def _joined(*values: torch.Tensor, dim: int) -> torch.Tensor:
    """A recorded concatenation's rerun: its operands, one value each, joined again."""
    return torch.cat(values, dim=dim)


def rerun_as_recorded(module: nn.Module, value: torch.Tensor,
                      state: _ModuleState | None = None,
                      output_shape: tuple = (), indices: bool = False) -> torch.Tensor:
    """``module(value)`` as its forward ran (``state``: what it read then; None: the module as it
    is now), without its side effects and without hooks (a recomputable module has none of its
    own; the global ones, a user's activation monitor, see only the user's forward): a
    training-mode batch norm runs on copies of its running statistics (same kernel, same
    output; the model's statistics and batch counter untouched), an eval-mode one on the
    statistics its forward read; the parameters are the tensors the forward read. ``indices``:
    a max pooling (:data:`MAX_POOLS`) gives the indices of its maxima instead, from the kernel
    its forward ran."""
    if state is None:
        state = _ModuleState.of(module)
    state.check()
    saved = {name: module._parameters[name] for name in state.params}
    try:
        module._parameters.update(state.params)
        if isinstance(module, _BATCH_NORMS) and type(module) in CHEAP:
            training = state.training or module.running_mean is None
            if state.running is not None and not training:
                mean, var = state.running
            elif module.running_mean is not None and module.running_var is not None:
                mean, var = module.running_mean.clone(), module.running_var.clone()
            else:
                mean = var = None
            return F.batch_norm(value, mean, var, state.params.get("weight"),
                                state.params.get("bias"), training,
                                module.momentum if module.momentum is not None else 0.0,
                                module.eps)
        if indices:
            pool = MAX_POOLS[type(module)][0]
            return pool(value, module.kernel_size, module.stride, module.padding,
                        module.dilation, ceil_mode=module.ceil_mode, return_indices=True)[1]
        forward = type(module).forward
        if type(module) in _TRANSPOSED and output_shape:
            made = output_shape[-len(module.kernel_size):]
            if _transposed_size(module, value) != made:
                # it was given output_size (its own output_padding makes another size)
                return forward(module, value, output_size=list(made))
        return forward(module, value)
    finally:
        module._parameters.update(saved)

