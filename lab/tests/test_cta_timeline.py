"""lab/tools/cta_timeline.py's summary of probe records (csrc/kernels/sm90/fwd_probe.cuh's layout) on synthetic
launches: the span, the first block, the gap from the previous launch and the CTAs' clocks it reports."""
import importlib.util
import sys
from pathlib import Path

import numpy as np

TOOL = Path(__file__).resolve().parents[1] / "tools" / "cta_timeline.py"


def load_tool(monkeypatch):
    # The summary needs neither JAX nor bench.py (main() imports them): the import stays cheap and GPU-free.
    monkeypatch.setitem(sys.modules, "bench", None)  # an import of bench at load time would fail the test
    spec = importlib.util.spec_from_file_location("cta_timeline", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def records(tool, launches=3, ctas=4, period=1_000_000, gap=5_000):
    """Launch l starts at l * period; CTA c runs (c + 1) * 100 us at 1.5 GHz, its first block done 6 us in, two tiles."""
    rec = np.zeros((tool.LAUNCHES, tool.CTAS, tool.SLOTS), np.uint64)
    for l in range(launches):
        for c in range(ctas):
            entry = l * period + gap
            start = entry + 1_000
            exit_ = start + (c + 1) * 100_000
            r = rec[l, c]
            r[0], r[1], r[2], r[3], r[4], r[5] = c, entry, start, start + 6_000, exit_, 2
            r[6], r[7] = 10**9, 10**9 + int(1.5 * (exit_ - entry))
            r[8], r[9], r[10], r[11] = start + 50_000, 3 | (4 << 16), exit_, 5 | (6 << 16)
    return rec


def test_summary_of_synthetic_launches(monkeypatch, capsys):
    tool = load_tool(monkeypatch)
    tool.summary("synthetic", records(tool))
    out = capsys.readouterr().out
    assert "3 launches, 4 CTAs" in out
    assert "span 400.0 us" in out  # the last CTA's exit, 4 x 100 us after the first start
    assert "first block 6.00 us" in out
    # launch l + 1 starts at (l + 1) * 1 ms + 6 us; launch l's last exit is at l * 1 ms + 406 us
    assert "gap 600.00 us" in out
    assert "CTA clocks 1.500-1.500 GHz" in out
    assert "end mean 0.6250 min 0.2500 of span" in out
