"""A mask mod's predicate over a box of indices, by interval arithmetic: the function that lets the mask-bits
kernel skip the points whose value the box already settles (docs/mask_codegen.md, "Boxes").

``<name>_box(b, h, q_lo, q_hi, kv_lo, kv_hi, f)`` evaluates the mod's graph once for every (q, kv) in
[q_lo, q_hi] x [kv_lo, kv_hi] at one (b, h): each node becomes an interval ``fjm_iv {lo, hi}`` (int64 bounds on an
int32 value; a bool is 0 / 1) that holds every value the node takes in the box. The output's interval then says
FJM_BOX_FALSE (the predicate is false at every point), FJM_BOX_TRUE (true at every point) or FJM_BOX_MIXED (not
settled: evaluate the points). The rules only need to be sound: a wider interval costs evaluations, never a wrong
bit. They are exact where a band or a document mask needs them: differences of indices, comparisons, and field
reads over a short index range (the min and max of the elements read). Where every argument is a single value the
node's own C++ expression (mask_emit) computes it, so a box of one point is the predicate itself; an int32 result
whose bounds leave int32 wraps in XLA and becomes "any int32"; an operation without a sharper rule gives any value
of its dtype.
"""

from __future__ import annotations

import numpy as np

from flashjax.mask_emit import DEFAULT_FUNCTION_NAME, const_literal, table_definitions, table_read
from flashjax.mask_graph import ConstTable, MaskGraph
from flashjax.mask_ops import OPS, cxx_int_literal
from flashjax.mask_trace import MAX_FIELD_RANK

__all__ = ["BOX_FALSE", "BOX_MIXED", "BOX_TRUE", "MAX_BOX_READS", "emit_box_function"]

BOX_FALSE, BOX_MIXED, BOX_TRUE = 0, 1, 2  # FJM_BOX_FALSE, FJM_BOX_MIXED, FJM_BOX_TRUE
# A field read over more elements than this gives any int32 (the kernel's boxes read at most 16 rows or 32 keys).
MAX_BOX_READS = 64

