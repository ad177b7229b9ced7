"""Output files that never destroy inputs: one check before a command runs, one atomic writer.

Every command that writes a file (``tune -o``, ``autotune -o``) first refuses an output path that
is one of its inputs (config, store, recording, plan), then writes the output to a temporary file
in the same directory and renames it over the target only at the end, so a failed command leaves
the old file as it was and a reader never sees half a file.
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
