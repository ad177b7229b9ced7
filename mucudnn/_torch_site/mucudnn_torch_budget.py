"""The memory budget inside one Python process: PyTorch's caching allocator on every visible GPU
is limited to ``MUCUDNN_MEMORY_BUDGET``, a size as docs/sizes.md writes them (docs/shim.md,
"Environment": "Memory budget").

Standard library only: this file runs in the program's own interpreter, through the
``sitecustomize.py`` beside it (the directory ``mucudnn run --memory-budget`` puts first on
PYTHONPATH), and that interpreter need not have mucudnn installed. :mod:`mucudnn.budget` loads the
same file for in-process use, under the same module name, so a process holds one copy. The
variables' names are in ``mucudnn_torch_env.py`` beside it, which mucudnn imports too.

Invariant: nothing here initialises CUDA. The budget is a call queued with
``torch.cuda._lazy_call``, which PyTorch runs inside its lazy initialisation (the first CUDA use),
after the driver is set up and before the caching allocator's first allocation; when CUDA is
already initialised, ``_lazy_call`` runs it at once. A failure in that call is one warning line
and the program goes on unlimited: raised there, it would surface as PyTorch's
``DeferredCudaCallError`` traceback at some unrelated first CUDA call.
"""

from __future__ import annotations

import os
import sys

# The variables' names, shared with mucudnn: this directory is on sys.path in a launched process;
# loaded in-process by mucudnn.budget it is not, and the mucudnn package is importable instead.
try:
    from mucudnn_torch_env import (ENV_BUDGET, ENV_LOG_LEVEL, ENV_OFFLOAD, ENV_OFFLOAD_FREEZE_GC,
                                   ENV_OFFLOAD_HEADROOM, ENV_OFFLOAD_LEND, ENV_OFFLOAD_PROFILE,
                                   ENV_OFFLOAD_REPLAY, ENV_OFFLOAD_RESCUE,
                                   ENV_OFFLOAD_STAND_ASIDE, ENV_PINNED_REGISTER, ENV_REPORT,
                                   MAX_OFFLOAD_HEADROOM)
except ImportError:
    from mucudnn._torch_site.mucudnn_torch_env import (ENV_BUDGET, ENV_LOG_LEVEL, ENV_OFFLOAD,
                                                       ENV_OFFLOAD_FREEZE_GC,
                                                       ENV_OFFLOAD_HEADROOM, ENV_OFFLOAD_LEND,
                                                       ENV_OFFLOAD_PROFILE,
                                                       ENV_OFFLOAD_REPLAY,
                                                       ENV_OFFLOAD_RESCUE,
                                                       ENV_OFFLOAD_STAND_ASIDE,
                                                       ENV_PINNED_REGISTER, ENV_REPORT,
                                                       MAX_OFFLOAD_HEADROOM)
_LEVELS = {"error": 0, "warning": 1, "info": 2, "debug": 3, "0": 0, "1": 1, "2": 2, "3": 3}


def say(level: str, text: str) -> None:
    """One line on stderr in the shim's format; info only at MUCUDNN_LOG_LEVEL info or debug."""
    wanted = _LEVELS.get(os.environ.get(ENV_LOG_LEVEL, "warning").strip().lower(), 1)
    if _LEVELS[level] > wanted:
        return
    try:
        sys.stderr.write(f"mucudnn: {level}: {text}\n")
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):  # no usable stderr: nothing to tell
        pass


