"""The skinny loop (mdsl.lowering.skinny) through both backends, without a GPU: taken under
`CudaOptions(skinny=True)` only (given, or from the environment), and never where the block graph does not
qualify. Each backend's loop: tests/backend/cuda/test_cuda_skinny.py (the code, NVRTC, the SASS, the
autotuner) and tests/backend/ptx/test_ptx_skinny.py (the simulator, the SASS against the CUDA kernels')."""
from __future__ import annotations

import pytest

from mdsl.lowering.options import CudaOptions
from tests.backend.backends import EMITTERS, emit
from tests.backend.cuda.programs import skinny_program
from tests.backend.ptx.plans import rms_norm_linear_skinny

SKINNY = CudaOptions(skinny=True)
#: what each backend's code has where a kernel runs the skinny loop: CUDA's template, the PTX backend's
#: weight loads that bypass L1
MARKER = {"cuda": "Skinny<", "ptx": "ld.global.nc.L1::no_allocate"}
#: programs whose first kernel qualifies: the benchmark plan of RMSNorm + Linear at batch 8, and a small
#: one (2 rows, 64 columns a block, K = 640), its weight stored [K, N] and [N, K]
QUALIFYING = {"rms_norm_linear_bs8": lambda: skinny_program("rms_norm_linear_bs8"),
              "small": lambda: rms_norm_linear_skinny(2, 2, columns=128, blocks=2, k=640),
              "small-transposed": lambda: rms_norm_linear_skinny(2, 2, columns=128, blocks=2, k=640,
                                                                 transposed=True)}


@pytest.mark.parametrize("name", sorted(QUALIFYING))
@pytest.mark.parametrize("backend", EMITTERS)
def test_only_the_skinny_option_takes_the_skinny_loop(backend, name, monkeypatch):
    graph = QUALIFYING[name]()
    assert MARKER[backend] in emit(backend, graph, SKINNY).source
    assert MARKER[backend] not in emit(backend, graph, CudaOptions()).source   # off by default
    assert CudaOptions.from_env({"MDSL_CUDA_SKINNY": "1"}) == SKINNY
    monkeypatch.setenv("MDSL_CUDA_SKINNY", "1")
    assert emit(backend, graph).source == emit(backend, graph, SKINNY).source


@pytest.mark.parametrize("backend", EMITTERS)
def test_a_block_graph_that_does_not_qualify_keeps_the_tile_loop(backend):
    """X of 17 rows (over MAX_ROWS)."""
    graph = rms_norm_linear_skinny(17, 2, columns=128, blocks=2, k=256)
    assert MARKER[backend] not in emit(backend, graph, SKINNY).source


def test_weights_of_both_layouts_in_one_loop_keep_the_tile_loop():
    """One weight stored [K, N] and one stored [N, K] (read through a transpose): the loop's lanes load one
    layout, so the block graph does not qualify; each layout alone does."""
    import mdsl
    from mdsl.ir.skinny import skinny_shape
    from tests.backend.cuda.builder import Graph

    def gated(layouts):
        g = Graph("mixed")
        x = g.input("x", (4, 256), mdsl.f16)
        b = g.block(grid=(2,), forloop=2, threads=128)
        xt = b.input(x, imap=(None,), fmap=1)
        for k, transposed in enumerate(layouts):
            if transposed:
                stored = b.input(g.input(f"w{k}", (128, 256), mdsl.f16), imap=(0,), fmap=1)
                w = b.op("transpose", stored, perm=(1, 0))
            else:
                w = b.input(g.input(f"w{k}", (256, 128), mdsl.f16), imap=(1,), fmap=0)
            b.output(b.op("accum", b.op("matmul", xt, w)), omap=(1,))
        b.done()
        return g.build().nodes[0].body

    assert skinny_shape(gated((True, True))).transposed and not skinny_shape(gated((False, False))).transposed
    assert skinny_shape(gated((False, True))) is None and skinny_shape(gated((True, False))) is None
