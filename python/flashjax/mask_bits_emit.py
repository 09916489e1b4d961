"""The mask-bits kernel's source: a mod's predicate, split by what each part depends on, and the kernel that packs
it into the bitmask the attention kernels read (docs/mask_codegen.md, "The mask-bits kernel").

The kernel evaluates the predicate at every (b, h, q, kv): 67M points for a B 4 x 4096 x 4096 mask. Most of a
typical predicate depends on q or on kv alone (a document mask reads ids[b, q] and ids[b, kv], then compares), so
the output, an and (or an or) of terms, is emitted in three functions:

- ``<name>_row(b, h, q_idx, f)``: the terms without kv, joined into ``term``, and the nodes without kv that the
  pair reads; once per query row, and a whole word per row (b, h and q are the same across a warp);
- ``<name>_col(b, h, kv_idx, f)``: the terms with kv and without q, and the kv-only nodes the pair reads; once
  per key for every row, its term one ballot per word;
- ``<name>_pair(b, h, q_idx, kv_idx, row, col, f)``: the mixed terms, per (q, kv).

``pair op row.term op col.term`` is the predicate: the same nodes, the same C++ expressions (the host tests check
it for every example mod). The split is done here rather than left to the compiler, which does not move field
loads across the warp votes of the loop.
"""

from __future__ import annotations

from flashjax.mask_box_emit import emit_box_function
from flashjax.mask_emit import DEFAULT_FUNCTION_NAME, cxx_type, emit_nodes, table_definitions
from flashjax.mask_graph import ConstTable, MaskGraph

__all__ = ["BITS_BLOCK_THREADS", "BITS_ROWS_PER_WARP", "emit_split_predicate", "bits_kernel_source"]

# The kernel's launch shape, which csrc/ffi/mask_bits_ffi.cpp mirrors (kBlockThreads, kRowsPerWarp).
BITS_BLOCK_THREADS = 128
BITS_ROWS_PER_WARP = 16


def _index_dependencies(graph: MaskGraph) -> dict[int, frozenset[str]]:
    """For each reachable node, the index names it depends on."""
    depends: dict[int, frozenset[str]] = {}
    for node_id in graph.reachable():
        node = graph.nodes[node_id]
        own = frozenset([node.attr]) if node.op == "index" else frozenset()
        depends[node_id] = own.union(*(depends[a] for a in node.args))
    return depends


def _closure(graph: MaskGraph, roots: list[int]) -> list[int]:
    """roots and every node they depend on, in topological order."""
    seen, stack = set(), list(roots)
    while stack:
        node_id = stack.pop()
        if node_id not in seen:
            seen.add(node_id)
            stack.extend(graph.nodes[node_id].args)
    return sorted(seen)


def _struct(name: str, graph: MaskGraph, members: list[int], expressions: dict[int, str]) -> list[str]:
    lines = [f"struct {name} {{", "  bool term;  // the part's terms of the output, joined"]
    lines += [f"  {cxx_type(graph.nodes[i].dtype)} {expressions[i]};" for i in members]
    return lines + ["};"]


def _terms(graph: MaskGraph) -> tuple[str, list[int]]:
    """The output as ``op`` ("and" or "or") over terms: the flattened top-level tree of that bool operation, or
    "and" over the output alone."""
    top = graph.nodes[graph.output]
    op = top.op if top.op in ("and", "or") and top.dtype == "bool" else "and"
    terms, stack = [], [graph.output]
    while stack:
        node = graph.nodes[stack[-1]]
        if node.op == op and node.dtype == "bool":
            stack.pop()
            stack.extend(reversed(node.args))
        else:
            terms.append(stack.pop())
    return op, terms


def _combine(op: str, expressions: list[str]) -> str:
    if not expressions:
        return "true" if op == "and" else "false"  # the operation's identity
    return f" {'&&' if op == 'and' else '||'} ".join(f"({e})" for e in expressions)


