"""torch stays optional and loads late: `import mdsl` (and the modules a CPU user loads) never imports torch;
only mdsl.torch does, and that only when its names are used. torch.compile finds the "mdsl" backend through
the package's entry point without mdsl.torch being imported, and where the installed metadata lacks the entry
point, importing mdsl.torch registers the backend itself."""
from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

import mdsl
from tests.test_imports import import_graph

ROOT = Path(__file__).resolve().parents[2]

#: the CPU torch modules that compiling a model loads and importing mdsl.torch (with the entry point) does not
HEAVY = ("torch", "torch._dynamo", "functorch", "torch._inductor")


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


def test_importing_mdsl_torch_registers_the_backend(torch):
    import mdsl.torch

    assert "mdsl" in torch._dynamo.list_backends(exclude_tags=())
    assert torch._dynamo.lookup_backend("mdsl") is mdsl.torch.mdsl_backend


def test_the_packages_names_are_what_their_modules_define(torch):
    import mdsl.torch
    import mdsl.torch.report   # the module of `explain`, imported before the name is used

    for name in mdsl.torch.__all__:
        value = getattr(mdsl.torch, name)
        assert not isinstance(value, types.ModuleType) and name in dir(mdsl.torch), name
    assert mdsl.torch.explain is mdsl.torch.report.explain


def _declared_entry_points() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"].get("entry-points", {}).get("torch_dynamo_backends", {})


def test_pyproject_declares_the_backend_entry_point(torch):
    import mdsl.torch

    assert _declared_entry_points() == {"mdsl": mdsl.torch.BACKEND_ENTRY_POINT}


def _env(site: Path = None) -> dict:
    """The environment of a Python that imports this mdsl (and sees `site`'s distributions first)."""
    paths = [str(p) for p in (site, Path(mdsl.__file__).resolve().parents[1]) if p]
    paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def _run(code: str, site: Path = None) -> str:
    """`code` run by a Python of `_env(site)`; its output."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_env(site))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def installed(tmp_path, torch) -> Path:
    """A folder whose distribution declares pyproject.toml's `torch_dynamo_backends` entry points, as an
    installed mdsl does."""
    info = tmp_path / "mdsl_entry_point_check-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mdsl-entry-point-check\nVersion: 0\n")
    lines = [f"{name} = {value}" for name, value in _declared_entry_points().items()]
    (info / "entry_points.txt").write_text("\n".join(["[torch_dynamo_backends]", *lines, ""]))
    return tmp_path


#: torch.compile(backend="mdsl") on a small function, checked against eager
_COMPILE = """
import torch
fn = lambda x: torch.nn.functional.silu(x @ x) + 1.0
x = torch.randn(4, 4)
torch.testing.assert_close(torch.compile(fn, backend="mdsl")(x), fn(x))
"""

#: whether the backend torch looked up is mdsl.torch's
_SAME = """
import mdsl.torch
print(torch._dynamo.lookup_backend("mdsl") is mdsl.torch.mdsl_backend)
"""


def test_torch_compile_finds_the_backend_through_the_entry_point_without_mdsl_torch(installed):
    # nothing imports mdsl before torch.compile: the backend's lookup loads mdsl.torch.backend
    code = "import sys\n" + _COMPILE + "print('mdsl.torch.backend' in sys.modules)\n" + _SAME
    assert _run(code, installed) == "True\nTrue"


def test_importing_mdsl_torch_with_the_entry_point_installed_imports_no_torch(installed):
    code = f"import sys, mdsl.torch; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    assert _run(code, installed) == "[]"


def test_without_the_entry_point_importing_mdsl_torch_registers_the_backend(torch):
    # the installed metadata hidden from mdsl.torch and from torch's backend lookup alike
    hide = ("import importlib.metadata as md\n"
            "real = md.entry_points\n"
            "md.entry_points = lambda **kw: md.EntryPoints(()) if kw.get('group') == 'torch_dynamo_backends' "
            "else real(**kw)\n")
    assert _run(hide + "import mdsl.torch\n" + _COMPILE + _SAME) == "True"


#: collects the suite (the folder argv[1]) and prints which of the packages that take seconds to import it loaded
_COLLECT = """
import sys, pytest
code = pytest.main(["--collect-only", "-qq", "-p", "no:cacheprovider", sys.argv[1]])
print(sorted(m for m in ("torch", "transformers", "openai") if m in sys.modules))
sys.exit(code)
"""


@pytest.mark.slow
def test_collecting_the_suite_imports_no_torch_transformers_or_openai():
    """The tests import them in their bodies (tests/torch/conftest.py's `torch` fixture), so that collecting
    the suite, which every run does, costs none of their import time."""
    done = subprocess.run([sys.executable, "-c", _COLLECT, str(ROOT / "tests")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
