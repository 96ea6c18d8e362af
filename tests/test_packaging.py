"""The installed package is the one the suite tests, and it is whole: the wheel carries every file of
mdsl/ (the megakernel's device code is read beside its module at run time), and the megakernel's
source builds from the installed package as from the checkout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

import mdsl
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.runtime.kernel_source import generate_source
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import build_plan
from tests.megakernel.tiny import tiny_config_dict

ROOT = Path(__file__).resolve().parents[1]

#: generate_source(build_plan(...)) for a tiny model, run by a Python that sees only the unpacked wheel
#: (argv: the wheel's folder, the model's config as JSON); prints the source's length
_BUILD_FROM_WHEEL = """
import json, sys
from pathlib import Path
import mdsl
assert Path(mdsl.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), mdsl.__file__
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.runtime.kernel_source import generate_source
from mdsl.megakernel.runtime.shape import decoder_shape
from mdsl.megakernel.runtime.task_plan import build_plan
config = config_from_dict(json.loads(sys.argv[2]))
print(len(generate_source(build_plan(decoder_shape(config), workers=8, max_seq=config.max_positions)).text))
"""


def _installed_location() -> Path:
    """Where the installed distribution's `mdsl` package is: the folder an editable install points at, or
    the one its files were copied to. The installed distribution is the one an installer recorded
    (its INSTALLER file): a build leaves an `mdsl.egg-info` in the checkout too, which is not one."""
    installed = [d for d in metadata.distributions(name="mdsl") if d.read_text("INSTALLER") is not None]
    if not installed:
        pytest.fail("mdsl is not installed: the suite tests the installed package (pip install \".[test]\"), "
                    "or a working tree that PYTHONPATH names")
    dist = installed[0]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    if direct.get("dir_info", {}).get("editable"):
        return Path(unquote(urlparse(direct["url"]).path)).resolve() / "mdsl"
    return Path(dist.locate_file("mdsl")).resolve()


def test_mdsl_is_imported_from_where_it_is_installed():
    """`python -m pytest` from the checkout imports the installed mdsl (tests/conftest.py), or a working
    tree that PYTHONPATH names (a deliberate choice); never the checkout's mdsl only because the working
    directory is on sys.path."""
    imported = Path(mdsl.__file__).resolve().parent
    named = [Path(p).resolve() / "mdsl" for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    allowed = {_installed_location(), *(p for p in named if (p / "__init__.py").is_file())}
    assert imported in allowed, (f"the suite imports mdsl from {imported}, but it is installed at "
                                 f"{_installed_location()}: run the README's test command "
                                 f"(pip install \".[test]\" && python -m pytest)")


def _package_files(top: Path) -> set:
    """Every file of the package tree `top` (its compiled bytecode left out), relative to top's parent."""
    return {p.relative_to(top.parent).as_posix() for p in top.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel `pip install .` builds from this checkout (built from a copy, so that the build's
    scratch folders stay out of the checkout)."""
    src = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "mdsl", src / "mdsl", ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "--no-cache-dir", "--quiet", "--wheel-dir", str(out), str(src)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = out.glob("mdsl-*.whl")
    return path


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_wheel_has_every_file_of_the_package_and_nothing_else(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    shipped = {n for n in names if n.startswith("mdsl/")}
    expected = _package_files(ROOT / "mdsl")
    assert any(not n.endswith(".py") for n in expected)   # the check covers data files, not modules alone
    assert expected - shipped == set(), "add their patterns to [tool.setuptools.package-data] in pyproject.toml"
    assert shipped - expected == set()
    dist_info = "-".join(wheel.name.split("-")[:2]) + ".dist-info"   # mdsl-<version>.dist-info
    assert {n.split("/")[0] for n in names - shipped} == {dist_info}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_unpacked_wheel_builds_the_megakernel_source(wheel, tmp_path):
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    done = subprocess.run([sys.executable, "-c", _BUILD_FROM_WHEEL, str(site), json.dumps(tiny_config_dict())],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.strip()) > 10_000


def test_the_megakernel_source_builds_from_the_imported_package():
    """The reproduction of a wheel without its device code: run against the installed package, as the
    README's test command runs the suite."""
    config = config_from_dict(tiny_config_dict())
    source = generate_source(build_plan(decoder_shape(config), workers=8, max_seq=config.max_positions))
    assert "struct Params {" in source.text and "__global__" in source.text
