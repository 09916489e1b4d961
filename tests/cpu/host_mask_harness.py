"""Runs generated mask-mod predicates on the host: the emitted C++ compiled by g++ with CUDA's qualifiers defined
away, under AddressSanitizer and UndefinedBehaviorSanitizer, so the tests check the C++ text itself (XLA's
semantics, no signed overflow or division UB, no read outside a field) on a machine without a GPU.

Every case goes into one program, compiled once: the predicates under distinct function names, the field values
and index grids as static arrays, one line of '0'/'1' per case on stdout.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import numpy as np

from flashjax.mask_trace import MAX_FIELD_RANK

SANITIZERS = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all")


@dataclasses.dataclass(frozen=True)
class HostCase:
    source: str  # a generated predicate module
    function_name: str
    fields: tuple  # int32 numpy arrays, graph order
    indices: tuple  # 1-D int32 arrays b, h, q_idx, kv_idx; the program evaluates their outer product


def compiler() -> str | None:
    return shutil.which("g++")


def _array(name: str, values: np.ndarray) -> str:
    flat = np.asarray(values, np.int64).reshape(-1)
    body = ", ".join(str(int(v)) if v != -2**31 else "(-2147483647 - 1)" for v in flat) or "0"
    return f"static const int {name}[] = {{{body}}};"


def _field_initializer(name: str, value: np.ndarray) -> str:
    shape = list(value.shape) + [1] * (MAX_FIELD_RANK - value.ndim)
    strides = [int(np.prod(shape[d + 1:value.ndim])) if d < value.ndim else 0 for d in range(MAX_FIELD_RANK)]
    return f"FlashjaxMaskField{{{name}, {{{', '.join(map(str, strides))}}}, {{{', '.join(map(str, shape))}}}}}"


def _fields(prefix: str, fields) -> tuple[list[str], list[str]]:
    """(the fields' static arrays, the lines that declare `f` with them) for one case's function."""
    arrays = [_array(f"{prefix}_field{j}", f) for j, f in enumerate(fields)]
    setup = ["  FlashjaxMaskFields f = {};"]
    setup += [f"  f.field[{j}] = {_field_initializer(f'{prefix}_field{j}', np.asarray(v))};" for j, v in enumerate(fields)]
    return arrays, setup


def _program(preamble: list[str], functions: list[list[str]]) -> str:
    """The host program: CUDA's qualifiers defined away, the generated sources, one function per case, and a main
    that runs them in order."""
    lines = ["#include <cstdio>", "#define __device__", "#define __forceinline__ inline", *preamble]
    for function in functions:
        lines += function
    lines += ["int main() {", *[f"  run{k}();" for k in range(len(functions))], "  return 0;", "}"]
    return "\n".join(lines) + "\n"


def _case_function(k: int, case: HostCase) -> list[str]:
    lines, setup = _fields(f"case{k}", case.fields)
    names = ("b", "h", "q", "kv")
    lines += [_array(f"case{k}_{n}", i) for n, i in zip(names, case.indices)]
    sizes = [len(i) for i in case.indices]
    lines.append(f"static void run{k}() {{")
    lines += setup
    loops = "".join(f"for (int i{d} = 0; i{d} < {n}; ++i{d}) " for d, n in enumerate(sizes))
    call = ", ".join(f"case{k}_{n}[i{d}]" for d, n in enumerate(names))
    lines.append(f"  {loops}putchar({case.function_name}({call}, f) ? '1' : '0');")
    lines += ["  putchar('\\n');", "}"]
    return lines


def program_source(cases: list[HostCase]) -> str:
    return _program([case.source for case in cases], [_case_function(k, case) for k, case in enumerate(cases)])


def _compile_and_run(program: str, workdir: Path, stem: str, what: str) -> list[str]:
    """The program's stdout lines, compiled by g++ under the sanitizers; raises with the compiler's or the
    sanitizer's report."""
    source, binary = workdir / f"{stem}.cpp", workdir / stem
    source.write_text(program)
    build = subprocess.run([compiler(), "-std=c++17", "-O1", "-Wall", "-Werror", "-Wno-unused-parameter",
                            "-Wno-unused-function", *SANITIZERS, str(source), "-o", str(binary)],
                           capture_output=True, text=True)
    if build.returncode != 0:
        raise AssertionError(f"g++ rejected the generated {what} ({source}):\n{build.stderr[-4000:]}")
    result = subprocess.run([str(binary)], capture_output=True, text=True)
    if result.returncode != 0:
        raise AssertionError(f"host {what} program failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout.split("\n")


def run_on_host(cases: list[HostCase], workdir: Path) -> list[np.ndarray]:
    """Each case's predicate values, bool [nb, nh, nq, nk]; raises with the sanitizer's report on any UB."""
    rows = _compile_and_run(program_source(cases), workdir, "host_masks", "predicates")
    return [np.frombuffer(row.encode(), np.uint8).reshape([len(i) for i in case.indices]) == ord("1")
            for row, case in zip(rows, cases)]


@dataclasses.dataclass(frozen=True)
class BoxCase:
    source: str  # a generated predicate module followed by its box function (flashjax.mask_box_emit)
    function_name: str  # the predicate's; the box function is <function_name>_box
    fields: tuple  # int32 numpy arrays, graph order
    boxes: np.ndarray  # int32 [n, 6]: b, h, q_lo, q_hi, kv_lo, kv_hi


def run_boxes_on_host(cases: list[BoxCase], workdir: Path) -> list[np.ndarray]:
    """Each case's box classes, int [n] (FJM_BOX_FALSE / _MIXED / _TRUE), computed by the emitted C++ under the
    sanitizers."""
    functions = []
    for k, case in enumerate(cases):
        lines, setup = _fields(f"box{k}", case.fields)
        lines += [_array(f"box{k}_boxes", np.asarray(case.boxes, np.int32)), f"static void run{k}() {{", *setup,
                  f"  for (int i = 0; i < {len(case.boxes)}; ++i) {{", f"    const int* x = box{k}_boxes + 6 * i;",
                  f"    putchar('0' + {case.function_name}_box(x[0], x[1], x[2], x[3], x[4], x[5], f));",
                  "  }", "  putchar('\\n');", "}"]
        functions.append(lines)
    rows = _compile_and_run(_program([case.source for case in cases], functions), workdir, "host_boxes",
                            "box functions")
    return [np.frombuffer(row.encode(), np.uint8).astype(int) - ord("0") for row, _ in zip(rows, cases)]
