"""benchmarks/stream_probe.py without a GPU: its kernel compiles for both paths without spills, the loads
path with 16 weight loads in flight per lane over the whole row and the ring path with one bulk copy site and no global
load by the compute warps."""
from __future__ import annotations

import re

import pytest

from benchmarks import stream_probe
from mdsl.backend.cuda.nvrtc import compile_cuda, disassemble, sass_opcodes


@pytest.mark.parametrize(("sub", "buffers", "ring"), [(16, 1, 0), (16384, 12, 1), (49152, 4, 1)])
def test_the_probe_compiles_for_both_paths(sub, buffers, ring):
    module = compile_cuda(stream_probe.SOURCE % {"sub": sub, "nb": buffers, "ring": ring}, arch="sm_90a")
    resources = module.resources["probe"]
    assert resources.spill_store_bytes == 0 and resources.stack_bytes == 0, resources
    ops = sass_opcodes(disassemble(module.cubin))
    if ring:
        assert ops.get("UBLKCP", 0) >= 1 and ops.get("LDS", 0) >= 8 and ops.get("LDG", 0) == 0, ops
    else:
        assert ops.get("LDG", 0) == 16 and "UBLKCP" not in ops, ops
        # a warp's 16 loads per lane cover its whole 8 KB row: 512-byte steps from the lane's first chunk
        # (the ninth session's probe read half of each row and reported twice its bytes)
        offsets = {int(m.group(1) or "0", 16) for m in re.finditer(r"LDG\S* R\d+, desc\[UR\d+\]\[R\d+\.64(?:\+0x([0-9a-f]+))?\]",
                                                                   disassemble(module.cubin))}
        assert offsets == {512 * u for u in range(16)}, sorted(offsets)
