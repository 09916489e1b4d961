// Epilogue of the sm90 backward: dK = softmax_scale * acc_dk and dV = acc_dv, converted to Element and stored from
// the registers, one 4-byte pair of adjacent columns at a time, rows past Sk (varlen: past the sequence's used keys)
// skipped. A CTA writes its block once (it walked the whole GQA group), so there are no atomics: dK and dV are
// deterministic. The stores are a small part of a CTA's time (one kBlockN x D tile each against the sweep over every
// query block).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/array.h>
#include <cutlass/numeric_conversion.h>

#include "flashjax/params.h"
#include "kernels/sm90/bwd_varlen_scheduler.cuh"

namespace flashjax::sm90 {

// acc_dk / acc_dv: the MMA warpgroups' TiledMmaDkv fragments of (kBlockN x D); thread_idx in [0, kMmaThreads).
template <typename Mainloop, typename AccDkv>
__device__ void bwd_store_dkdv_sm90(const BwdParams& params, int n_block, int kv_head, int batch, int thread_idx,
                                    const AccDkv& acc_dk, const AccDkv& acc_dv) {
  using namespace cute;
  using Element = typename Mainloop::Element;
  typename Mainloop::TiledMmaDkv mma_dkv;
  const Tensor coords = mma_dkv.get_thread_slice(thread_idx)
                            .partition_C(make_identity_tensor(Shape<Int<Mainloop::kBlockN>, Int<Mainloop::kHeadDim>>{}));
  const int n_start = n_block * Mainloop::kBlockN;
  auto* dk = static_cast<Element*>(params.dk) + batch * params.dk_batch_stride + kv_head * params.dk_head_stride;
  auto* dv = static_cast<Element*>(params.dv) + batch * params.dv_batch_stride + kv_head * params.dv_head_stride;
  cutlass::NumericArrayConverter<Element, float, 2> to_element;
  // Accumulator values 2k and 2k + 1 are adjacent columns of one row.
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int key = n_start + get<0>(coords(i));
    const int col = get<1>(coords(i));
    if (key >= params.seqlen_k) continue;
    const cutlass::Array<float, 2> k_pair = {acc_dk(i) * params.softmax_scale, acc_dk(i + 1) * params.softmax_scale};
    const cutlass::Array<float, 2> v_pair = {acc_dv(i), acc_dv(i + 1)};
    const auto k_out = to_element(k_pair);
    const auto v_out = to_element(v_pair);
    *reinterpret_cast<uint32_t*>(dk + int64_t(key) * params.dk_row_stride + col) =
        reinterpret_cast<const uint32_t&>(k_out);
    *reinterpret_cast<uint32_t*>(dv + int64_t(key) * params.dv_row_stride + col) =
        reinterpret_cast<const uint32_t&>(v_out);
  }
}

// Varlen: the sequence's used keys, from its first key on (bwd_varlen_scheduler.cuh; the packed tensors are batch 0;
// the launcher zeroed the other rows). The dense function's loop with the sequence's base and key count, kept apart
// so that the dense kernels' code stays what it was.
template <typename Mainloop, typename AccDkv>
__device__ void bwd_store_dkdv_varlen_sm90(const BwdParams& params, const BwdVarlenBlock& seq, int kv_head,
                                           int thread_idx, const AccDkv& acc_dk, const AccDkv& acc_dv) {
  using namespace cute;
  using Element = typename Mainloop::Element;
  typename Mainloop::TiledMmaDkv mma_dkv;
  const Tensor coords = mma_dkv.get_thread_slice(thread_idx)
                            .partition_C(make_identity_tensor(Shape<Int<Mainloop::kBlockN>, Int<Mainloop::kHeadDim>>{}));
  const int n_start = seq.block * Mainloop::kBlockN;
  auto* dk = static_cast<Element*>(params.dk) + int64_t(seq.k_start) * params.dk_row_stride +
             kv_head * params.dk_head_stride;
  auto* dv = static_cast<Element*>(params.dv) + int64_t(seq.k_start) * params.dv_row_stride +
             kv_head * params.dv_head_stride;
  cutlass::NumericArrayConverter<Element, float, 2> to_element;
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dk); i += 2) {
    const int key = n_start + get<0>(coords(i));
    const int col = get<1>(coords(i));
    if (key >= seq.seqlen_k) continue;
    const cutlass::Array<float, 2> k_pair = {acc_dk(i) * params.softmax_scale, acc_dk(i + 1) * params.softmax_scale};
    const cutlass::Array<float, 2> v_pair = {acc_dv(i), acc_dv(i + 1)};
    const auto k_out = to_element(k_pair);
    const auto v_out = to_element(v_pair);
    *reinterpret_cast<uint32_t*>(dk + int64_t(key) * params.dk_row_stride + col) =
        reinterpret_cast<const uint32_t&>(k_out);
    *reinterpret_cast<uint32_t*>(dv + int64_t(key) * params.dv_row_stride + col) =
        reinterpret_cast<const uint32_t&>(v_out);
  }
}

}  // namespace flashjax::sm90
