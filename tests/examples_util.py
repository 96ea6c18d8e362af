"""Loading the programs of examples/ as modules (they are scripts, not a package)."""
import functools
import importlib.util
from pathlib import Path

import mdsl

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.py"))


@functools.cache
def load_example(name: str):
    """The module examples/<name>.py, loaded once per process."""
    spec = importlib.util.spec_from_file_location(f"mdsl_examples.{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def example_kernels(name: str) -> dict:
    """The @mdsl.kernel functions examples/<name>.py defines, by attribute name."""
    return {k: v for k, v in vars(load_example(name)).items() if isinstance(v, mdsl.KernelFunction)}
