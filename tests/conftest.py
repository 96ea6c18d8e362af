"""Suite-wide fixtures."""
import pytest


@pytest.fixture(autouse=True)
def _plan_cache_in_tmp(tmp_path_factory, monkeypatch):
    """No test reads or writes the user's plan cache (~/.cache/mdsl)."""
    monkeypatch.setenv("MDSL_CACHE_DIR", str(tmp_path_factory.mktemp("mdsl-cache")))
