"""benchmarks/copy_probe.py without a GPU: its kernel compiles without spills, with the issuing warp's
bulk copies and L2 bulk prefetches, the releases at both scopes behind their fences, and clock reads
around them."""
from __future__ import annotations

from benchmarks import copy_probe
from mdsl.backend.cuda.nvrtc import compile_cuda, disassemble, sass_opcodes


def test_the_copy_probe_compiles_with_its_copies_and_releases():
    module = compile_cuda(copy_probe.SOURCE, arch="sm_90a")
    resources = module.resources["probe"]
    assert resources.spill_store_bytes == 0 and resources.stack_bytes == 0, resources
    sass = disassemble(module.cubin)
    ops = sass_opcodes(sass)
    assert ops.get("UBLKCP", 0) >= 1 and ops.get("REDG", 0) >= 2, ops
    assert ops.get("UBLKPF", 0) >= 1, ops                          # cp.async.bulk.prefetch.L2
    assert "MEMBAR.ALL.GPU" in sass and "MEMBAR.ALL.SYS" in sass   # the releases' fences, whose wait it times
    assert ops.get("CS2R", 0) >= 4, ops                            # clock64 reads around the issue and the release
    assert set(copy_probe.MODES) == {"gpu", "sys"} and copy_probe.RESULTS == 3
