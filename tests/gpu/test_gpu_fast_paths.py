"""The fast paths of both backends (conftest runs each test once per backend) on the GPU against the
reference, each switched on and off: the
fast-path programs (ragged and batched tensor-core matmuls, sums in registers, pipelines of every
depth, other block sizes, hoisting and streamed combines off) under every option set, their loaded modules
reporting no spills, and every example program (as written, and the
guided plan of each specification) with each fast path off, so that a run shows both settings of
every switch correct (the default settings run in test_gpu_examples and test_gpu_coverage)."""
from __future__ import annotations

import pytest

import mdsl
from mdsl.search.guided import generate
from tests.backend.cuda.fast_paths import EVERY_OPTION_SET, FALLBACKS, fast_path_graphs, options_env
from tests.examples_util import EXAMPLES, load_example
from tests.gpu.harness import check_graph


def _use(monkeypatch, options_name: str) -> None:
    for key, value in options_env(EVERY_OPTION_SET[options_name]).items():
        monkeypatch.setenv(key, value)


@pytest.mark.gpu
@pytest.mark.parametrize("options", sorted(EVERY_OPTION_SET))
@pytest.mark.parametrize("name", sorted(fast_path_graphs()))
def test_fast_path_program_on_the_gpu(name, options, monkeypatch):
    _use(monkeypatch, options)
    what = f"{name} with options {options}"
    executable = check_graph(fast_path_graphs()[name], f"fast-path:{name}:{options}", what=what)
    for kernel, r in executable.module.resources.items():   # as the loaded module reports them
        assert r.spill_store_bytes == r.spill_load_bytes == r.stack_bytes == 0, f"{what}: {kernel}: {r}"


def _examples() -> list:
    out = []
    for path in sorted(EXAMPLES.glob("*.py")):
        for name, kernel in vars(load_example(path.stem)).items():
            if isinstance(kernel, mdsl.KernelFunction) and not name.endswith("_bs8"):
                for variant in ("as-written", "guided") if not kernel.graph.custom_nodes() else ("as-written",):
                    out.append(pytest.param(kernel, variant, id=f"{path.stem}.{name}-{variant}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("options", FALLBACKS)
@pytest.mark.parametrize("kernel, variant", _examples())
def test_example_with_a_fast_path_off_on_the_gpu(kernel, variant, options, monkeypatch):
    _use(monkeypatch, options)
    graph = kernel.graph if variant == "as-written" else next(generate(kernel.graph))
    check_graph(graph, f"example:{kernel.name}:{variant}:{options}",
                what=f"example {kernel.name} ({variant}) with options {options}")