def gib(nbytes: int | float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def report(event: str, detail: str = "") -> None:
    """Appends ``EVENT PID DETAIL`` to the launcher's report file, if there is one (one write of
    one short line with O_APPEND: lines of concurrent processes do not interleave)."""
    path = os.environ.get(ENV_REPORT)
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{event} {os.getpid()} {detail}".rstrip().encode() + b"\n")
        finally:
            os.close(fd)
    except OSError:
        pass


class BudgetTooLarge(ValueError):
    """The budget is more than a device's memory: nothing was limited."""


def apply_budget(torch, budget: int) -> list[tuple[int, float]]:
    """Limits the caching allocator of every device PyTorch sees to ``budget`` bytes:
    ``set_per_process_memory_fraction(budget / total_memory, device)``. Checks every device
    before limiting any; :class:`BudgetTooLarge` names the first device smaller than the budget.
    Initialises CUDA (through PyTorch) if it is not yet: call it queued, or in-process."""
    cuda = torch.cuda
    fractions = []
    for device in range(cuda.device_count()):
        props = cuda.get_device_properties(device)
        total = int(props.total_memory)
        if budget > total:
            raise BudgetTooLarge(
                f"memory budget {gib(budget)} is more than GPU {device}'s memory "
                f"({getattr(props, 'name', 'unnamed')}, {gib(total)})")
        fractions.append((device, budget / total))
    for device, fraction in fractions:
        cuda.set_per_process_memory_fraction(fraction, device)
    return fractions


class LazyBudget:
    """The budget queued for PyTorch's CUDA initialisation; :meth:`cancel` makes it a no-op."""

    def __init__(self, torch, budget: int):
        self.torch, self.budget = torch, budget
        self.active = True
        self.applied: list[tuple[int, float]] = []

    def __call__(self) -> None:
        if not self.active:
            return
        try:
            self.applied = apply_budget(self.torch, self.budget)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            say("warning", f"{exc}; PyTorch's memory is not limited")
            report("failed", str(exc).replace("\n", " "))
            return
        for device, fraction in self.applied:
            say("info", f"memory budget {gib(self.budget)}: PyTorch's caching allocator on GPU "
                        f"{device} limited to {fraction:.4f} of its memory")
            report("applied", f"{device} {fraction!r}")

    def cancel(self) -> None:
        self.active = False


def apply_lazily(torch, budget: int) -> LazyBudget:
    """Queues the budget with ``torch.cuda._lazy_call`` (runs now if CUDA is initialised)."""
    call = LazyBudget(torch, budget)
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None:
        say("warning", "this PyTorch has no torch.cuda._lazy_call; its memory is not limited")
        report("failed", "no torch.cuda._lazy_call")
        call.cancel()
        return call
    lazy_call(call)
    return call


class _ThenCall:
    """A module loader that runs ``callback(module)`` once the module has executed."""

    def __init__(self, loader, callback):
        self._loader, self._callback = loader, callback

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        # the module keeps its real loader: code that inspects __loader__ sees no difference
        module.__loader__ = self._loader
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        self._callback(module)

    def __getattr__(self, name):  # resource readers, is_package, ...: the real loader's
        return getattr(self._loader, name)


class AfterImport:
    """A meta path finder that makes the import of ``name`` call ``callback(module)`` after the
    module's own code has run (once). It finds nothing itself: it asks the finders after it."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback
        self._busy = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self._busy:
            return None
        self._busy = True
        try:
            for finder in list(sys.meta_path):
                find = getattr(finder, "find_spec", None)
                if finder is self or find is None:
                    continue
                spec = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None  # not installed: the import fails as it would without us
        finally:
            self._busy = False
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        self.uninstall()
        spec.loader = _ThenCall(spec.loader, self.callback)
        return spec

    def uninstall(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def after_import(name: str, callback) -> None:
    """``callback(module)`` once ``name`` is imported: now if it already is."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    sys.meta_path.insert(0, AfterImport(name, callback))


# -- sizes: the grammar of docs/sizes.md --------------------------------------------------------
# This file cannot import mucudnn (the program's interpreter need not have it, and start-up stays
# cheap), so it reads sizes itself: the same grammar as mucudnn.sizes.parse_size and the shim's
# mu_parse_size (shim/src/options.c), checked against the same vectors (tests/data/sizes.txt, by
# tests/test_torch_site_sizes.py). ASCII only, exact integer arithmetic, no float anywhere.

SIZE_MAX = (1 << 63) - 1
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_BLANKS = " \t\n\r\f\v"
SIZE_FORM = "bytes, or a number with B, KiB, MiB, GiB, TiB, KB, MB, GB or TB, e.g. 6GiB"


class SizeProblem(ValueError):
    """Not a size: ``kind`` is ``syntax``, ``ambiguous`` (a bare K, M, G or T) or ``range``
    (more than 2^63-1 bytes), as in tests/data/sizes.txt; the message says what is wrong."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _digits(text: str) -> bool:
    return bool(text) and all("0" <= c <= "9" for c in text)


def _int(digits: str) -> int:
    """``int(digits)`` for any number of ASCII digits (Python converts at most 4300 at once)."""
    value = 0
    for start in range(0, len(digits), 4000):
        chunk = digits[start:start + 4000]
        value = value * 10 ** len(chunk) + int(chunk)
    return value


def parse_size(text: str) -> int:
    """Bytes for ``text`` in the grammar of docs/sizes.md (``6GiB``, ``5.6GiB`` floored to whole
    bytes, ``6442450944``); :class:`SizeProblem` otherwise."""
    body = text.strip(_SIZE_BLANKS)
    number = body.rstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
    unit = body[len(number):]
    number = number.rstrip(_SIZE_BLANKS)
    whole, point, fraction = number.partition(".")
    if not _digits(whole) or (point and not _digits(fraction)):
        raise SizeProblem("syntax", "not a size")
    if unit.lower() not in _SIZE_UNITS:
        if unit.lower() in ("k", "m", "g", "t"):
            upper = unit.upper()
            raise SizeProblem("ambiguous", f"a bare {unit} is ambiguous: write {number}{upper}iB "
                                           f"(powers of 2) or {number}{upper}B (powers of 10)")
        raise SizeProblem("syntax", "not a size")
    factor = _SIZE_UNITS[unit.lower()]
    value = _int(whole) * factor + (_int(fraction) * factor // 10 ** len(fraction) if point else 0)
    if value > SIZE_MAX:
        raise SizeProblem("range", "more than 2^63-1 bytes")
    return value


def read_budget(text: str | None) -> int | None:
    """The budget in ``MUCUDNN_MEMORY_BUDGET``: a size (docs/sizes.md) as the shim reads it, so
    ``6GiB`` set by hand limits PyTorch as it limits the shim (the launcher writes bytes); None
    when unset or blank. Not a size, or 0 bytes: one warning line naming the variable and what
    it takes, and None (PyTorch is not limited; never an exception in the program)."""
    if text is None or not text.strip(_SIZE_BLANKS):
        return None
    try:
        budget = parse_size(text)
    except SizeProblem as exc:
        problem = f"is not a size ({f'expected {SIZE_FORM}' if exc.kind == 'syntax' else exc})"
    else:
        if budget > 0:
            return budget
        problem = "is not more than 0 bytes"
    say("warning", f"{ENV_BUDGET}={text!r} {problem}; PyTorch's memory is not limited")
    report("failed", f"malformed {ENV_BUDGET}")
    return None


#: the most threads that page-lock a block of pinned host memory (PyTorch's
#: ``pinned_num_register_threads``: a power of two, at most 128); each locks its share of the
#: block's pages, so a recording step's host pool (every saved tensor's bytes) is pinned in a
#: fraction of one thread's time (benchmarks/results/plan-accuracy, ``h200-pinned/``)
PINNED_REGISTER_THREADS = 16
#: the first PyTorch whose allocator configuration knows ``pinned_use_cuda_host_register`` (an
#: older one refuses the key at its first CUDA allocation)
PINNED_REGISTER_SINCE = (2, 2)
_PINNED_KEY = "pinned_use_cuda_host_register"


def pinned_register_conf(conf: str, torch_release: tuple | None, cpus: int | None) -> str | None:
    """``conf`` (PyTorch's allocator configuration) with pinned host memory page-locked by
    ``cudaHostRegister`` on a power of two of threads, at most :data:`PINNED_REGISTER_THREADS`
    and ``cpus``, in place of one ``cudaHostAlloc``; None where it stays as it is: it names a
    pinned option already, or the program's PyTorch (``torch_release``, (major, minor)) is not
    known to have them."""
    if torch_release is None or tuple(torch_release) < PINNED_REGISTER_SINCE or \
            _PINNED_KEY in conf:
        return None
    threads = 1
    while threads * 2 <= min(PINNED_REGISTER_THREADS, max(1, cpus or 1)):
        threads *= 2
    keys = f"{_PINNED_KEY}:True,pinned_num_register_threads:{threads}"
    return f"{conf},{keys}" if conf.strip() else keys


def torch_release() -> tuple | None:
    """(major, minor) of the PyTorch this interpreter would import, from its distribution's
    metadata (torch itself not imported); None where there is none or it is unreadable."""
    import importlib.metadata
    import re
    try:
        found = re.match(r"(\d+)\.(\d+)", importlib.metadata.version("torch"))
    except Exception:  # noqa: BLE001 - not installed, or metadata unreadable: not known
        return None
    return (int(found.group(1)), int(found.group(2))) if found else None


def register_pinned_from_environment() -> None:
    """Where the launcher configured the allocator under ``--offload``
    (``MUCUDNN_PINNED_REGISTER=1``): :func:`pinned_register_conf` into
    ``PYTORCH_CUDA_ALLOC_CONF``, before the program imports torch (PyTorch reads it once)."""
    if not pinned_register(os.environ.get(ENV_PINNED_REGISTER)):
        return
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count()
    conf = pinned_register_conf(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), torch_release(),
                                cpus)
    if conf is not None:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
        say("info", f"pinned host memory page-locked on threads: PYTORCH_CUDA_ALLOC_CONF={conf}")


def install_from_environment() -> None:
    """What sitecustomize runs: the budget of the environment, applied once torch is imported."""
    budget = read_budget(os.environ.get(ENV_BUDGET))
    if budget is None:
        return
    try:
        register_pinned_from_environment()
    except Exception as exc:  # noqa: BLE001 - pinning then goes as PyTorch's default has it
        say("warning", f"pinned host memory left to PyTorch's default: {exc}")

    def on_torch(torch) -> None:
        report("torch")
        try:
            apply_lazily(torch, budget)
        except Exception as exc:  # noqa: BLE001 - never break the program's `import torch`
            say("warning", f"memory budget not queued: {exc}; PyTorch's memory is not limited")
            report("failed", str(exc).replace("\n", " "))
        try:
            tell_shim_allocator(torch)
        except Exception as exc:  # noqa: BLE001 - the room then errs on the small side, as before
            say("warning", f"the shim is not told what PyTorch's caching allocator holds: {exc}")
        recompute = offload_recompute(os.environ.get(ENV_OFFLOAD))
        if recompute is not None:
            start_offload(budget, recompute_convolutions=recompute == "all")
        if os.environ.get(ENV_REPORT):
            import atexit
            atexit.register(report_peak, torch)

    after_import("torch", on_torch)


_ALLOCATOR_FN = None  # the function the shim holds: alive as long as the process


def tell_shim_allocator(torch, library=None) -> bool:
    """Registers with the shim, where it is preloaded (``library``: this process's symbols by
    default), a function saying what PyTorch's caching allocator holds (reserved) and uses
    (allocated) on the current device. The shim's room then counts what the cache holds free as
    free (PyTorch hands it out first, and releases it to retry a failed allocation) and reads the
    budget as the allocator's, as ``set_per_process_memory_fraction`` applies it: the budget less
    what is allocated, not less the CUDA context too (docs/shim.md, "The room"). Without it the
    room refused engines that fit: on r3d_18 under a 5.75 GiB budget the shim ran 485 ms a step
    where PyTorch ran 94. False where there is no shim. Unregistered at exit, before the
    interpreter goes."""
    global _ALLOCATOR_FN
    import ctypes
    try:
        setter = getattr(library if library is not None else ctypes.CDLL(None),
                         "mucudnn_set_allocator")
    except (OSError, AttributeError):
        return False
    cuda = torch.cuda

    def allocator(reserved, allocated) -> int:  # called by the shim from any thread: never raises
        try:
            if not cuda.is_initialized():
                return 1
            stats = cuda.memory_stats_as_nested_dict(cuda.current_device())
            reserved[0] = int(stats["reserved_bytes"]["all"]["current"])
            allocated[0] = int(stats["allocated_bytes"]["all"]["current"])
            return 0
        except BaseException:  # noqa: BLE001 - an exception cannot cross into C
            return 1

    size_p = ctypes.POINTER(ctypes.c_size_t)
    kind = ctypes.CFUNCTYPE(ctypes.c_int, size_p, size_p)
    _ALLOCATOR_FN = kind(allocator)
    setter.argtypes, setter.restype = [kind], None
    setter(_ALLOCATOR_FN)
    import atexit
    atexit.register(setter, kind())  # NULL: no call into Python once it is shutting down
    say("info", "the shim's room reads PyTorch's caching allocator (its budget, its free cache)")
    return True


def report_peak(torch) -> None:
    """At exit: ``peak DEVICE BYTES``, PyTorch's peak reserved memory on each device it used
    (``mucudnn batch-size`` reads it). Nothing when CUDA never started."""
    try:
        if not torch.cuda.is_initialized():
            return
        for device in range(torch.cuda.device_count()):
            report("peak", f"{device} {int(torch.cuda.max_memory_reserved(device))}")
    except Exception:  # noqa: BLE001 - at exit, nothing to tell
        pass


#: MUCUDNN_OFFLOAD's values that start offload: what may be recomputed
OFFLOAD_VALUES = {"1": "all", "true": "all", "yes": "all", "on": "all", "cheap": "cheap"}


def offload_recompute(value: str | None) -> str | None:
    """What ``MUCUDNN_OFFLOAD`` asks: None (no offload: unset, empty, 0), ``"all"`` (convolutions
    may be recomputed too) or ``"cheap"`` (only cheap modules and adds). Another value: one
    warning line naming it, and no offload."""
    text = (value or "").strip().lower()
    if text in ("", "0", "false", "no", "off"):
        return None
    if text not in OFFLOAD_VALUES:
        say("warning", f"{ENV_OFFLOAD}={value!r} is not one of 0, 1 or cheap; activation "
                       "offload not started")
        return None
    return OFFLOAD_VALUES[text]


def offload_headroom(value: str | None) -> float | None:
    """``MUCUDNN_OFFLOAD_HEADROOM``, a whole percent from 0 to :data:`MAX_OFFLOAD_HEADROOM`, as a
    fraction: what plans leave of the budget for the caching allocator's fragmentation. None
    where unset or empty (the session's default); another value: one warning line, and None."""
    text = (value or "").strip()
    if not text:
        return None
    if text.isascii() and text.isdigit() and int(text) <= MAX_OFFLOAD_HEADROOM:
        return int(text) / 100
    say("warning", f"{ENV_OFFLOAD_HEADROOM}={value!r} is not a whole percent from 0 to "
                   f"{MAX_OFFLOAD_HEADROOM}; plans keep the default headroom")
    return None


#: MUCUDNN_OFFLOAD_FREEZE_GC's words (the shim's booleans)
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def _switch(variable: str, value: str | None, default: str, more: tuple = (),
            on: bool = True) -> bool | str:
    """An on/off setting whose default is ``on``: that unset or empty, True a true word, False a
    false word, a word of ``more`` itself; another value: one warning line saying ``default``,
    and ``on``."""
    text = (value or "").strip().lower()
    if not text:
        return on
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    if text in more:
        return text
    words = ("1/0", "true/false", "yes/no", "on/off") + more
    say("warning", f"{variable}={value!r} is not one of {', '.join(words[:-1])} or "
                   f"{words[-1]}; {default}")
    return on


def offload_freeze_gc(value: str | None) -> bool:
    """``MUCUDNN_OFFLOAD_FREEZE_GC``: whether the process-wide session freezes Python's garbage
    collector's older objects when its first plan takes over (default yes). Another value: one
    warning line, and the default."""
    return _switch(ENV_OFFLOAD_FREEZE_GC, value,
                   "the collector is frozen at the first plan (the default)")


def offload_rescue(value: str | None) -> bool | str:
    """``MUCUDNN_OFFLOAD_RESCUE``: whether the process-wide session runs again an op the caching
    allocator refused in a plan's first steps (default yes: ``OffloadSession(rescue=True)``),
    in every planned step (``always``) or never (a false word). Another value: one warning
    line, and the default."""
    return _switch(ENV_OFFLOAD_RESCUE, value, "an op refused in a plan's first steps is run "
                   "again (the default)", more=("always",))


def offload_lend(value: str | None) -> bool:
    """``MUCUDNN_OFFLOAD_LEND``: whether the process-wide session lends the shim workspace where
    its plan leaves room (default no: ``OffloadSession(lend=False)``, mucudnn/torch/lend.py).
    Another value: one warning line, and the default."""
    return _switch(ENV_OFFLOAD_LEND, value, "no workspace is lent (the default)", on=False)


def offload_stand_aside(value: str | None) -> bool:
    """``MUCUDNN_OFFLOAD_STAND_ASIDE``: whether the process-wide session removes its hooks while a
    plan that keeps every saved tensor runs settled (default yes:
    ``OffloadSession(stand_aside=True)``, mucudnn/torch/aside.py). Another value: one warning
    line, and the default."""
    return _switch(ENV_OFFLOAD_STAND_ASIDE, value,
                   "the session stands aside under a plan that keeps everything (the default)")


def offload_replay(value: str | None) -> bool:
    """``MUCUDNN_OFFLOAD_REPLAY``: whether the process-wide session's steady planned steps check
    their recipes against autograd's graph instead of recording their calls (default yes:
    ``OffloadSession(replay=True)``, mucudnn/torch/replay.py). Another value: one warning line,
    and the default."""
    return _switch(ENV_OFFLOAD_REPLAY, value,
                   "steady planned steps replay their recipes from the graph (the default)")


def pinned_register(value: str | None) -> bool:
    """``MUCUDNN_PINNED_REGISTER``: whether :func:`register_pinned_from_environment` adds
    PyTorch's pinned host-register options (default no; ``mucudnn run --offload`` sets 1 where
    it configured the allocator itself). Another value: one warning line, and the default."""
    return _switch(ENV_PINNED_REGISTER, value,
                   "pinned host memory as PyTorch's default pins it", on=False)


def start_offload(budget: int, recompute_convolutions: bool = True) -> None:
    """Enters one :class:`mucudnn.torch.offload_session.OffloadSession` for the whole process (never
    left): every forward's saved tensors are kept, offloaded or recomputed under ``budget``.
    Needs mucudnn importable here (the launcher puts it on PYTHONPATH); without it, one warning
    line and the program runs without offload."""
    try:
        from mucudnn.torch.offload_session import OffloadSession
        headroom = offload_headroom(os.environ.get(ENV_OFFLOAD_HEADROOM))
        session = OffloadSession(budget, say=lambda text: say("info", text), strict=False,
                                 warn=lambda text: say("warning", text),
                                 recompute_convolutions=recompute_convolutions,
                                 profile_to=os.environ.get(ENV_OFFLOAD_PROFILE) or None,
                                 freeze_gc=offload_freeze_gc(
                                     os.environ.get(ENV_OFFLOAD_FREEZE_GC)),
                                 rescue=offload_rescue(os.environ.get(ENV_OFFLOAD_RESCUE)),
                                 lend=offload_lend(os.environ.get(ENV_OFFLOAD_LEND)),
                                 stand_aside=offload_stand_aside(
                                     os.environ.get(ENV_OFFLOAD_STAND_ASIDE)),
                                 replay=offload_replay(os.environ.get(ENV_OFFLOAD_REPLAY)),
                                 **({} if headroom is None else {"headroom": headroom}))
        session.__enter__()
    except Exception as exc:  # noqa: BLE001 - never break the program's `import torch`
        say("warning", f"activation offload not started: {exc}")
        report("failed", f"offload {exc}".replace("\n", " "))
        return
    sys.excepthook = out_of_memory_hook(session, sys.excepthook)
    report("offload")


def out_of_memory_hook(session, previous):
    """``sys.excepthook`` for a process under offload: a script that dies of PyTorch's
    ``OutOfMemoryError`` gets one error line from the session first (what it ran the step as,
    under which budget: :meth:`~mucudnn.torch.session_plans.PlanLifecycle.script_ran_out_of_memory`,
    which also keeps a budget the step did not fit with everything offloaded for later runs),
    then ``previous`` prints the traceback as ever. Nothing of the session's own may stop that."""
    def hook(kind, value, traceback):
        try:
            out_of_memory = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
            if out_of_memory is not None and issubclass(kind, out_of_memory):
                line = session.script_ran_out_of_memory()
                if line:
                    say("error", line)
        except Exception:  # noqa: BLE001 - the script's own error is what matters here
            pass
        previous(kind, value, traceback)
    return hook
