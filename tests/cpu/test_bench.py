"""The benchmark harness runs end to end on CPU: rows, timing, correctness flags, table, JSON and plot.

Peers that need a GPU (cuDNN, Pallas) record n/a here; two stand-ins built on XLA replace Pallas and flashjax
so the correctness check is exercised both ways: one agrees with the reference, one is 10% off.
"""
import contextlib
import io
import json

import jax
import numpy as np
import pytest

TINY = ["--tokens", "128", "--hidden", "32", "--hdims", "16", "--seqlens", "32,64",
        "--reps", "1", "--trials", "1", "--input-sets", "2"]


@pytest.fixture(scope="module")
def bench(bench_script):
    with bench_script("bench.py", "flashjax_bench") as module:  # it imports plot.py from its own folder
        yield module


@pytest.fixture(scope="module")
def run(bench, tmp_path_factory):
    """One tiny run of main() with Pallas and flashjax replaced by an exact and a wrong XLA stand-in."""
    real_attention_fn = bench.attention_fn

    def stand_in(impl, row, backend):
        if impl not in ("pallas", "flashjax"):
            return real_attention_fn(impl, row, backend)
        xla = real_attention_fn("xla", row, backend)
        return xla if impl == "pallas" else (lambda q, k, v: xla(q, k, v) * 1.1)

    out = tmp_path_factory.mktemp("bench")
    argv = TINY + ["--rows", "d16-s32-causal|gqa.*-causal|swa|decode", "--json", str(out / "r.json"),
                   "--png", str(out / "r.png")]
    bench.attention_fn = stand_in
    stdout = io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout):
            report = bench.main(argv)
    finally:
        bench.attention_fn = real_attention_fn
    return report, stdout.getvalue(), out


def test_rows_selected_and_reported(run):
    report, _, out = run
    names = [e["row"]["name"] for e in report["rows"]]
    assert names == ["d16-s32-causal", "gqa32:8-d128-s128-causal", "swa8-d128-s128", "decode-d128-sk64",
                     "decode-gqa32:8-d128-sk64", "decode-b1-gqa32:8-d128-sk256", "decode-b1-d128-sk256",
                     "decode-b1-gqa32:8-d128-sk256-cap30"]
    assert json.loads((out / "r.json").read_text()) == json.loads(json.dumps(report))


def test_every_cell_timed_or_explained(run):
    report, _, _ = run
    for entry in report["rows"]:
        for direction in ("fwd", "bwd"):
            cells = entry["results"][direction]
            assert set(cells) == {"cudnn", "xla", "pallas", "fa3", "fa3kv", "flashjax"}
            for cell in cells.values():
                assert ("na" in cell) != ("tflops" in cell)
                if "tflops" in cell:
                    assert cell["ms"] > 0 and np.isfinite(cell["tflops"])
            assert "tflops" in cells["xla"]
            if entry["row"]["softcap"] > 0:  # the xla column runs flashjax's reference; the peers have no softcap
                assert cells["cudnn"]["na"] == cells["fa3"]["na"] == "Unsupported: no softcap", cells
            elif jax.default_backend() == "cpu":
                # Without a CUDA plugin jax raises RuntimeError; with one installed (a GPU machine's CPU tests),
                # NotImplementedError for the CPU platform.
                assert cells["cudnn"]["na"].startswith(("RuntimeError", "NotImplementedError")), cells["cudnn"]


def test_correctness_flags(run):
    report, table, _ = run
    for entry in report["rows"]:
        for direction in ("fwd", "bwd"):
            cells = entry["results"][direction]
            assert cells["flashjax"]["wrong"] and cells["flashjax"]["rel_err"] > 0.05
            assert not cells["pallas"]["wrong"] and cells["pallas"]["rel_err"] < 1e-2
    flagged = [line for line in table.splitlines() if line.startswith("d16-s32-causal")]
    assert len(flagged) == 1 and flagged[0].count("!") == 2  # flashjax fwd and bwd


def test_table_printed_last(run):
    _, table, _ = run
    assert "fwd:fj/cudnn" in table and "bwd:fj/cudnn" in table
    assert "cudnn: " in table.split("- = n/a:")[-1]


def test_plot_written(run):
    pytest.importorskip("matplotlib")
    _, _, out = run
    assert (out / "r.png").stat().st_size > 1000


def test_visible_pairs_match_a_dense_mask(bench):
    for sq, sk, causal, window in [(7, 7, True, (2, 0)), (5, 9, False, (1, 3)), (9, 5, False, (-1, 2)),
                                   (6, 11, True, (-1, -1)), (1, 8, True, (3, -1)), (8, 8, False, (-1, 0))]:
        row = bench.Row("r", 1, sq, sk, 1, 1, 8, causal, window)
        left, right = window
        right = 0 if causal else right
        i, j = np.arange(sq)[:, None], np.arange(sk)[None, :]
        offset = sk - sq
        visible = np.ones((sq, sk), bool)
        if right >= 0:
            visible &= j <= i + offset + right
        if left >= 0:
            visible &= j >= i + offset - left
        expected = sq * sk / 2 if window == (-1, -1) and causal else visible.sum()  # causal: field convention
        assert row.visible_pairs() == expected, (sq, sk, causal, window)


def test_quick_rows_exist_in_the_full_grid(bench):
    names = {r.name for r in bench.select_rows(bench.parse_args(["--quick"]))}
    assert names == set(bench.QUICK_ROWS)


def test_floors_table(bench):
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        bench.main(["--floors", "--rows", "^d128-s4096"])
    lines = stdout.getvalue().splitlines()
    assert len(lines) == 4 and lines[2].startswith("| d128-s4096-full |")


@pytest.mark.parametrize("direction", ["step", "jvp"])
def test_step_and_jvp_time_one_jitted_call(bench, direction):
    """--dirs step: forward + backward in one jax.grad (3.5x the forward's FLOPs: fwd + bwd); --dirs jvp: one jax.jvp,
    primal and tangent (3.5x: the forward and its 2.5x tangent); each checked like the other directions."""
    real_attention_fn = bench.attention_fn
    bench.attention_fn = lambda impl, row, backend: (
        (lambda q, k, v: real_attention_fn("xla", row, backend)(q, k, v) * 1.1) if impl == "flashjax"
        else real_attention_fn(impl, row, backend))
    try:
        with contextlib.redirect_stdout(io.StringIO()) as stdout:
            report = bench.main(TINY + ["--rows", "d16-s32-causal", "--dirs", direction, "--impls", "xla,flashjax"])
    finally:
        bench.attention_fn = real_attention_fn
    (entry,) = report["rows"]
    cells = entry["results"][direction]
    assert cells["xla"]["ms"] > 0 and cells["flashjax"]["wrong"] and cells["flashjax"]["rel_err"] > 0.05
    row = bench.select_rows(bench.parse_args(TINY + ["--rows", "d16-s32-causal"]))[0]
    assert row.flops(direction) == pytest.approx(row.flops("fwd") + row.flops("bwd"))  # both 3.5x the forward
    assert row.min_bytes(direction) > row.min_bytes("fwd")
    assert f"{direction}:xla" in stdout.getvalue()
