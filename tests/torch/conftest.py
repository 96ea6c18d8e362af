"""The `torch` fixture of the tests of mdsl.torch: torch is imported when a test first asks for it, so that
collecting the suite imports neither torch nor mdsl.torch (which needs it)."""
import pytest


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch", reason="mdsl.torch needs PyTorch (the test extra installs its CPU build)")
