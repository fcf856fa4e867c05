"""`planning/` is pure (STYLE.md): it imports neither torch / CUDA code nor transformers, nor the packages downstream
or beside it on the data path (profiling, streaming, hf)."""

from __future__ import annotations

import ast
from pathlib import Path

import lazytrain_hf.planning as planning

FORBIDDEN = ("torch", "transformers", "lazytrain_hf.profiling", "lazytrain_hf.streaming", "lazytrain_hf.hf",
             "lazytrain_hf.optim")
RELATIVE_FORBIDDEN = ("profiling", "streaming", "hf", "optim")


def test_planning_imports_nothing_heavy():
    for path in Path(planning.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: ..profiling etc.
                    names = [f"..{node.module}"] if node.level > 1 and node.module else []
                    assert not (node.level > 1 and (node.module or "").split(".")[0] in RELATIVE_FORBIDDEN), \
                        f"{path.name}: from {'.' * node.level}{node.module}"
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert not name.startswith(FORBIDDEN), f"{path.name} imports {name}"
