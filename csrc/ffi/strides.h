// Element strides of the contiguous JAX layouts (q/o [B, Sq, Hq, D], k/v [B, Sk, Hk, D], lse [B, Hq, Sq]) for
// FwdParams/BwdParams: used by the FFI handlers and by tests/sanitize's driver, so that the driver launches the
// kernels on exactly the layouts XLA hands them.
#pragma once

#include <cstdint>

#include "flashjax/params.h"

namespace flashjax {

// Needs batch, seqlen_q, seqlen_k, heads_q, heads_k and head_dim set.
inline void set_contiguous_strides(AttnShape& p) {
  const int64_t D = p.head_dim;
  p.q_head_stride = p.o_head_stride = D;
  p.q_row_stride = p.o_row_stride = D * p.heads_q;
  p.q_batch_stride = p.o_batch_stride = p.q_row_stride * p.seqlen_q;
  p.k_head_stride = p.v_head_stride = D;
  p.k_row_stride = p.v_row_stride = D * p.heads_k;
  p.k_batch_stride = p.v_batch_stride = p.k_row_stride * p.seqlen_k;
  p.lse_head_stride = p.seqlen_q;
  p.lse_batch_stride = static_cast<int64_t>(p.seqlen_q) * p.heads_q;
}

// The backward's gradients share their primal's layout: dout and dq q's, dk and dv k's.
inline void set_gradient_strides(BwdParams& p) {
  p.do_batch_stride = p.dq_batch_stride = p.q_batch_stride;
  p.do_row_stride = p.dq_row_stride = p.q_row_stride;
  p.do_head_stride = p.dq_head_stride = p.q_head_stride;
  p.dk_batch_stride = p.dv_batch_stride = p.k_batch_stride;
  p.dk_row_stride = p.dv_row_stride = p.k_row_stride;
  p.dk_head_stride = p.dv_head_stride = p.k_head_stride;
}

}  // namespace flashjax
