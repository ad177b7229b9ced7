"""benchmarks/shim_pytorch.py's worker commands: which shim mode each run asks `mucudnn run` for."""

import pytest

from benchmarks.shim_pytorch import trace_summary, worker_command


def _shim_arguments(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("-m") + 2:cmd.index("--")]


@pytest.mark.parametrize("kwargs, expected", [
    ({}, ["run", "--no-online"]),                       # the shim's overhead: a passthrough
    ({"online": True}, ["run"]),                        # zero set-up: `mucudnn run` tunes online
    ({"plan": "p.plan"}, ["run", "--plan", "p.plan"]),  # a plan: never online
    ({"record": "r.rec"}, ["record", "-o", "r.rec"]),
])
def test_a_run_without_a_plan_passes_through_unless_it_asks_for_online_tuning(kwargs, expected):
    cmd, _ = worker_command("resnet50", {}, tf32=True, shim=True, **kwargs)
    assert _shim_arguments(cmd) == expected


def test_an_offload_run_goes_through_the_clis_memory_budget_and_offload():
    cmd, _ = worker_command("r3d_18", {}, tf32=True, shim=True, online=True,
                            memory_budget=5 * 2**30, offload=True)
    assert _shim_arguments(cmd) == ["run", "--memory-budget", str(5 * 2**30), "--offload"]
    cmd, _ = worker_command("r3d_18", {}, tf32=True, shim=True, online=True, memory_budget=2**30)
    assert _shim_arguments(cmd) == ["run", "--memory-budget", str(2**30)]
    for kwargs in ({"shim": True}, {"shim": False, "memory_budget": 2**30},
                   {"shim": True, "memory_budget": 2**30, "record": "r.rec"}):
        with pytest.raises(ValueError, match="offload needs"):  # the CLI would refuse them
            worker_command("r3d_18", {}, tf32=True, offload=True, **kwargs)


def test_plain_pytorch_runs_without_mucudnn():
    cmd, _ = worker_command("resnet50", {}, tf32=True, shim=False)
    assert "mucudnn" not in cmd and "--" not in cmd


def test_segment_summary_counts_each_segments_free_blocks():
    from benchmarks.shim_pytorch import segment_summary
    snapshot = [{"stream": 0, "segment_type": "large", "total_size": 100, "allocated_size": 60,
                 "blocks": [{"size": 60, "state": "active_allocated"}, {"size": 30, "state": "inactive"},
                            {"size": 10, "state": "inactive"}]},
                {"stream": 7, "segment_type": "large", "total_size": 20, "allocated_size": 0,
                 "blocks": [{"size": 20, "state": "inactive"}]}]
    assert segment_summary(snapshot) == [
        {"stream": 0, "pool": "large", "total": 100, "allocated": 60, "free_blocks": 2,
         "largest_free": 30},
        {"stream": 7, "pool": "large", "total": 20, "allocated": 0, "free_blocks": 1,
         "largest_free": 20}]


def test_memory_trace_summary_tells_pending_frees_from_cached_ones():
    from benchmarks.shim_pytorch import memory_trace_summary
    frames = [{"filename": "/x/site-packages/torch/nn/modules/conv.py", "line": 1, "name": "f"},
              {"filename": "/w/mucudnn/torch/runtime.py", "line": 290, "name": "fetch"}]
    trace = [
        {"action": "alloc", "addr": 0, "size": 100},
        {"action": "free_completed", "addr": 999, "size": 7},   # freed before the trace: ignored
        {"action": "free_requested", "addr": 0, "size": 100},   # stream uses: not reusable yet
        {"action": "segment_map", "addr": 500, "size": 300},
        {"action": "alloc", "addr": 500, "size": 250, "frames": frames},
        {"action": "free_requested", "addr": 500, "size": 250},
        {"action": "free_completed", "addr": 500, "size": 250},  # no stream uses: at once
        {"action": "free_completed", "addr": 0, "size": 100},
        {"action": "segment_unmap", "addr": 500, "size": 300},
    ]
    summary = memory_trace_summary(trace, allocated=1000, mapped=2000)
    # most mapped: after the map, before the unmap; 100 bytes then still awaited their events
    assert summary["at_most_mapped"] == {"mapped": 2300, "allocated": 1000, "pending": 100,
                                         "cached_free": 1200}
    assert summary["most_pending"] == 350
    assert summary["growths"] == 1 and summary["grown_bytes"] == 300 and summary["unmaps"] == 1
    growth = summary["largest_growths"][0]
    assert growth["request"] == 250 and growth["pending"] == 100
    assert growth["where"] == ["runtime.py:290 fetch"]


def test_memory_trace_summary_names_the_request_after_each_run_of_unmappings():
    from benchmarks.shim_pytorch import memory_trace_summary
    frames = [{"filename": "/w/benchmarks/models.py", "line": 129, "name": "forward"}]
    trace = [
        {"action": "alloc", "addr": 0, "size": 100},
        {"action": "free_requested", "addr": 0, "size": 100},
        {"action": "free_completed", "addr": 0, "size": 100},
        {"action": "segment_unmap", "addr": 0, "size": 300},     # a flush: two ranges
        {"action": "segment_unmap", "addr": 600, "size": 200},
        {"action": "segment_map", "addr": 0, "size": 400},
        {"action": "alloc", "addr": 0, "size": 400, "frames": frames},
        {"action": "segment_unmap", "addr": 900, "size": 100},   # another, and it fails
        {"action": "oom", "size": 5000},
    ]
    summary = memory_trace_summary(trace, allocated=50, mapped=1000)
    assert summary["unmaps"] == 3 and summary["ooms"] == 1
    assert summary["flushes"] == [
        {"unmapped": 500, "mapped": 1000, "allocated": 50, "pending": 0, "cached_free": 950,
         "request": 400, "where": ["models.py:129 forward"]},
        {"unmapped": 100, "mapped": 900, "allocated": 450, "pending": 0, "cached_free": 450,
         "request": 5000, "failed": True, "where": []}]


def test_memory_trace_summary_has_no_most_mapped_moment_where_nothing_was_mapped():
    from benchmarks.shim_pytorch import memory_trace_summary
    trace = [{"action": "alloc", "addr": 0, "size": 100},
             {"action": "free_requested", "addr": 0, "size": 100},
             {"action": "free_completed", "addr": 0, "size": 100}]
    summary = memory_trace_summary(trace, allocated=10, mapped=1000)
    assert summary["at_most_mapped"] is None and summary["growths"] == 0


def _event(cat, ts, dur, stream=None, name="k"):
    event = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}
    if stream is not None:
        event["args"] = {"stream": stream}
    return event


def test_trace_summary_splits_busy_and_idle_time_per_stream():
    trace = {"traceEvents": [
        _event("kernel", 0, 100, 7), _event("kernel", 50, 100, 7),   # overlap: busy 0..150
        _event("kernel", 400, 100, 7, name="conv"),                   # a 250 µs gap
        _event("kernel", 520, 30, 7),                                 # a 20 µs gap
        _event("gpu_memcpy", 0, 450, 13),
        _event("cuda_runtime", 10, 2000, name="cudaEventSynchronize"),
        _event("cuda_runtime", 10, 5, name="cudaLaunchKernel"),
        _event("cuda_runtime", 20, 5, name="cudaLaunchKernel"),
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 0},
    ]}
    summary = trace_summary(trace)
    assert summary["span_ms"] == 0.55
    assert summary["compute_stream"] == "7"
    assert summary["streams"]["7"]["busy_ms"] == 0.28
    assert summary["streams"]["13"] == {"busy_ms": 0.45, "events": 1, "kinds": ["gpu_memcpy"]}
    assert summary["compute_idle_ms"] == 0.27
    assert summary["compute_gaps_over_50us"] == 1
    assert summary["largest_gaps_ms_at_ms"][0] == [0.25, 0.15, "conv"]   # what it waited to run
    assert list(summary["runtime_calls_ms"]) == ["cudaEventSynchronize", "cudaLaunchKernel"]
    assert summary["runtime_calls_ms"]["cudaLaunchKernel"] == [0.01, 2]
    # the compute stream's kernels by name, each kernel's own time (overlaps not merged)
    assert summary["compute_kernels_ms"] == {"k": [0.23, 3], "conv": [0.1, 1]}
    assert trace_summary({"traceEvents": []}) == {}


def test_an_extra_after_the_timed_steps_that_runs_out_of_memory_leaves_the_result_standing():
    import types
    from benchmarks.shim_pytorch import add_extras

    class OutOfMemory(RuntimeError):
        pass
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(OutOfMemoryError=OutOfMemory))

    def oom():
        raise OutOfMemory("CUDA out of memory. Tried to allocate 512.00 MiB\nmore")

    def cudnn_oom():   # cuDNN's own words for it count too
        raise RuntimeError("GET was unable to find an engine to execute this computation")
    result = {"step_ms": 100.0}
    add_extras(torch, result, [("memory_trace", oom), ("profile", lambda: {"span_ms": 1.0}),
                               ("third", cudnn_oom)])
    assert result == {"step_ms": 100.0,
                      "memory_trace": {"oom": "CUDA out of memory. Tried to allocate 512.00 MiB"},
                      "profile": {"span_ms": 1.0},
                      "third": {"oom": "GET was unable to find an engine to execute this computation"}}

    def broken():
        raise RuntimeError("an illegal memory access")
    with pytest.raises(RuntimeError, match="illegal"):   # anything else is not a result
        add_extras(torch, {}, [("profile", broken)])


def test_host_waits_names_the_host_context_of_each_sync_and_of_each_gaps_launch():
    from benchmarks.shim_pytorch import host_waits

    def span(cat, name, ts, dur, tid=1, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid,
                "args": args}
    events = [
        span("python_function", "runtime.py(325): offload", 0, 100),
        span("cpu_op", "aten::empty_strided", 10, 50),
        span("cuda_runtime", "cudaStreamSynchronize", 20, 30),
        span("cpu_op", "aten::copy_", 200, 20, tid=2),                 # another thread
        span("cuda_runtime", "cudaLaunchKernel", 205, 5, tid=2, correlation=7),
        span("cuda_runtime", "cudaStreamSynchronize", 300, 10, tid=3),   # no context
        span("kernel", "k1", 0, 100, tid=9, stream=7),
        span("kernel", "k2", 400, 10, tid=9, stream=7, correlation=7),   # after a 300 µs gap
        span("gpu_memcpy", "copy", 110, 500, tid=10, stream=13),         # another stream
    ]
    waits = host_waits(events, steps=2)
    assert waits["syncs"] == [
        {"call": "cudaStreamSynchronize", "calls_per_step": 0.5, "ms_per_step": 0.015,
         "context": ["runtime.py(325): offload", "aten::empty_strided"]},
        {"call": "cudaStreamSynchronize", "calls_per_step": 0.5, "ms_per_step": 0.005,
         "context": []}]
    assert waits["largest_gaps"] == [{"ms": 0.3, "before": "k2", "launched_in": ["aten::copy_"]}]
