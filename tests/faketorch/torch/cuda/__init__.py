"""torch.cuda as far as the memory budget sees it, following PyTorch's own lazy initialisation:
``_lazy_call`` queues a call until ``_lazy_init`` (the first CUDA use) runs the queue, wrapping a
failure in ``DeferredCudaCallError``; ``get_device_properties`` and
``set_per_process_memory_fraction`` initialise CUDA first, as PyTorch's do.

The devices are ``$FAKE_TORCH_DEVICES`` (comma-separated total bytes; empty: none); every
initialisation and limit is appended as a JSON line to ``$FAKE_TORCH_LOG``.
"""

import json
import os
import threading
import traceback
from types import SimpleNamespace

_initialized = False
_queued_calls = []
_tls = threading.local()
_fractions = {}


class DeferredCudaCallError(Exception):
    pass


def _log(**event):
    with open(os.environ["FAKE_TORCH_LOG"], "a") as log:
        log.write(json.dumps(event) + "\n")


def _totals():
    text = os.environ.get("FAKE_TORCH_DEVICES", "")
    return [int(part) for part in text.split(",") if part]


def is_initialized():
    return _initialized


def _lazy_call(callable, **kwargs):
    if is_initialized():
        callable()
    else:
        _queued_calls.append((callable, traceback.format_stack()))


def _lazy_init():
    global _initialized
    if is_initialized() or hasattr(_tls, "is_initializing"):
        return
    if not _totals():
        raise RuntimeError("Found no NVIDIA driver on your system.")
    _log(event="init")
    _tls.is_initializing = True
    try:
        for queued_call, orig_traceback in _queued_calls:
            try:
                queued_call()
            except Exception as e:
                raise DeferredCudaCallError(f"CUDA call failed lazily at initialization with "
                                            f"error: {e}\n\n{''.join(orig_traceback)}") from e
    finally:
        delattr(_tls, "is_initializing")
    _initialized = True


def init():
    _lazy_init()


def device_count():
    return len(_totals())  # as PyTorch's, through NVML: no initialisation


def is_available():
    return device_count() > 0


def get_device_properties(device):
    _lazy_init()
    return SimpleNamespace(name=f"Fake GPU {device}", total_memory=_totals()[device])


def set_per_process_memory_fraction(fraction, device=None):
    _lazy_init()
    if not isinstance(fraction, float):
        raise TypeError("Invalid type for fraction argument, must be `float`")
    if fraction < 0 or fraction > 1:
        raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
    device = 0 if device is None else device
    _fractions[device] = fraction
    _log(event="fraction", device=device, fraction=fraction)


def get_per_process_memory_fraction(device=None):
    _lazy_init()
    return _fractions.get(0 if device is None else device, 1.0)
