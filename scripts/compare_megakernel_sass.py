"""Dump the SASS of the megakernel kernels the engine builds, and compare two dumps.

The SASS comes from NVRTC for sm_90a and nvdisasm (no GPU needed), so that a change meant to leave the
kernels' machine code alone can show that it does.

    python scripts/compare_megakernel_sass.py dump OUT_DIR [--configs NAME,...]
    python scripts/compare_megakernel_sass.py compare BEFORE_DIR AFTER_DIR [--recompiles 3]

`dump` writes, per configuration, the generated source (NAME.cu), its SASS (NAME.sass: nvdisasm's code
sections, no line information) and NAME.json (the dynamic shared memory, whether attention's rows are
preloaded, ptxas's resources). The configurations are the defaults of the three benchmark models on one GPU
and of a rank of Qwen3-8B over two GPUs (its tables, `for_ranks`, and its shapes on one GPU with a rank's
defaults, as `benchmarks/decode.py --rank-of 2` runs them) at the decode benchmark's KV cache sizes (1064:
--quick, 1160: 128 steps) and the engine's default 4096, each as the engine builds it (attention's rows
preloaded where they fit, the kernel built again without them if it spills); and kept options at other
values (a long max_seq without the preload, one GPU summing as two ranks, the second pass of every kind on
models whose kernel then spills, a rank's short splits). `compare` says, per configuration in both dumps,
whether the SASS is the same text, else how many instruction lines differ and how the opcode counts moved;
exit status 1 if any differs. NVRTC does not always make the same code of one source (now and then it
allocates one product loop's registers otherwise), so where the dumps' SASS differ `compare` compiles both
dumped sources again (`--recompiles` times each, no cache) and counts them the same if any of their SASS
agree. Run `dump` in each checkout (this script on the PYTHONPATH of the one dumped).
"""
from __future__ import annotations

import argparse
import collections
import difflib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CONTEXT_SEQS = (1064, 1160, 4096)
MODELS = ("llama-3.2-1b", "qwen3-0.6b", "qwen3-8b")
ALL_KINDS = ("qkv", "oproj", "gateup", "down", "lmhead")


def configurations() -> dict:
    """name -> (config, max_seq, plan world, plan keyword arguments, MegakernelOptions)."""
    import attrs

    from mdsl.ir.dtypes import bf16
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.parallel.gpu_group import shard_config
    from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions
    from mdsl.megakernel.runtime.models import MODELS as SHAPES
    from tests.megakernel.tiny import tiny_model

    def full(model):
        return attrs.evolve(config_from_dict(SHAPES[model]), dtype=bf16)

    default = MegakernelOptions()
    rank_shapes = shard_config(full("qwen3-8b"), 2)
    out = {}
    for max_seq in CONTEXT_SEQS:
        for model in MODELS:
            out[f"{model}-{max_seq}"] = (full(model), max_seq, 1, {}, default)
        out[f"qwen3-8b-tp2-rank-{max_seq}"] = (rank_shapes, max_seq, 2, {}, default)
        out[f"qwen3-8b-rank-of-2-{max_seq}"] = (rank_shapes, max_seq, 1, {}, default.for_world(2))
    tiny_llama = tiny_model("llama3")[0]
    tiny_qwen = attrs.evolve(tiny_model("qwen3")[0], dtype=bf16)
    out.update({
        "qwen3-8b-16384": (full("qwen3-8b"), 16384, 1, {}, default),
        "qwen3-8b-rank-sums-2": (full("qwen3-8b"), 1064, 1, {"splits": 32, "min_chunk": 32},
                                 MegakernelOptions(rank_sums=2)),
        "qwen3-8b-no-preload": (full("qwen3-8b"), 1064, 1, {}, MegakernelOptions(attention_preload=False)),
        "qwen3-8b-weights-half": (full("qwen3-8b"), 1064, 1, {}, MegakernelOptions(weights_first=0.5)),
        "llama-3.2-1b-two-pass-all": (full("llama-3.2-1b"), 1064, 1, {}, MegakernelOptions(second_pass_kinds=ALL_KINDS)),
        "qwen3-8b-tp2-rank-splits4": (rank_shapes, 1064, 2, {"splits": 4, "min_chunk": 4}, default),
        "tiny-llama3-f32": (tiny_llama, 64, 1, {}, default),
        "tiny-qwen3-bf16-two-pass-all": (tiny_qwen, 64, 1, {}, MegakernelOptions(second_pass_kinds=ALL_KINDS)),
        "tiny-llama3-f32-two-pass-all": (tiny_llama, 64, 1, {}, MegakernelOptions(second_pass_kinds=ALL_KINDS)),
        "tiny-qwen3-bf16-tp2": (shard_config(tiny_qwen, 2), 64, 2, {}, default),
    })
    return out