def emit_split_predicate(graph: MaskGraph, function_name: str = DEFAULT_FUNCTION_NAME) -> tuple[str, str]:
    """(the C++ of ``<function_name>_row``, ``_col`` and ``_pair`` with their structs ``_row_values`` and
    ``_col_values``, the operation "and" or "or" that joins their terms). To follow a mod's source, which
    defines FlashjaxMaskFields and the fjm_ helpers.

    The output is an and (or an or) of terms. The terms of q and not kv are joined into ``row.term``, those of kv
    and not q into ``col.term``, the rest are ``pair``'s value: the predicate is ``pair op row.term op
    col.term``. Since b, h and q are the same across a warp, the kernel applies row.term to whole words and ballots
    col.term once per word for every row, so per (q, kv) only the mixed terms are evaluated.
    """
    if not function_name.isidentifier():
        raise ValueError(f"function_name must be a C identifier, got {function_name!r}")
    depends = _index_dependencies(graph)
    order = graph.reachable()
    op, terms = _terms(graph)
    row_terms = [t for t in terms if "kv_idx" not in depends[t]]
    col_terms = [t for t in terms if "kv_idx" in depends[t] and "q_idx" not in depends[t]]
    pair_terms = [t for t in terms if {"q_idx", "kv_idx"} <= depends[t]]
    has_local = {i for i in order if graph.nodes[i].op not in ("const", "index")}  # emit_nodes inlines the rest
    pair_ids = [i for i in _closure(graph, pair_terms) if {"q_idx", "kv_idx"} <= depends[i]]
    pair_inputs = {a for i in pair_ids for a in graph.nodes[i].args}
    # What pair takes from the others: row-part nodes (no kv) and column-part nodes (kv, no q) it reads. A node of
    # b and h alone belongs to the rows; the column part recomputes any it needs, a few instructions per key.
    row_members = [i for i in order if "kv_idx" not in depends[i] and i in pair_inputs and i in has_local]
    col_members = [i for i in order if "kv_idx" in depends[i] and "q_idx" not in depends[i]
                   and i in pair_inputs and i in has_local]
    tables: dict[ConstTable, str] = {}
    prefix = f"{function_name}_split"

    row_exprs: dict[int, str] = {}
    row_body = emit_nodes(graph, _closure(graph, row_members + row_terms), row_exprs, tables, table_prefix=prefix,
                          local_prefix="r")
    col_exprs: dict[int, str] = {}
    col_body = emit_nodes(graph, _closure(graph, col_members + col_terms), col_exprs, tables, table_prefix=prefix,
                          local_prefix="c")
    pair_exprs: dict[int, str] = {}
    for i in order:
        if i in row_members:
            pair_exprs[i] = f"row.{row_exprs[i]}"
        elif i in col_members:
            pair_exprs[i] = f"col.{col_exprs[i]}"
        elif i not in has_local:
            emit_nodes(graph, [i], pair_exprs, tables, table_prefix=prefix)  # a constant or an index: inlined
    pair_body = emit_nodes(graph, pair_ids, pair_exprs, tables, table_prefix=prefix, local_prefix="p")

    row_struct, col_struct = f"{function_name}_row_values", f"{function_name}_col_values"
    fields = "const FlashjaxMaskFields& f"
    row_values = [_combine(op, [row_exprs[t] for t in row_terms])] + [row_exprs[i] for i in row_members]
    col_values = [_combine(op, [col_exprs[t] for t in col_terms])] + [col_exprs[i] for i in col_members]
    lines = [
        f"// {graph.mod_class}'s predicate split by dependence (flashjax.mask_bits_emit): pair {op} row.term "
        f"{op} col.term.",
        *table_definitions(tables),
        *_struct(row_struct, graph, row_members, row_exprs),
        *_struct(col_struct, graph, col_members, col_exprs),
        f"__device__ __forceinline__ {row_struct} {function_name}_row(int b, int h, int q_idx, {fields}) {{",
        *row_body,
        f"  return {row_struct}{{{', '.join(row_values)}}};",
        "}",
        f"__device__ __forceinline__ {col_struct} {function_name}_col(int b, int h, int kv_idx, {fields}) {{",
        *col_body,
        f"  return {col_struct}{{{', '.join(col_values)}}};",
        "}",
        f"__device__ __forceinline__ bool {function_name}_pair(int b, int h, int q_idx, int kv_idx, "
        f"const {row_struct}& row, const {col_struct}& col, {fields}) {{",
        *pair_body,
        f"  return {_combine(op, [pair_exprs[t] for t in pair_terms])};",
        "}",
        "",
    ]
    return "\n".join(lines), op


