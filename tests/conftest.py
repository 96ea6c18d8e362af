"""Suite-wide fixtures."""
import os
import shutil
import tempfile

import pytest

from tests.shared import SHARED_DIR_ENV


def pytest_configure(config):
    config.addinivalue_line("markers", "shared_compile_cache: the module's cubin and PTX caches are the session's "
                                       "(tests/shared.py), not the test's own")
    if not hasattr(config, "workerinput"):   # the controller (or the only process): the xdist workers inherit it
        config._mdsl_shared_dir = tempfile.mkdtemp(prefix="mdsl-tests-shared-")
        os.environ[SHARED_DIR_ENV] = config._mdsl_shared_dir


def pytest_unconfigure(config):
    shared = getattr(config, "_mdsl_shared_dir", None)
    if shared:
        os.environ.pop(SHARED_DIR_ENV, None)
        shutil.rmtree(shared, ignore_errors=True)


@pytest.fixture(autouse=True)
def _plan_cache_in_tmp(tmp_path_factory, monkeypatch, request):
    """No test reads or writes the user's plan cache (~/.cache/mdsl). A module marked
    `shared_compile_cache` shares the session's cubin and PTX caches (tests/shared.py)."""
    root = tmp_path_factory.mktemp("mdsl-cache")
    monkeypatch.setenv("MDSL_CACHE_DIR", str(root))
    if request.node.get_closest_marker("shared_compile_cache") and os.environ.get(SHARED_DIR_ENV):
        for name in ("cubin", "ptx"):   # mdsl.backend.cuda.nvrtc.cache_dir(), mdsl.backend.ptx.compile.cache_dir()
            shared = os.path.join(os.environ[SHARED_DIR_ENV], name)
            os.makedirs(shared, exist_ok=True)
            os.symlink(shared, root / name)
