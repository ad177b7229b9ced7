"""Output files that never destroy inputs: one check before a command runs, one atomic writer.

Every command that writes a file (``tune -o``, ``autotune -o``, ``record -o``, ``store export``)
first refuses an output path that is one of its inputs (config, store, recording, plan) or that
holds a file of another kind than it writes (:func:`refuse_other_kind`); a plan is then written
to a temporary file in the same directory and renamed over the target only at the end, so a
failed command leaves the old file as it was and a reader never sees half a file.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable

from .errors import MucudnnError


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name one file: the same inode where both exist (hard links, symlinks),
    else the same resolved path."""
    a, b = Path(a).expanduser(), Path(b).expanduser()
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def refuse_inputs_as_output(output: str | os.PathLike,
                            inputs: Iterable[tuple[str, str | os.PathLike | None]],
                            option: str = "-o") -> None:
    """Raise :class:`MucudnnError` when ``output`` is one of ``inputs`` (``(what, path)`` pairs,
    ``path`` None where the command has no such input)."""
    for what, path in inputs:
        if path is not None and same_file(output, path):
            raise MucudnnError(f"{option} {output} is the {what} this command reads ({path}): "
                               "give another output path")


#: What :func:`file_kind` names, each with its article.
PLAN, RECORDING, STORE, EXPORT, CONFIG = ("a plan", "a recording", "a benchmark store",
                                          "a CSV export of a store", "a network config")
_OTHER = "a file of another kind"


def file_kind(path: str | os.PathLike) -> str | None:
    """What the file at ``path`` holds, as its first bytes tell: :data:`PLAN`, :data:`RECORDING`,
    :data:`STORE`, :data:`EXPORT`, :data:`CONFIG` (by its ``.yaml``/``.yml`` name) or another
    kind; None where there is no file or an empty one (any command may write there)."""
    import gzip

    from .store import CSV_COLUMNS
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as raw:
            head = raw.read(1 << 16)
        if head[:2] == b"\x1f\x8b":  # a gzip-compressed export
            with gzip.open(path, "rb") as unpacked:
                head = unpacked.read(1 << 16)
    except (OSError, EOFError):  # no file, a directory, a truncated gzip: nothing to keep apart
        return None if not path.is_file() else _OTHER
    if not head:
        return None
    if head.startswith(b"SQLite format 3\0"):
        return STORE
    lines = head.decode("utf-8", errors="replace").splitlines()
    if lines[0] == ",".join(CSV_COLUMNS):
        return EXPORT
    content = [line for line in lines if line.strip() and not line.startswith("#")]
    if content[:1] and content[0].split()[:1] == ["mucudnn-plan"]:
        return PLAN
    if (content[:1] and content[0].split()[:1] in (["kernel"], ["calls"])) or \
            (not content and lines[0].startswith("# mucudnn-record ")):
        return RECORDING
    if path.suffix in (".yaml", ".yml"):
        return CONFIG
    return _OTHER


def refuse_other_kind(output: str | os.PathLike, kind: str, option: str = "-o",
                      appends: bool = False) -> None:
    """Raise :class:`MucudnnError` when ``output`` holds something other than ``kind`` (one of
    :func:`file_kind`'s names): a command writes, or with ``appends`` appends, only onto its
    own kind of file (or a new or empty one)."""
    found = file_kind(output)
    if found not in (None, kind):
        raise MucudnnError(f"{option} {output} is {found}, not {kind}: not "
                           f"{'appending to' if appends else 'overwriting'} it; give another path")


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path``: a temporary file beside it, flushed to disk, renamed over it.

    The rename is atomic within one file system, so ``path`` holds either its old content or all
    of the new; the temporary file is removed when anything fails."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    """The process's umask (mkstemp creates 0600 files; outputs get the usual mode)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask
