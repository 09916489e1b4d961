"""lab/tools/launch_gap.py's reading of a profiler trace: device stream lines only, the busiest line, and the idle time
before each matching event (a synthetic trace in the trace viewer's JSON form)."""
import gzip
import importlib.util
import json
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "launch_gap.py"


def load_tool(monkeypatch):
    monkeypatch.setitem(sys.modules, "bench", None)  # the parsing must not need bench.py (nor a GPU)
    spec = importlib.util.spec_from_file_location("launch_gap", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_trace(directory, events):
    run = directory / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}}]
    with gzip.open(run / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


def test_gaps_on_the_busiest_device_line(monkeypatch, tmp_path):
    tool = load_tool(monkeypatch)
    events = [
        # Host events, and a second device line with fewer events: both ignored.
        x(1, 1, "fwd_kernel_sm90 host launch", 0.0, 1.0),
        x(7, 9, "memcpy", 0.0, 5.0),
        # The stream: kernel, memset, kernel, kernel (the memset's own gap does not match the pattern).
        x(7, 3, "void fwd_kernel_sm90<A>", 10.0, 100.0),   # ends 110
        x(7, 3, "Memset", 112.5, 1.0),                    # ends 113.5
        x(7, 3, "void fwd_kernel_sm90<A>", 116.0, 100.0),  # 2.5 after the memset
        x(7, 3, "void fwd_kernel_sm90<A>", 219.5, 50.0),   # 3.5 after the kernel
    ]
    write_trace(tmp_path, events)
    lines = tool.device_events(str(tmp_path))
    assert set(lines) == {(7, 3), (7, 9)}
    gaps, names = tool.gaps(lines, "fwd_kernel_sm90")
    assert gaps == pytest.approx([2.5, 3.5])
    assert names == ["Memset", "void fwd_kernel_sm90<A>"]
    every, _ = tool.gaps(lines, ".")
    assert every == pytest.approx([2.5, 2.5, 3.5])


def test_a_trace_without_a_gpu_is_refused(monkeypatch, tmp_path):
    tool = load_tool(monkeypatch)
    run = tmp_path / "plugins" / "profile" / "run"
    run.mkdir(parents=True)
    with gzip.open(run / "vm.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}}]}, f)
    with pytest.raises(RuntimeError, match="no GPU device"):
        tool.device_events(str(tmp_path))
    with pytest.raises(RuntimeError, match="no trace"):
        tool.device_events(str(tmp_path / "missing"))
