"""One worker of benchmarking spread over several GPUs (:mod:`mucudnn.multigpu` starts it as
``python -m mucudnn.bench_worker JOB``, with ``CUDA_VISIBLE_DEVICES`` naming its one GPU): it
measures the job file's kernels with :func:`mucudnn.tuner.benchmark` and reports on its stdout in
:class:`~mucudnn.multigpu.EventLines`.

Its own module, so that the tuner, which starts the spreading, and the worker, which calls the
tuner, do not import each other through :mod:`mucudnn.multigpu`.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from . import tuner
from .errors import MucudnnError
from .multigpu import EventLines
from .problem import ConvProblem
from .timing import TimingMethod


def main(argv: Sequence[str]) -> int:
    """Measure the job file's kernels on the one GPU this process sees."""
    job = json.loads(Path(argv[0]).read_text())
    kernels = [ConvProblem.from_key(key, n) for key, n in job.pop("kernels")]
    method = TimingMethod(**job.pop("method"))
    events = EventLines(sys.stdout)
    try:
        timed = tuner.benchmark(kernels, method=method, progress=False, gpus=[0], events=events,
                                **job)
    except MucudnnError as exc:
        print(f"mucudnn: error: GPU {os.environ.get('CUDA_VISIBLE_DEVICES', '?')}: {exc}",
              file=sys.stderr)
        return 2
    events("timed", timed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