BOX_HELPERS = f"""#ifndef FLASHJAX_MASK_BOX_HELPERS
#define FLASHJAX_MASK_BOX_HELPERS 1
#define FJM_BOX_FALSE {BOX_FALSE}
#define FJM_BOX_MIXED {BOX_MIXED}
#define FJM_BOX_TRUE {BOX_TRUE}
#define FJM_BOX_MAX_READS {MAX_BOX_READS}
""" + r"""// Every value a graph node takes over a box of indices lies in [lo, hi] (int64 bounds; a bool is 0 / 1).
struct fjm_iv {
  long long lo, hi;
};
__device__ __forceinline__ fjm_iv fjm_iv_point(long long v) { return fjm_iv{v, v}; }
__device__ __forceinline__ bool fjm_iv_single(fjm_iv a) { return a.lo == a.hi; }
__device__ __forceinline__ long long fjm_ll_min(long long a, long long b) { return a < b ? a : b; }
__device__ __forceinline__ long long fjm_ll_max(long long a, long long b) { return a > b ? a : b; }
__device__ __forceinline__ fjm_iv fjm_iv_any_int() { return fjm_iv{-2147483647LL - 1, 2147483647LL}; }
__device__ __forceinline__ fjm_iv fjm_iv_any_bool() { return fjm_iv{0, 1}; }
// An int32 result whose exact bounds leave int32 wraps around (as XLA's arithmetic does): it can be any int32.
__device__ __forceinline__ fjm_iv fjm_iv_int(long long lo, long long hi) {
  return lo < -2147483647LL - 1 || hi > 2147483647LL ? fjm_iv_any_int() : fjm_iv{lo, hi};
}
__device__ __forceinline__ fjm_iv fjm_iv_hull(fjm_iv a, fjm_iv b) {
  return fjm_iv{fjm_ll_min(a.lo, b.lo), fjm_ll_max(a.hi, b.hi)};
}
__device__ __forceinline__ fjm_iv fjm_iv_add(fjm_iv a, fjm_iv b) { return fjm_iv_int(a.lo + b.lo, a.hi + b.hi); }
__device__ __forceinline__ fjm_iv fjm_iv_sub(fjm_iv a, fjm_iv b) { return fjm_iv_int(a.lo - b.hi, a.hi - b.lo); }
__device__ __forceinline__ fjm_iv fjm_iv_mul(fjm_iv a, fjm_iv b) {
  const long long p0 = a.lo * b.lo, p1 = a.lo * b.hi, p2 = a.hi * b.lo, p3 = a.hi * b.hi;  // |p| <= 2^62
  return fjm_iv_int(fjm_ll_min(fjm_ll_min(p0, p1), fjm_ll_min(p2, p3)), fjm_ll_max(fjm_ll_max(p0, p1), fjm_ll_max(p2, p3)));
}
__device__ __forceinline__ fjm_iv fjm_iv_neg(fjm_iv a) { return fjm_iv_int(-a.hi, -a.lo); }
__device__ __forceinline__ fjm_iv fjm_iv_abs(fjm_iv a) {
  if (a.lo >= 0) return a;
  if (a.hi <= 0) return fjm_iv_neg(a);
  return fjm_iv_int(0, fjm_ll_max(-a.lo, a.hi));
}
__device__ __forceinline__ fjm_iv fjm_iv_sign(fjm_iv a) {
  return fjm_iv{(a.lo > 0) - (a.lo < 0), (a.hi > 0) - (a.hi < 0)};
}
// Truncating division is monotone in each argument while the divisor keeps its sign: the corners bound it (a
// corner of INT_MIN / -1 leaves int32, so that box gives any int32, as XLA's wrap to INT_MIN needs).
__device__ __forceinline__ fjm_iv fjm_iv_div(fjm_iv a, fjm_iv b) {
  if (b.lo > 0 || b.hi < 0) {
    const long long c0 = a.lo / b.lo, c1 = a.lo / b.hi, c2 = a.hi / b.lo, c3 = a.hi / b.hi;
    return fjm_iv_int(fjm_ll_min(fjm_ll_min(c0, c1), fjm_ll_min(c2, c3)), fjm_ll_max(fjm_ll_max(c0, c1), fjm_ll_max(c2, c3)));
  }
  return fjm_iv_any_int();
}
// A remainder takes the dividend's sign and a smaller magnitude (x % 0 = x, x % -1 = 0 included); by a positive
// constant m over a dividend range shorter than m that does not wrap past a multiple of m, it is the ends' own.
__device__ __forceinline__ fjm_iv fjm_iv_rem(fjm_iv a, fjm_iv b) {
  fjm_iv r{fjm_ll_min(a.lo, 0), fjm_ll_max(a.hi, 0)};
  if (!fjm_iv_single(b) || b.lo == 0 || b.lo == -1) return r;
  const long long m = b.lo < 0 ? -b.lo : b.lo;
  if (a.lo >= 0 && a.hi - a.lo < m && a.lo % m <= a.hi % m) return fjm_iv{a.lo % m, a.hi % m};
  if (a.hi <= 0 && a.hi - a.lo < m && a.lo % m <= a.hi % m) return fjm_iv{a.lo % m, a.hi % m};
  return fjm_iv{fjm_ll_max(r.lo, 1 - m), fjm_ll_min(r.hi, m - 1)};
}
__device__ __forceinline__ fjm_iv fjm_iv_shl(fjm_iv a, fjm_iv s) {
  if (!fjm_iv_single(s)) return fjm_iv_any_int();
  if (s.lo < 0 || s.lo >= 32) return fjm_iv_point(0);
  return fjm_iv_mul(a, fjm_iv_point(1LL << s.lo));
}
// An arithmetic shift right keeps the sign and never grows the magnitude; by a constant it is monotone.
__device__ __forceinline__ fjm_iv fjm_iv_shr_arithmetic(fjm_iv a, fjm_iv s) {
  if (!fjm_iv_single(s)) return fjm_iv{fjm_ll_min(a.lo, 0), fjm_ll_max(a.hi, 0)};
  if (s.lo < 0 || s.lo >= 32) return fjm_iv{a.lo < 0 ? -1 : 0, a.hi < 0 ? -1 : 0};
  return fjm_iv{a.lo >> s.lo, a.hi >> s.lo};
}
__device__ __forceinline__ fjm_iv fjm_iv_shr_logical(fjm_iv a, fjm_iv s) {
  if (a.lo < 0) return fjm_iv_any_int();  // a negative value shifts in as a large unsigned one
  if (!fjm_iv_single(s)) return fjm_iv{0, a.hi};
  if (s.lo < 0 || s.lo >= 32) return fjm_iv_point(0);
  return fjm_iv{a.lo >> s.lo, a.hi >> s.lo};
}
__device__ __forceinline__ fjm_iv fjm_iv_min(fjm_iv a, fjm_iv b) {
  return fjm_iv{fjm_ll_min(a.lo, b.lo), fjm_ll_min(a.hi, b.hi)};
}
__device__ __forceinline__ fjm_iv fjm_iv_max(fjm_iv a, fjm_iv b) {
  return fjm_iv{fjm_ll_max(a.lo, b.lo), fjm_ll_max(a.hi, b.hi)};
}
// 2^k - 1 for the smallest k with v <= 2^k - 1 (v >= 0): a bound on an or / xor of values up to v.
__device__ __forceinline__ long long fjm_ll_fill_bits(long long v) {
  long long all = 0;
  while (all < v) all = all * 2 + 1;
  return all;
}
// On bool (0 / 1) and / or / xor / not are logic; on int32 bitwise, bounded only for non-negative values.
__device__ __forceinline__ fjm_iv fjm_iv_and_bool(fjm_iv a, fjm_iv b) { return fjm_iv_min(a, b); }
__device__ __forceinline__ fjm_iv fjm_iv_or_bool(fjm_iv a, fjm_iv b) { return fjm_iv_max(a, b); }
__device__ __forceinline__ fjm_iv fjm_iv_xor_bool(fjm_iv a, fjm_iv b) { return fjm_iv_any_bool(); }
__device__ __forceinline__ fjm_iv fjm_iv_not_bool(fjm_iv a) { return fjm_iv{1 - a.hi, 1 - a.lo}; }
__device__ __forceinline__ fjm_iv fjm_iv_and_int(fjm_iv a, fjm_iv b) {
  if (a.lo >= 0 && b.lo >= 0) return fjm_iv{0, fjm_ll_min(a.hi, b.hi)};
  if (a.lo >= 0) return fjm_iv{0, a.hi};
  if (b.lo >= 0) return fjm_iv{0, b.hi};
  return fjm_iv_any_int();
}
__device__ __forceinline__ fjm_iv fjm_iv_or_int(fjm_iv a, fjm_iv b) {
  if (a.lo < 0 || b.lo < 0) return fjm_iv_any_int();
  return fjm_iv{fjm_ll_max(a.lo, b.lo), fjm_ll_fill_bits(fjm_ll_max(a.hi, b.hi))};
}
__device__ __forceinline__ fjm_iv fjm_iv_xor_int(fjm_iv a, fjm_iv b) {
  if (a.lo < 0 || b.lo < 0) return fjm_iv_any_int();
  return fjm_iv{0, fjm_ll_fill_bits(fjm_ll_max(a.hi, b.hi))};
}
__device__ __forceinline__ fjm_iv fjm_iv_not_int(fjm_iv a) { return fjm_iv{-a.hi - 1, -a.lo - 1}; }  // ~x = -x - 1
__device__ __forceinline__ fjm_iv fjm_iv_bool(bool never, bool always) {
  return always ? fjm_iv_point(1) : (never ? fjm_iv_point(0) : fjm_iv_any_bool());
}
__device__ __forceinline__ fjm_iv fjm_iv_eq(fjm_iv a, fjm_iv b) {
  return fjm_iv_bool(a.hi < b.lo || b.hi < a.lo, fjm_iv_single(a) && fjm_iv_single(b) && a.lo == b.lo);
}
__device__ __forceinline__ fjm_iv fjm_iv_ne(fjm_iv a, fjm_iv b) { return fjm_iv_not_bool(fjm_iv_eq(a, b)); }
__device__ __forceinline__ fjm_iv fjm_iv_lt(fjm_iv a, fjm_iv b) { return fjm_iv_bool(a.lo >= b.hi, a.hi < b.lo); }
__device__ __forceinline__ fjm_iv fjm_iv_le(fjm_iv a, fjm_iv b) { return fjm_iv_bool(a.lo > b.hi, a.hi <= b.lo); }
__device__ __forceinline__ fjm_iv fjm_iv_gt(fjm_iv a, fjm_iv b) { return fjm_iv_lt(b, a); }
__device__ __forceinline__ fjm_iv fjm_iv_ge(fjm_iv a, fjm_iv b) { return fjm_iv_le(b, a); }
__device__ __forceinline__ fjm_iv fjm_iv_to_bool(fjm_iv a) { return fjm_iv_bool(a.lo == 0 && a.hi == 0, a.lo > 0 || a.hi < 0); }
__device__ __forceinline__ fjm_iv fjm_iv_to_int32(fjm_iv a) { return a; }
__device__ __forceinline__ fjm_iv fjm_iv_select(fjm_iv p, fjm_iv on_false, fjm_iv on_true) {
  return p.lo == 1 ? on_true : (p.hi == 0 ? on_false : fjm_iv_hull(on_false, on_true));
}
// The elements a field read reaches over the box: each index range clamped as fjm_read clamps it (clamping is
// monotone), then the min and max of at most FJM_BOX_MAX_READS elements, walked by nested loops: the bits kernel
// evaluates a box per 16-row x 32-key word, a document mask's box reads 48 ids, and a flat walk that decoded each
// element's position with 64-bit division and modulo made those reads most of the kernel's time.
__device__ __forceinline__ fjm_iv fjm_iv_read(const FlashjaxMaskField& f, fjm_iv i0, fjm_iv i1, fjm_iv i2, fjm_iv i3) {
  if (f.extent[0] <= 0 || f.extent[1] <= 0 || f.extent[2] <= 0 || f.extent[3] <= 0) return fjm_iv_point(0);
  const fjm_iv ranges[4] = {i0, i1, i2, i3};
  long long first[4], last[4], elements = 1;
  for (int d = 0; d < 4; ++d) {
    const long long top = f.extent[d] - 1;
    first[d] = fjm_ll_min(fjm_ll_max(ranges[d].lo, 0), top);
    last[d] = fjm_ll_min(fjm_ll_max(ranges[d].hi, 0), top);
    elements *= last[d] - first[d] + 1;
    if (elements > FJM_BOX_MAX_READS) return fjm_iv_any_int();
  }
  // The last axis the box varies along becomes the innermost loop (the axes after it hold one element each, so
  // swapping it with axis 3 walks the same elements): a field read by q or by kv alone is one strided run.
  long long stride[4] = {f.stride[0], f.stride[1], f.stride[2], f.stride[3]};
  int run = 3;
  while (run > 0 && first[run] == last[run]) --run;
  const long long run_first = first[run], run_last = last[run], run_stride = stride[run];
  first[run] = first[3], last[run] = last[3], stride[run] = stride[3];
  fjm_iv seen{2147483647LL, -2147483647LL - 1};
  for (long long i = first[0]; i <= last[0]; ++i) {
    for (long long j = first[1]; j <= last[1]; ++j) {
      for (long long k = first[2]; k <= last[2]; ++k) {
        const int* line = f.data + i * stride[0] + j * stride[1] + k * stride[2];
#if defined(__CUDACC__)
#pragma unroll 8
#endif
        for (long long l = run_first; l <= run_last; ++l) {  // independent loads: several in flight at once
          const long long v = line[l * run_stride];
          seen = fjm_iv{fjm_ll_min(seen.lo, v), fjm_ll_max(seen.hi, v)};
        }
      }
    }
  }
  return seen;
}
#endif  // FLASHJAX_MASK_BOX_HELPERS
"""

