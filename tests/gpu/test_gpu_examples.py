"""Every example program on the GPU against the reference: its graph as written (the specification,
or the hand-written fused kernels) and, for a specification, the best candidate of the guided
generator, in f16 (as written), bf16 and f32. The batch-8 variants run in f16 only (time)."""
from __future__ import annotations

import pytest

import mdsl
from mdsl.errors import ValidationError
from mdsl.ir.dtypes import bf16, f16, f32
from mdsl.ir.validate import validate_kernel_graph
from mdsl.search.guided import generate
from tests.examples_util import EXAMPLES, load_example
from tests.gpu.harness import check_graph, with_dtype

_load = load_example


def _cases() -> list:
    out = []
    for path in sorted(EXAMPLES.glob("*.py")):
        module = _load(path.stem)
        for name, kernel in vars(module).items():
            if not isinstance(kernel, mdsl.KernelFunction):
                continue
            spec = not kernel.graph.custom_nodes()
            for dtype in (f16,) if name.endswith("_bs8") else (f16, bf16, f32):
                for variant in ("as-written", "guided") if spec else ("as-written",):
                    out.append(pytest.param(kernel, variant, dtype, id=f"{path.stem}.{name}-{variant}-{dtype.name}"))
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("kernel, variant, dtype", _cases())
def test_example_on_the_gpu(kernel, variant, dtype):
    graph = with_dtype(kernel.graph, f16, dtype)
    try:
        validate_kernel_graph(graph)
    except ValidationError as e:   # f32 tiles take twice the shared memory of f16 ones
        pytest.skip(f"{kernel.name} does not fit in {dtype.long_name}: {e.message}")
    if variant == "guided":
        graph = next(generate(graph), None)
        assert graph is not None, f"the guided generator proposes nothing for {kernel.name} in {dtype.long_name}"
    check_graph(graph, f"example:{kernel.name}:{variant}:{dtype.name}",
                what=f"example {kernel.name} ({variant}) in {dtype.long_name}")
