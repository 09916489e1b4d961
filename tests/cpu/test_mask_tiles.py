"""The mask-mod tile-class rule (python/flashjax/mask_tiles.py, the numpy twin of kernels/common/mask_bits_tiles.cuh)
against its definition by brute force, and the composition with the band that the kernels use: no visible (query,
key) pair may fall in a skipped tile, and a tile run without per-element masking must be visible everywhere."""
import numpy as np
import pytest

from flashjax import mask_tiles

from numpy_oracle import band as band_oracle


def _random_bits(rng, bm, hm, seqlen_q, seqlen_k, block_m, block_n):
    """Bits with empty, full and partial tiles, random content in the partial ones, and the zero tail past Sk."""
    words = -(-seqlen_k // 32)
    dense = rng.random((bm, hm, seqlen_q, words * 32)) < 0.5
    m_blocks, n_blocks = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    kind = rng.integers(0, 3, (bm, hm, m_blocks, n_blocks))
    for m in range(m_blocks):
        for n in range(n_blocks):
            tile = (slice(None), slice(None), slice(m * block_m, (m + 1) * block_m), slice(n * block_n, (n + 1) * block_n))
            sel = kind[:, :, m, n][:, :, None, None]
            dense[tile] = np.where(sel == 0, False, np.where(sel == 1, True, dense[tile]))
    dense[..., seqlen_k:] = False
    packed = (dense.reshape(bm, hm, seqlen_q, words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    return packed.astype(np.uint32), dense[..., :seqlen_k]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_m,block_n", [(128, 64), (64, 128), (32, 64), (64, 32)])
def test_tile_classes_match_definition(seed, block_m, block_n):
    rng = np.random.default_rng(seed * 100 + block_m + block_n)
    seqlen_q, seqlen_k = (int(x) for x in rng.integers(1, 300, 2))
    bm, hm = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    bits, dense = _random_bits(rng, bm, hm, seqlen_q, seqlen_k, block_m, block_n)
    assert np.array_equal(mask_tiles.unpack(bits, seqlen_k), dense)
    classes = mask_tiles.tile_classes(bits, seqlen_k, block_m, block_n)
    seen = set()
    for m in range(classes.shape[2]):
        for n in range(classes.shape[3]):
            tile = dense[:, :, m * block_m:(m + 1) * block_m, n * block_n:(n + 1) * block_n]
            expected = np.where(~tile.any(axis=(2, 3)), 0, np.where(tile.all(axis=(2, 3)), 2, 1))
            assert np.array_equal(classes[:, :, m, n], expected), (m, n)
            seen.update(expected.ravel().tolist())
    if classes.size >= 12:
        assert seen == {0, 1, 2}  # the draw reaches every class


@pytest.mark.parametrize("seed", range(8))
def test_composition_with_band_covers_exactly_the_visible_pairs(seed):
    rng = np.random.default_rng(seed)
    block_m, block_n = (128, 64) if seed % 2 else (64, 128)
    seqlen_q, seqlen_k = (int(x) for x in rng.integers(1, 400, 2))
    left, right = (int(rng.integers(-1, 200)), int(rng.integers(-1, 3))) if seed % 3 else (-1, 0)
    bits, dense = _random_bits(rng, 1, 2, seqlen_q, seqlen_k, block_m, block_n)
    band = band_oracle(seqlen_q, seqlen_k, False, (left, right))  # [Sq, Sk], design §2.3
    visible = dense & band[None, None]
    mod_classes = mask_tiles.tile_classes(bits, seqlen_k, block_m, block_n)
    band_bits = np.zeros((1, 1, seqlen_q, -(-seqlen_k // 32) * 32), bool)
    band_bits[..., :seqlen_k] = band
    packed = (band_bits.reshape(1, 1, seqlen_q, -1, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(-1)
    band_classes = mask_tiles.tile_classes(packed.astype(np.uint32), seqlen_k, block_m, block_n)[0, 0]
    covered = np.zeros_like(visible)
    for h in range(2):
        for m in range(mod_classes.shape[2]):
            for n in range(mod_classes.shape[3]):
                rows, cols = slice(m * block_m, (m + 1) * block_m), slice(n * block_n, (n + 1) * block_n)
                cls = mask_tiles.compose(int(band_classes[m, n]), int(mod_classes[0, h, m, n]))
                if cls == mask_tiles.EMPTY:
                    continue
                tile = np.ones_like(visible[0, h, rows, cols]) if cls == mask_tiles.FULL else \
                    (dense[0, h, rows, cols] & band[rows, cols])
                covered[0, h, rows, cols] = tile
    assert np.array_equal(covered, visible)