# graph op -> the interval helper, per operand dtype where logic and bitwise differ.
_LOGIC_OPS = ("and", "or", "xor", "not")


def _helper(op: str, dtype: str) -> str:
    return f"fjm_iv_{op}_{'bool' if dtype == 'bool' else 'int'}" if op in _LOGIC_OPS else f"fjm_iv_{op}"


def _table_bounds(table: ConstTable) -> str:
    values = table.array().astype(np.int64)
    low, high = (int(values.min()), int(values.max())) if values.size else (0, 0)
    return f"fjm_iv{{{low}LL, {high}LL}}"


def emit_box_function(graph: MaskGraph, function_name: str = DEFAULT_FUNCTION_NAME) -> str:
    """The C++ of ``<function_name>_box(int b, int h, int q_lo, int q_hi, int kv_lo, int kv_hi, f)`` with the
    interval helpers; to follow a mod's source (which defines FlashjaxMaskFields and the fjm_ helpers)."""
    if not function_name.isidentifier():
        raise ValueError(f"function_name must be a C identifier, got {function_name!r}")
    index = {"b": "fjm_iv_point(b)", "h": "fjm_iv_point(h)", "q_idx": "fjm_iv{q_lo, q_hi}",
             "kv_idx": "fjm_iv{kv_lo, kv_hi}"}  # the box: one (b, h), ranges of q and kv
    names: dict[int, str] = {}  # node -> its interval's C++
    literals: dict[int, str] = {}  # constant node -> its C++ literal
    tables: dict[ConstTable, str] = {}
    body = []
    for node_id in graph.reachable():
        node = graph.nodes[node_id]
        args = [names[a] for a in node.args]
        if node.op == "const":
            literals[node_id] = const_literal(node)
            names[node_id] = f"fjm_iv_point({cxx_int_literal(int(node.attr))})"
            continue
        if node.op == "index":
            expression = index[node.attr]
        elif node.op == "field":
            padded = args + ["fjm_iv_point(0)"] * (MAX_FIELD_RANK - len(args))
            expression = f"fjm_iv_read(f.field[{node.attr}], {', '.join(padded)})"
        else:
            # Single-valued arguments: the node's own C++ (the predicate's, mask_emit), so a point is exact.
            scalar_args = {a: literals.get(a) or (f"({names[a]}.lo != 0)" if graph.nodes[a].dtype == "bool"
                                                  else f"(int){names[a]}.lo") for a in node.args}
            if node.op == "table":
                table_name = tables.setdefault(node.attr, f"{function_name}_box_table{len(tables)}")
                exact = table_read(table_name, node.attr, [scalar_args[a] for a in node.args])
                ranged = _table_bounds(node.attr)
            else:
                arg_dtypes = tuple(graph.nodes[a].dtype for a in node.args)
                exact = OPS[node.op].cxx(arg_dtypes, tuple(scalar_args[a] for a in node.args))
                ranged = f"{_helper(node.op, arg_dtypes[-1])}({', '.join(args)})"
            singles = " && ".join(f"fjm_iv_single({names[a]})" for a in dict.fromkeys(node.args) if a not in literals)
            expression = f"({singles}) ? fjm_iv_point((long long)({exact})) : {ranged}"
        local = f"x{len(body)}"
        body.append(f"  const fjm_iv {local} = {expression};")
        names[node_id] = local
    output = names[graph.output]
    return "\n".join([
        BOX_HELPERS,
        *table_definitions(tables),
        f"// {graph.mod_class}'s predicate over a box of (q, kv) at one (b, h): FJM_BOX_FALSE, _TRUE or _MIXED.",
        f"__device__ __forceinline__ int {function_name}_box(int b, int h, int q_lo, int q_hi, int kv_lo, "
        "int kv_hi, const FlashjaxMaskFields& f) {",
        "  (void)b; (void)h; (void)q_lo; (void)q_hi; (void)kv_lo; (void)kv_hi; (void)f;  // a mod may read none",
        *body,
        f"  const fjm_iv out = {output};",
        "  return out.lo == 1 ? FJM_BOX_TRUE : (out.hi == 0 ? FJM_BOX_FALSE : FJM_BOX_MIXED);",
        "}",
        "",
    ])
