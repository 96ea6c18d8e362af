"""The ten benchmark cases (Mirage's kernel set, fp16): name -> kernel specification."""
from __future__ import annotations

import importlib.util
import pathlib

_EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"mdsl_bench_{name}", _EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases() -> dict:
    """Case name -> KernelFunction, in the order of Mirage's kernel set."""
    gqa, qknorm, rnl = _example("gqa"), _example("qknorm"), _example("rms_norm_linear")
    lora, gated, ntrans = _example("lora"), _example("gated_mlp"), _example("ntrans")
    batched = {"gqa": gqa.make_gqa, "qknorm": qknorm.make_qknorm,
               "rms_norm_linear": rnl.make_rms_norm_linear, "ntrans": ntrans.make_ntrans}
    out = {f"{name}_bs{bs}": make(bs) for name, make in batched.items() for bs in (1, 8)}
    out["lora"] = lora.lora
    out["gated_mlp"] = gated.gated_mlp
    return out


def describe_plan(graph) -> str:
    """One line: each kernel of a plan (custom kernels with their grid, loop and key ops)."""
    parts = []
    for node in graph.nodes:
        if node.body is None:
            parts.append(node.op)
            continue
        ops = [n.op for n in node.body.nodes]
        key_ops = sorted({op for op in ops if op in ("matmul", "rms_norm", "exp", "silu") or op.startswith("accum")})
        grid = "x".join(str(g) for g in node.body.grid if g > 1) or "1"
        parts.append(f"custom[grid {grid}, loop {node.body.forloop}: {ops.count('matmul')} matmul, {' '.join(key_ops)}]")
    return " ; ".join(parts)


def search_cold(kernel, config, progress=None):
    """The kernel's plan from a search in a plan cache of its own, so that no other case's plan answers
    it (a case at another batch size would, as a member of its shape family: mdsl.search.family), then
    copied into the default plan cache ($MDSL_CACHE_DIR) for the runs that read plans from there."""
    import os
    import shutil
    import tempfile

    from mdsl.search.cache import PlanCache, default_dir

    with tempfile.TemporaryDirectory(prefix="mdsl-cold-") as tmp:
        plan = kernel.optimize(config=config, cache=PlanCache(tmp), progress=progress)
        shared = PlanCache(default_dir()).plans
        shared.mkdir(parents=True, exist_ok=True)
        for entry in PlanCache(tmp).plans.glob("*.json"):
            staged = shared / f"{entry.name}.tmp{os.getpid()}"
            shutil.copyfile(entry, staged)
            os.replace(staged, shared / entry.name)     # (readers never see a half-written entry)
    return plan
