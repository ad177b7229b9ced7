"""Exceptions. Everything mucudnn raises on purpose derives from :class:`MucudnnError`."""

from __future__ import annotations


class MucudnnError(Exception):
    """Root of every error mucudnn raises on purpose."""


class ConfigError(MucudnnError):
    """A network config (YAML) is malformed; the message names the file, the layer and the field."""


class PlanError(MucudnnError):
    """A plan or record file is malformed; the message names the file and the line."""


class StoreError(MucudnnError):
    """The benchmark store cannot be used (unreadable, wrong schema, ...)."""


class SchemaVersionError(StoreError):
    """The store was written by another schema version of mucudnn."""


class ReadOnlyStoreError(StoreError):
    """A write to a store that cannot be written (opened read-only, a read-only file or
    directory); the message names the store and the reason."""


class UnwritableError(MucudnnError):
    """An output file (a plan, a cache) cannot be written; the message names the path and why."""


class SettingError(MucudnnError):
    """A ``MUCUDNN_*`` environment variable holds a value its setting does not accept; the
    message names the variable, the value and what it accepts."""


class ChangedInPlaceError(MucudnnError, RuntimeError):
    """A tensor that mucudnn.torch must read again in the backward (a recomputed module's
    parameter) was changed in place since the forward: the backward cannot be carried out as
    the forward ran. Worded as PyTorch's own in-place error, which it is a RuntimeError as."""


def inplace_message(tensor, saved_version: int, what: str = "") -> str:
    """PyTorch's own words for a tensor its backward needs that was changed in place since it was
    saved (autograd checks no version where saved-tensor hooks run: mucudnn.torch checks, and
    says it so); ``what`` names the tensor where that helps (a parameter's name)."""
    kind = f"{tensor.device.type} {tensor.dtype}".replace("torch.", "")
    name = f" ({what})" if what else ""
    return ("one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: [{kind} {list(tensor.shape)}]{name} is at version "
            f"{tensor._version}; expected version {saved_version} instead (mucudnn.torch)")


class InfeasibleError(MucudnnError):
    """No plan satisfies the workspace limit or budget."""


class SolverError(MucudnnError):
    """The ILP solver failed or stopped without proving its answer optimal."""


class MissingMeasurementsError(MucudnnError):
    """The store lacks measurements an optimisation needs (run ``mucudnn bench`` first)."""


class SizeError(MucudnnError, ValueError):
    """A byte size such as ``64MiB`` could not be parsed."""


class KeyFormatError(MucudnnError, ValueError):
    """A kernel key string does not follow docs/kernel-key.md."""


class EngineNameError(MucudnnError, ValueError):
    """An engine configuration name does not follow docs/plan-format.md (``eng12.k3=1``)."""


class LibraryNotFoundError(MucudnnError):
    """No usable cuDNN library (or GPU) was found."""


class CudnnError(MucudnnError):
    """A cuDNN call returned a status other than CUDNN_STATUS_SUCCESS.

    One subclass per status family exists (``CudnnNotSupportedError`` ...), so callers can catch
    exactly the statuses they expect (the benchmarker skips NOT_SUPPORTED algorithms).
    """

    status: int = -1

    def __init__(self, call: str, status: int, text: str):
        super().__init__(f"{call} failed: {text} ({status})")
        self.call = call
        self.status = status
        self.text = text


class CudnnBadParamError(CudnnError):
    """CUDNN_STATUS_BAD_PARAM (2000-family)."""


class CudnnNotSupportedError(CudnnError):
    """CUDNN_STATUS_NOT_SUPPORTED (3000-family)."""


class CudnnInternalError(CudnnError):
    """CUDNN_STATUS_INTERNAL_ERROR (4000-family)."""


class CudnnExecutionFailedError(CudnnError):
    """CUDNN_STATUS_EXECUTION_FAILED (5000-family)."""


class CudnnNotInitializedError(CudnnError):
    """CUDNN_STATUS_NOT_INITIALIZED and the rest of the 1000 family (version mismatch, loading...)."""


def cudnn_error_class(status: int) -> type[CudnnError]:
    """The exception class for a cuDNN 9 status code (families are status // 1000)."""
    return {
        1: CudnnNotInitializedError,
        2: CudnnBadParamError,
        3: CudnnNotSupportedError,
        4: CudnnInternalError,
        5: CudnnExecutionFailedError,
    }.get(status // 1000, CudnnError)
