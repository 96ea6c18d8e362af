"""Suite-wide fixtures, and where the suite imports from.

The suite tests the installed mdsl (`pip install ".[test]"`, then `python -m pytest`): the checkout
supplies only the `tests` and `benchmarks` packages. `python -m` puts the working directory first on
sys.path, which would import the checkout's `mdsl` over the installed one and hide files the wheel
leaves out, so that entry is moved behind site-packages. A PYTHONPATH that names the checkout is a
deliberate choice (testing a working tree against an installed environment) and is left as it is;
tests/test_packaging.py checks where mdsl came from.
"""
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _same_dir(entry: str, directory: Path) -> bool:
    try:
        return Path(entry or os.getcwd()).resolve() == directory
    except OSError:
        return False


def _checkout_behind_site_packages() -> None:
    if any(_same_dir(p, ROOT) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p):
        return
    sys.path[:] = [p for p in sys.path if not _same_dir(p, ROOT)] + [str(ROOT)]


_checkout_behind_site_packages()

from tests.shared import SHARED_DIR_ENV  # noqa: E402 - after the fix-up: it imports mdsl


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_compile_cache: the module's cubin and PTX caches are the session's "
                                       "(tests/shared.py), not the test's own")
    if not hasattr(config, "workerinput"):   # the controller (or the only process): the xdist workers inherit it
        config._mdsl_shared_dir = tempfile.mkdtemp(prefix="mdsl-tests-shared-")
        os.environ[SHARED_DIR_ENV] = config._mdsl_shared_dir
        # the trust records (mdsl.search.trust) of what runs outside a test's own (module-scoped fixtures)
        config._mdsl_state_dir = tempfile.mkdtemp(prefix="mdsl-tests-state-")
        config._mdsl_state_before = os.environ.get("MDSL_STATE_DIR")
        os.environ["MDSL_STATE_DIR"] = config._mdsl_state_dir


def pytest_unconfigure(config):
    shared = getattr(config, "_mdsl_shared_dir", None)
    if shared:
        os.environ.pop(SHARED_DIR_ENV, None)
        shutil.rmtree(shared, ignore_errors=True)
    state = getattr(config, "_mdsl_state_dir", None)
    if state:
        if config._mdsl_state_before is None:
            os.environ.pop("MDSL_STATE_DIR", None)
        else:
            os.environ["MDSL_STATE_DIR"] = config._mdsl_state_before
        shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(autouse=True)
def _plan_cache_in_tmp(tmp_path_factory, monkeypatch, request):
    """No test reads or writes the user's plan cache (~/.cache/mdsl) or trust records (~/.local/state/mdsl).
    A module marked `shared_compile_cache` shares the session's cubin and PTX caches (tests/shared.py)."""
    root = tmp_path_factory.mktemp("mdsl-cache")
    monkeypatch.setenv("MDSL_CACHE_DIR", str(root))
    monkeypatch.setenv("MDSL_STATE_DIR", str(tmp_path_factory.mktemp("mdsl-state")))
    if request.node.get_closest_marker("shared_compile_cache") and os.environ.get(SHARED_DIR_ENV):
        for name in ("cubin", "ptx"):   # mdsl.backend.cuda.nvrtc.cache_dir(), mdsl.backend.ptx.compile.cache_dir()
            shared = os.path.join(os.environ[SHARED_DIR_ENV], name)
            os.makedirs(shared, exist_ok=True)
            os.symlink(shared, root / name)


def pytest_collection_modifyitems(config, items):
    """The modules whose tests may run longest first (a module's largest `timeout` mark; its tests stay
    together and in order, so module fixtures are made once): pytest-xdist hands tests out in this order,
    so the long ones start early and neither worker ends the run alone on one of them."""
    def seconds(item) -> float:
        mark = item.get_closest_marker("timeout")
        return 0 if mark is None else float(mark.args[0] if mark.args else mark.kwargs.get("timeout", 0))

    module = {id(item): getattr(item, "module", None) or item.path for item in items}
    longest: dict = {}
    for item in items:
        longest[module[id(item)]] = max(longest.get(module[id(item)], 0.0), seconds(item))
    first = {m: k for k, m in enumerate(dict.fromkeys(module[id(item)] for item in items))}
    items.sort(key=lambda item: (-longest[module[id(item)]], first[module[id(item)]]))
