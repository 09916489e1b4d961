"""The lab's tools still parse, and the repository paths they and the workflow scripts name still exist (the tools
moved from tools/ to lab/tools/ and call each other by path)."""
import py_compile
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOLS = sorted((REPO / "lab" / "tools").iterdir())
# A path under one of these folders, as scripts and their comments name it (e.g. lab/tools/sass.sh, bench/bench.py).
PATH = re.compile(r"(?<![\w./-])((?:lab/(?:tools|experiments|log|results)|tools|bench)/[\w.-]+\.(?:py|sh|md|txt|json))")


@pytest.mark.parametrize("tool", [t for t in TOOLS if t.suffix == ".py"], ids=lambda t: t.name)
def test_python_tool_compiles(tool, tmp_path):
    py_compile.compile(str(tool), cfile=str(tmp_path / "out.pyc"), doraise=True)


@pytest.mark.parametrize("tool", [t for t in TOOLS if t.suffix == ".sh"], ids=lambda t: t.name)
def test_shell_tool_parses(tool):
    subprocess.run(["bash", "-n", str(tool)], check=True)


def test_named_paths_exist():
    sources = TOOLS + sorted((REPO / "tools").glob("*.sh")) + sorted((REPO / "bench").glob("*.py"))
    sources += [REPO / "lab" / "README.md", REPO / "lab" / "hot_loop_fingerprint.txt"]
    missing = sorted({f"{src.relative_to(REPO)}: {p}" for src in sources for p in PATH.findall(src.read_text())
                      if not (REPO / p).exists()})
    assert not missing, missing
