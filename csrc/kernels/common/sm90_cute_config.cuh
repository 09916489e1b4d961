// CuTe configuration of the sm90 kernels: the first include of every sm90 header, ahead of any CuTe header.
//
// wgmma has an instruction for every N that is a multiple of 8 up to 256, but CuTe defines the shapes outside
// {8, 16, 32, 64, 96, 128, 192, 256} only under CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED. Without it ss_op_selector
// silently tiles S = Q K^T for kBlockN = 176 / 112 / 80 with 64x16 atoms, each of which re-reads the whole Q slice
// from shared memory (11 times per k-step at kBlockN = 176): the D = 128 non-causal kernel ran at 459 TFLOP/s so.
// The build should define the macro for every translation unit, as FlashAttention-3 does; defining it here keeps
// the sm90 headers right on their own, and the mainloop static_asserts the atom shapes it gets.
#pragma once

#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#define CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#endif