def bits_kernel_source(graph: MaskGraph, kernel_name: str, function_name: str = DEFAULT_FUNCTION_NAME) -> str:
    """The split predicate and the mask-bits kernel ``kernel_name`` (extern "C"), to follow the mod's source. It
    writes the bitmask [batch, heads, seqlen_q, words] uint32, words = ceil(seqlen_k / 32): bit j of word
    [b, h, q, w] is set iff the predicate holds at (b, h, q, 32 * w + j) and 32 * w + j < seqlen_k.

    One warp owns BITS_ROWS_PER_WARP query rows by 32 consecutive words. Lane l evaluates key 32 * w + l, so a
    field read indexed by kv is one coalesced load per word and a ballot packs the word; the row parts are
    computed once per task, the column part once per key for all the rows, and only the mixed terms (pair) per
    (q, kv): the words of the three are joined by the output's and / or at the store. Before any of that, lane i
    evaluates the mod over its word's box (the task's rows x 32 keys) by interval arithmetic (mask_box_emit): a word
    the box settles is stored as all ones or all zeros, and only the unsettled words are evaluated point by point
    (a band or a document mask settles all but the words its edges cross). Lane i keeps word i of each
    row, so each row's 32 words go out as one coalesced 128-byte store. (A thread that built its own word from 32
    keys would hoist the same, but each of its warp's kv-indexed loads would touch 32 cache lines.) The warps walk
    (b, h, row group, word chunk) tasks in a grid-stride loop, so a capped grid covers any size; the host
    guarantees that seqlen_q + 16, 32 * words + 31 and batch * heads fit in int.
    """
    if not kernel_name.isidentifier():
        raise ValueError(f"kernel_name must be a C identifier, got {kernel_name!r}")
    name = function_name
    split, op = emit_split_predicate(graph, function_name)
    split += emit_box_function(graph, function_name)
    join = "&" if op == "and" else "|"
    return split + f"""
extern "C" __global__ void __launch_bounds__({BITS_BLOCK_THREADS}) {kernel_name}(
    const __grid_constant__ FlashjaxMaskFields f, int batch, int heads, int seqlen_q, int seqlen_k,
    unsigned int* __restrict__ bits) {{
  constexpr int kRows = {BITS_ROWS_PER_WARP};
  const int words = seqlen_k / 32 + (seqlen_k % 32 != 0);
  const int chunks = words / 32 + (words % 32 != 0);
  const int row_groups = seqlen_q / kRows + (seqlen_q % kRows != 0);
  const long long tasks = (long long)batch * heads * row_groups * chunks;
  const int lane = threadIdx.x % 32;
  const long long warps_in_grid = (long long)gridDim.x * (blockDim.x / 32);
  for (long long task = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; task < tasks;
       task += warps_in_grid) {{  // warp-uniform, as every ballot below needs the whole warp
    const int chunk = (int)(task % chunks);
    const long long row_task = task / chunks;
    const int q0 = (int)(row_task % row_groups) * kRows;
    const int bh = (int)(row_task / row_groups);
    const int b = bh / heads, h = bh % heads;
    const int w0 = chunk * 32;
    const int chunk_words = min(32, words - w0);
    // Lane i's word covers this task's rows x keys 32 (w0 + i) ..+31: where the mod's value over that box is
    // settled (all false or all true, by interval arithmetic: {name}_box), no point of it is evaluated.
    const int box = lane < chunk_words
        ? {name}_box(b, h, q0, q0 + kRows - 1, (w0 + lane) * 32, (w0 + lane) * 32 + 31, f) : FJM_BOX_FALSE;
    const unsigned int unsettled = __ballot_sync(0xffffffffu, box == FJM_BOX_MIXED);
    {name}_row_values rows[kRows] = {{}};
    unsigned int row_bits[kRows] = {{}};
    unsigned int col_bits = 0u;  // lane i: word i of the column terms
    if (unsettled != 0u) {{
#pragma unroll
      for (int r = 0; r < kRows; ++r) rows[r] = {name}_row(b, h, q0 + r, f);  // past seqlen_q: never stored
    }}
    for (int i = 0; i < chunk_words; ++i) {{
      if (((unsettled >> i) & 1u) == 0u) continue;  // warp-uniform: the ballots below need the whole warp
      const int kv = (w0 + i) * 32 + lane;
      const {name}_col_values col = {name}_col(b, h, kv, f);
      const unsigned int col_word = __ballot_sync(0xffffffffu, col.term);
      if (lane == i) col_bits = col_word;
      bool allowed[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) allowed[r] = {name}_pair(b, h, q0 + r, kv, rows[r], col, f);
#pragma unroll
      for (int r = 0; r < kRows; ++r) {{
        const unsigned int word = __ballot_sync(0xffffffffu, allowed[r]);
        if (lane == i) row_bits[r] = word;
      }}
    }}
    if (lane < chunk_words) {{
      // Keys past seqlen_k were evaluated (their reads clamp) but are not part of the mask: their bits are 0.
      const int valid = seqlen_k - (w0 + lane) * 32;
      const unsigned int keep = valid >= 32 ? 0xffffffffu : (1u << valid) - 1u;
      const long long row0 = (long long)bh * seqlen_q + q0;
      const unsigned int settled_word = box == FJM_BOX_TRUE ? 0xffffffffu : 0u;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {{
        // The row terms are one value per row (b, h, q are the warp's): a whole word each.
        const unsigned int word = box != FJM_BOX_MIXED
            ? settled_word : (row_bits[r] {join} col_bits {join} (rows[r].term ? 0xffffffffu : 0u));
        if (q0 + r < seqlen_q) bits[(row0 + r) * words + w0 + lane] = word & keep;
      }}
    }}
  }}
}}
"""