def build(config, max_seq: int, world: int, plan_kwargs: dict, options):
    """(source, compiled module) as MegakernelEngine builds them on an H200 (132 workers): with attention's
    rows preloaded where the options leave it open, and again without them if that kernel spills."""
    import attrs

    from mdsl.backend.cuda.nvrtc import compile_cuda
    from mdsl.megakernel.runtime.kernel_source import KERNEL_NAME, generate_source
    from mdsl.megakernel.runtime.shape import decoder_shape
    from mdsl.megakernel.runtime.task_plan import build_plan, for_ranks

    plan = for_ranks(build_plan(decoder_shape(config), workers=132, max_seq=max_seq, **plan_kwargs), world)
    for preload in (None, False) if options.attention_preload is None else (options.attention_preload,):
        source = generate_source(plan, attrs.evolve(options, attention_preload=preload))
        module = compile_cuda(source.text, arch="sm_90a")
        resources = module.resources[KERNEL_NAME]
        if not (resources.stack_bytes or resources.spill_store_bytes) or preload is False:
            return source, module


def dump(out: Path, names) -> None:
    import attrs

    from mdsl.backend.cuda.nvrtc import disassemble
    from mdsl.megakernel.runtime.kernel_source import KERNEL_NAME

    out.mkdir(parents=True, exist_ok=True)
    chosen = configurations()
    for name in names or chosen:
        t0 = time.perf_counter()
        source, module = build(*chosen[name])
        resources = module.resources[KERNEL_NAME]
        (out / f"{name}.cu").write_text(source.text)
        (out / f"{name}.sass").write_text(disassemble(module.cubin))
        info = {"smem_bytes": source.smem_bytes, "preload": "constexpr bool ATTN_PRELOAD = true;" in source.text,
                "resources": attrs.asdict(resources)}
        (out / f"{name}.json").write_text(json.dumps(info))
        print(f"{name}: {resources.registers} registers, preload {info['preload']}, {source.smem_bytes} bytes of "
              f"shared memory ({time.perf_counter() - t0:.0f} s)", flush=True)


def _instructions(sass: str) -> list:
    """The SASS's instruction lines without their addresses."""
    return [line.split("*/", 1)[1].strip() for line in sass.splitlines() if line.strip().startswith("/*")]


def _variants(source: str, compiles: int) -> set:
    """The SASS texts of `compiles` compiles of `source`, each with an empty compile cache."""
    from mdsl.backend.cuda.nvrtc import compile_cuda, disassemble

    found, kept = set(), os.environ.get("MDSL_CACHE_DIR")
    try:
        for _ in range(compiles):
            with tempfile.TemporaryDirectory() as cache:
                os.environ["MDSL_CACHE_DIR"] = cache
                found.add(disassemble(compile_cuda(source, arch="sm_90a").cubin))
    finally:
        if kept is None:
            del os.environ["MDSL_CACHE_DIR"]
        else:
            os.environ["MDSL_CACHE_DIR"] = kept
    return found


def compare(before: Path, after: Path, recompiles: int = 3) -> int:
    from mdsl.backend.cuda.nvrtc import sass_opcodes

    names = sorted(p.stem for p in before.glob("*.sass") if (after / p.name).exists())
    if not names:
        print(f"no configuration is in both {before} and {after}")
        return 1
    differ = 0
    for name in names:
        a, b = ((d / f"{name}.sass").read_text() for d in (before, after))
        infos = [json.loads((d / f"{name}.json").read_text()) for d in (before, after)]
        launch = [(i["smem_bytes"], i["preload"], i["resources"]["registers"]) for i in infos]
        notes = "" if launch[0] == launch[1] else f"; shared memory, preload, registers {launch[0]} -> {launch[1]}"
        if a == b:
            print(f"{name}: identical SASS{notes}")
            continue
        if recompiles:
            va, vb = ({text} | _variants((d / f"{name}.cu").read_text(), recompiles)
                      for text, d in ((a, before), (b, after)))
            if va & vb:
                print(f"{name}: identical SASS (NVRTC made {len(va)} and {len(vb)} variants of the two sources in "
                      f"{recompiles + 1} compiles each; one is common){notes}")
                continue
        differ += 1
        ia, ib = _instructions(a), _instructions(b)
        changed = sum(1 for line in difflib.ndiff(ia, ib) if line[:1] in "+-")
        moved = collections.Counter(sass_opcodes(b))
        moved.subtract(sass_opcodes(a))
        opcodes = ", ".join(f"{op} {n:+d}" for op, n in sorted(moved.items()) if n)
        print(f"{name}: SASS differs: {len(ia)} -> {len(ib)} instructions, {changed} lines changed"
              f"{'; opcodes ' + opcodes if opcodes else '; the same opcode counts'}{notes}")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = ap.add_subparsers(dest="command", required=True)
    d = commands.add_parser("dump", help="write the configurations' source, SASS and resources")
    d.add_argument("out", type=Path)
    d.add_argument("--configs", default="", help="comma-separated configuration names (default: all)")
    c = commands.add_parser("compare", help="compare two dumps")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    c.add_argument("--recompiles", type=int, default=3,
                   help="where the dumps' SASS differ, compile each dumped source this many times more (0: none)")
    args = ap.parse_args(argv)
    if args.command == "dump":
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = set(names) - set(configurations())
        if unknown:
            ap.error(f"unknown configuration(s) {sorted(unknown)}; known: {', '.join(configurations())}")
        dump(args.out, names)
        return 0
    return compare(args.before, args.after, args.recompiles)


if __name__ == "__main__":
    sys.exit(main())
