"""The planner in a process of its own (torch-free): a session's :class:`ProcessRunner` hands each
:class:`~.plan_runner.PlanRequest` to a worker process, so that the planner's Python (seconds near
a step's least peak) does not hold the training process's interpreter lock, which every hook of a
step needs: planned on a thread of the training process, a step beside a plan waited for it
(benchmarks/results/plan-accuracy).

Rules:

1. The worker is ``python -m mucudnn.torch.plan_worker``, started at the first request with the
   training process's interpreter. It imports the planner, never torch, and runs no site hook
   of ``mucudnn run`` (the launcher's preload and offload variables are left out of its
   environment): it cannot run the script's ``__main__`` as multiprocessing's spawn would.
2. One request at a time over the worker's stdin and stdout: an 8-byte little-endian length,
   then a pickle. A request goes as (the maker's settings, the profile's token, the request);
   the answer is the :class:`~.plan_runner.PlanResult`, or the exception its making raised.
3. The worker keeps one :class:`~.plan_runner.PlanMaker` per settings, and the profile last
   sent under each token, so that what a maker knows of a profile (the highest target without a
   plan) holds across requests, as it does in-process.
4. What the request carries that is the session's own (a stage candidate's modules) stays in the
   training process: candidates go as their index and come back as the candidate.
5. A worker that cannot start, or fails a request (dies in it, or answers what cannot be read):
   that request and every later one is made on the runner's thread, as
   :class:`~.plan_runner.BackgroundRunner` makes it, with one line. A worker found ended between
   requests is started again. The plans are the same either way (the planner is
   deterministic); only where it runs changes.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from .plan_runner import BackgroundRunner, PlanMaker, PlanRequest, PlanResult, _made

_LENGTH = struct.Struct("<Q")
#: environment variables the worker leaves out: the shim's preload, the launcher's offload
_LEFT_OUT = ("LD_PRELOAD", "MUCUDNN_OFFLOAD", "MUCUDNN_MEMORY_BUDGET")


def _send(stream, value) -> None:
    blob = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(blob)))
    stream.write(blob)
    stream.flush()


def _receive(stream):
    """The next value on ``stream``; EOFError where it ended."""
    header = stream.read(_LENGTH.size)
    if len(header) < _LENGTH.size:
        raise EOFError("the stream ended")
    (size,) = _LENGTH.unpack(header)
    blob = stream.read(size)
    if len(blob) < size:
        raise EOFError("the stream ended inside a value")
    return pickle.loads(blob)


def serve(requests, answers) -> int:
    """The worker's loop (rule 2 and 3) until ``requests`` ends."""
    makers: dict = {}
    profiles: dict = {}
    while True:
        try:
            settings, token, request = _receive(requests)
        except EOFError:
            return 0
        known = profiles.get(token)
        if known is not None and known[0] == request.profile:
            request = replace(request, profile=known[1])
        else:
            profiles[token] = (request.profile, request.profile)
        maker = makers.get(settings)
        if maker is None:
            maker = makers[settings] = PlanMaker(*settings)
        made = _made(request, maker)
        try:
            _send(answers, made)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _send(answers, RuntimeError(f"the planner's answer could not be sent back: {exc}"))


class ProcessRunner(BackgroundRunner):
    """:class:`BackgroundRunner` whose thread hands each request to the worker process (module
    docstring) and waits for its answer, the interpreter lock free meanwhile."""

    def __init__(self, name: str = "mucudnn-planner", say=None):
        super().__init__(name)
        self._worker: subprocess.Popen | None = None
        #: set once the worker failed (rule 5): requests are made on the thread from then on
        self.failed: str | None = None
        #: where the one line saying so goes (the session's ``say``; called on the runner's
        #: thread)
        self.say = say or (lambda text: None)

    def _make(self, request: PlanRequest, work) -> PlanResult | BaseException:
        if self.failed is None and isinstance(work, PlanMaker):
            try:
                return self._remote(request, work)
            except Exception as exc:   # noqa: BLE001 - rule 5: the thread makes it instead
                self.failed = f"{type(exc).__name__}: {exc}"
                self.close()
                self.say(f"the offload planner's worker process failed ({self.failed}); plans "
                         "are made on a thread of the training process from now on")
        return _made(request, work)

    def warm(self) -> None:
        """The worker started now, ahead of the first request (its interpreter and the planner's
        imports take a few tenths of a second on a GPU machine, while a recording step runs);
        a worker that cannot start is left to the first request (rule 5)."""
        if self.failed is None:
            try:
                self._start()
            except Exception:   # noqa: BLE001 - the first request says it, then plans inline
                self._worker = None

    def _remote(self, request: PlanRequest, maker: PlanMaker) -> PlanResult | BaseException:
        worker = self._start()
        candidates = request.candidates
        sent = replace(request, candidates=tuple(replace(c, payload=index)
                                                  for index, c in enumerate(candidates)))
        settings = (maker.lookahead, maker.time_limit_s, maker.method)
        _send(worker.stdin, (settings, id(request.profile), sent))
        made = _receive(worker.stdout)
        if isinstance(made, BaseException):
            return made
        if made.stage is not None:   # rule 4: the session's own candidate, its chunks as made
            made = replace(made, stage=replace(candidates[made.stage.payload],
                                               stage=made.stage.stage))
        if made.profile is not None and made.profile == request.profile:
            made = replace(made, profile=request.profile)   # the one the session holds
        return replace(made, request=request)

    def _start(self) -> subprocess.Popen:
        if self._worker is not None and self._worker.poll() is None:
            return self._worker
        package_root = str(Path(__file__).resolve().parents[2])
        env = {key: value for key, value in os.environ.items() if key not in _LEFT_OUT}
        env["PYTHONPATH"] = os.pathsep.join(
            [package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self._worker = subprocess.Popen(
            [sys.executable, "-m", "mucudnn.torch.plan_worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
        return self._worker

    def close(self) -> None:
        """The worker told to end (its stdin closed) and waited for briefly."""
        worker, self._worker = self._worker, None
        if worker is None:
            return
        try:
            worker.stdin.close()
            worker.wait(timeout=5)
        except Exception:   # noqa: BLE001 - it is ended either way
            worker.kill()

    def __del__(self):
        try:
            self.close()
        except Exception:   # noqa: BLE001 - at interpreter exit
            pass


if __name__ == "__main__":
    sys.exit(serve(sys.stdin.buffer, sys.stdout.buffer))
