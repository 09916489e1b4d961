"""ring_plan's calls against the global mask, by brute force: for every layout, ring size, piece lengths (odd, Sq != Sk
both ways) and band, each device's calls at each step cover exactly the visible entries of its block pair, once."""
import itertools

import numpy as np
import pytest

import numpy_oracle as oracle
from flashjax import ring_plan


def _visible(seqlen_q, seqlen_k, left, right):
    return oracle.band(seqlen_q, seqlen_k, False, (left, right))  # docs/design.md §2.3, written from its text


def _positions(layout, ring_size, device, length):
    positions = np.zeros(length, int)
    for local, start, size in ring_plan.pieces(layout, ring_size, device, length):
        positions[local:local + size] = np.arange(start, start + size)
    return positions


def _check(layout, ring_size, len_q, len_k, window):
    full = _visible(ring_size * len_q, ring_size * len_k, *window)
    for t, step in enumerate(ring_plan.schedule(layout, ring_size, len_q, len_k, window)):
        assert len(step.case_of) == ring_size and len(set(step.case_of)) == len(step.cases)
        for device in range(ring_size):
            source = (device - t) % ring_size
            want = full[np.ix_(_positions(layout, ring_size, device, len_q),
                               _positions(layout, ring_size, source, len_k))]
            covered = np.zeros(want.shape, int)
            for call in step.cases[step.case_of[device]]:
                assert 0 <= call.q_start < call.q_stop <= len_q and 0 <= call.k_start < call.k_stop <= len_k, call
                block = _visible(call.q_stop - call.q_start, call.k_stop - call.k_start, *call.window)
                assert block.any(axis=1).all() and block.any(axis=0).all(), f"not cut to its visible entries: {call}"
                covered[call.q_start:call.q_stop, call.k_start:call.k_stop] += block
            assert (covered == want).all(), (layout, ring_size, len_q, len_k, window, t, device)


@pytest.mark.parametrize("layout", ring_plan.LAYOUTS)
def test_calls_cover_the_global_mask_exactly_once(layout):
    windows = [(-1, -1), (-1, 0), (0, 0), (3, 0), (1, -1), (9, 2), (40, 5), (-1, 2), (2, 11)]
    lengths = (2, 4, 6, 8) if layout == "zigzag" else (1, 3, 5, 8)
    for ring_size, len_q, len_k, window in itertools.product((1, 2, 3, 4, 8), lengths, lengths, windows):
        _check(layout, ring_size, len_q, len_k, window)


def test_zigzag_balances_causal_work():
    # Past the diagonal step every device attends to exactly half a block: its later chunk against the whole block
    # in hand, or both its chunks against the block's earlier chunk.
    ring_size, length = 4, 8
    steps = ring_plan.schedule("zigzag", ring_size, length, length, (-1, 0))
    assert steps[0].cases == ((ring_plan.BlockCall(0, length, 0, length, (-1, 0)),),)
    for step in steps[1:]:
        for case in step.cases:
            (call,) = case
            assert call.window == (-1, -1)
            assert (call.q_stop - call.q_start) * (call.k_stop - call.k_start) == length * length // 2


def test_contiguous_causal_skips_blocks_after_the_queries():
    steps = ring_plan.schedule("contiguous", 4, 6, 6, (-1, 0))
    for t, step in enumerate(steps[1:], start=1):
        for device, index in enumerate(step.case_of):
            calls = step.cases[index]
            # Device i holds block i - t mod n: before its queries (all visible) or after them (none).
            assert calls == ((ring_plan.BlockCall(0, 6, 0, 6, (-1, -1)),) if device >= t else ())
