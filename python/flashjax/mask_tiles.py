"""The tile-class rule of a mask mod on the kernels, in numpy (issue 38): what csrc/kernels/common/mask_bits_tiles.cuh
computes on the device and how the kernels compose it with the band, written once more so that the CPU tests can
check it against the definition by brute force (as tests/cpp checks band_mask.cuh). Not used by the call path.

A tile of `block_m` query rows x `block_n` keys is EMPTY when no bit is set among its valid rows (< Sq) and columns
(< Sk), FULL when all of them are, else PARTIAL. The kernels visit a tile only if neither the band nor the mod says
empty, and skip the per-element mask only if both say full.
"""
from __future__ import annotations

import numpy as np

EMPTY, PARTIAL, FULL = 0, 1, 2  # kMaskTileEmpty, kMaskTilePartial, kMaskTileFull


def unpack(bits: np.ndarray, seqlen_k: int) -> np.ndarray:
    """uint32 [Bm, Hm, Sq, Wk] -> bool [Bm, Hm, Sq, Sk]."""
    bits = np.asarray(bits, np.uint32)
    flat = (bits[..., None] >> np.arange(32, dtype=np.uint32)) & 1
    return flat.reshape(bits.shape[:-1] + (bits.shape[-1] * 32,))[..., :seqlen_k].astype(bool)


def tile_classes(bits: np.ndarray, seqlen_k: int, block_m: int, block_n: int) -> np.ndarray:
    """uint8 [Bm, Hm, ceil(Sq / block_m), ceil(Sk / block_n)]: the classes of the mask bits' tiles, word by word as
    the kernel reduces them (each word cut to the tile's valid keys)."""
    assert block_n % 32 == 0
    bits = np.asarray(bits, np.uint32)
    bm, hm, seqlen_q, words = bits.shape
    m_blocks, n_blocks = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    out = np.zeros((bm, hm, m_blocks, n_blocks), np.uint8)
    for m in range(m_blocks):
        rows = bits[:, :, m * block_m:(m + 1) * block_m]
        for n in range(n_blocks):
            any_set = np.zeros((bm, hm), bool)
            all_set = np.ones((bm, hm), bool)
            col_end = min((n + 1) * block_n, seqlen_k)
            for w in range(n * block_n // 32, min((n + 1) * block_n // 32, words)):
                valid = col_end - 32 * w
                if valid <= 0:
                    continue
                keep = np.uint32(0xFFFFFFFF if valid >= 32 else (1 << valid) - 1)
                x = rows[..., w] & keep
                any_set |= (x != 0).any(axis=-1)
                all_set &= (x == keep).all(axis=-1)
            out[:, :, m, n] = np.where(~any_set, EMPTY, np.where(all_set, FULL, PARTIAL))
    return out


def compose(band_class: int, mod_class: int) -> int:
    """A tile's class for the kernels from the band's and the mod's: empty by either, full only by both."""
    if band_class == EMPTY or mod_class == EMPTY:
        return EMPTY
    return FULL if band_class == FULL and mod_class == FULL else PARTIAL
