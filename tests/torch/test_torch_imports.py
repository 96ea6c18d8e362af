"""torch stays optional: `import mdsl` (and the modules a CPU user loads) never imports torch; only mdsl.torch
does, and it registers the "mdsl" dynamo backend when imported."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_imports import import_graph


def test_no_module_outside_mdsl_torch_imports_it():
    graph = import_graph()
    bad = sorted(f"{m} imports {i}" for m, deps in graph.items() if not m.startswith("mdsl.torch")
                 for i in deps if i.startswith("mdsl.torch"))
    assert not bad, "\n".join(bad)


def test_import_mdsl_does_not_import_torch():
    code = ("import sys, mdsl, mdsl.search.engine, mdsl.frontend.kernel, mdsl.backend.reference; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_mdsl_torch_registers_the_backend():
    torch = pytest.importorskip("torch", reason="mdsl.torch needs PyTorch (the test extra installs its CPU build)")
    import mdsl.torch

    assert "mdsl" in torch._dynamo.list_backends(exclude_tags=())
    assert torch._dynamo.lookup_backend("mdsl") is mdsl.torch.mdsl_backend
