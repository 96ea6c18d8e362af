"""The generated code of a fixed corpus of programs, written to a directory, so that a change to the
lowering or to an emitter can be checked to leave every kernel's text as it was (or to change only what
it means to change).

    python3 scripts/emit_corpus.py collect CORPUS        # the programs, as JSON (searches: a few minutes)
    python3 scripts/emit_corpus.py emit CORPUS OUT       # each through both backends, every option set
    python3 scripts/emit_corpus.py compare OUT_A OUT_B   # which texts differ, by option set and program

`collect` gathers the test programs (tests/backend/cuda/coverage.py, fast_paths.py, tests/gpu/coverage.py,
the examples, tests/backend/ptx/plans.py, the skinny programs) and the kernel benchmark's ten cases (their
first guided mugraphs, the candidates the autotuner times first), and writes each in its JSON form: run it
once, then `emit` with each tree to compare, so that both emit the same graphs. `emit` writes, for every
(program, option set, target), the CUDA C++ source (`cuda/...cu`), the LLVM IR (`ptx/...ll`), the PTX of
the default option set (`ptx/...ptx`) and each program's launches (`.launches.json`), or the error the
emitter raised (`.error.txt`); `manifest.json` holds the SHA-256 of every text. The CUDA sources are
stored without their prelude (one copy, `cuda/prelude.cu`), which the manifest's hashes include. Option
sets whose fields the tree's `CudaOptions` does not have are skipped and listed.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: name -> CudaOptions fields: the defaults, every switch the tests turn, and the autotuner's skinny settings
OPTION_SETS = {
    "default": {},
    "no-mma": {"mma": False},
    "no-register-accumulators": {"register_accumulators": False},
    "stages-1": {"stages": 1},
    "stages-2": {"stages": 2},
    "stages-4": {"stages": 4},
    "threads-64": {"threads": 64},
    "threads-256": {"threads": 256},
    "unroll-1": {"unroll": 1},
    "unroll-8": {"unroll": 8},
    "no-rows": {"rows": False},
    "no-hoist": {"hoist": False},
    "no-stream": {"stream": False},
    "mma-off-stages-2": {"mma": False, "stages": 2},
    "overlap": {"overlap": True},
    "skinny": {"skinny": True},
    "skinny-threads-256": {"skinny": True, "threads": 256},
    "skinny-overlap": {"skinny": True, "overlap": True},
    "skinny-stagger": {"skinny": True, "stagger": True},
    "skinny-lead-0": {"skinny": True, "lead": 0},
    "skinny-lead-0-threads-384": {"skinny": True, "lead": 0, "threads": 384},
    "skinny-lead-4-stagger": {"skinny": True, "lead": 4, "stagger": True},
    "skinny-wide-x": {"skinny": True, "wide_x": True},
    "skinny-all": {"skinny": True, "overlap": True, "stagger": True, "lead": 0, "wide_x": True, "threads": 256},
}

#: (CUDA arch, option sets) beyond sm_90a's every set: older targets' paths at the defaults
OTHER_ARCHES = {"sm_80": ("default", "skinny", "overlap"), "sm_75": ("default",)}


def _options_class():
    try:
        from mdsl.lowering.options import CudaOptions
    except ImportError:
        from mdsl.backend.cuda.options import CudaOptions  # a tree from before mdsl.lowering
    return CudaOptions


# ---------------------------------------------------------------------------------------------
# collect


def _guided(graph, count: int) -> list:
    from mdsl.search import guided

    out = []
    for candidate in guided.generate(graph):
        out.append(candidate)
        if len(out) == count:
            break
    return out


def collect(corpus: Path) -> int:
    from benchmarks.cases import cases
    from mdsl.ir import serialize
    from mdsl.ir.dtypes import bf16, f16, f32
    from tests.backend.cuda.coverage import coverage_graphs
    from tests.backend.cuda.fast_paths import fast_path_graphs
    from tests.backend.cuda.programs import example_kernels, skinny_programs
    from tests.backend.ptx import plans
    from tests.gpu.coverage import coverage_graphs as gpu_coverage
    from tests.strategies import example_graphs

    graphs = {}
    graphs.update((f"coverage.{k}", g) for k, g in coverage_graphs().items())
    graphs.update((f"fast_paths.{k}", g) for k, g in fast_path_graphs().items())
    for dtype in (f16, bf16, f32):
        graphs.update((f"gpu_coverage.{dtype.name}.{k}", g) for k, g in gpu_coverage(dtype).items())
    graphs.update((f"examples.{k}", g) for k, g in example_kernels().items())
    graphs.update((f"strategies.{k}", g) for k, g in example_graphs().items())
    graphs["ptx_plans.gqa_split"] = plans.split_attention(False)
    graphs["ptx_plans.qknorm_split"] = plans.split_attention(True)
    graphs["ptx_plans.gqa_split_two_heads"] = plans.split_attention(False, heads=2, queries=64)
    graphs.update((f"ptx_plans.tuned.{k}", g) for k, (g, _) in plans.tuned_plans().items())
    graphs["ptx_plans.rms_norm_linear_skinny_small"] = plans.rms_norm_linear_skinny(5, 4, columns=128, blocks=2, k=512)
    graphs.update((f"skinny.{k}", g) for k, g in skinny_programs().items())
    for name, kernel in cases().items():
        print(f"guided candidates of {name}", flush=True)
        for k, g in enumerate(_guided(kernel.graph, 3)):
            graphs[f"bench.{name}.{k}"] = g
    corpus.mkdir(parents=True, exist_ok=True)
    for key, graph in graphs.items():
        (corpus / f"{key}.json").write_text(serialize.dumps(graph), encoding="utf-8")
    print(f"{len(graphs)} programs in {corpus}")
    return 0


# ---------------------------------------------------------------------------------------------
# emit


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _launches(program) -> str:
    import attrs

    return json.dumps({"launches": [attrs.asdict(launch) for launch in program.launches],
                       "aliases": [list(a) for a in program.aliases]}, indent=1, sort_keys=True) + "\n"


def emit(corpus: Path, out: Path) -> int:
    from mdsl.backend.cuda import emit_cuda
    from mdsl.backend.cuda.prelude import INCLUDES, PRELUDE
    from mdsl.backend.ptx import emit_llvm, llvm_to_ptx
    from mdsl.errors import MdslError
    from mdsl.ir import serialize

    options_class = _options_class()
    graphs = {p.stem: serialize.loads(p.read_text(encoding="utf-8")) for p in sorted(corpus.glob("*.json"))}
    prelude = INCLUDES + PRELUDE
    (out / "cuda").mkdir(parents=True, exist_ok=True)
    (out / "cuda" / "prelude.cu").write_text(prelude, encoding="utf-8")
    manifest, skipped = {}, []

    def write(path: Path, text: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        manifest[str(path.relative_to(out))] = _digest(text)

    targets = [("sm_90a", name) for name in OPTION_SETS]
    targets += [(arch, name) for arch, names in OTHER_ARCHES.items() for name in names]
    for arch, set_name in targets:
        try:
            options = options_class(**OPTION_SETS[set_name])
        except TypeError:
            skipped.append(set_name)
            continue
        where = f"{arch}/{set_name}"
        print(f"{where}: {len(graphs)} programs", flush=True)
        for key, graph in graphs.items():
            try:
                program = emit_cuda(graph, arch=arch, options=options)
            except MdslError as e:
                write(out / "cuda" / where / f"{key}.error.txt", f"{type(e).__name__}: {e}\n")
            else:
                source = program.source
                head, found, tail = source.partition(prelude)
                stored = head + "// (the prelude)\n" + tail if found else source
                (out / "cuda" / where).mkdir(parents=True, exist_ok=True)
                (out / "cuda" / where / f"{key}.cu").write_text(stored, encoding="utf-8")
                manifest[f"cuda/{where}/{key}.cu"] = _digest(source)
                write(out / "cuda" / where / f"{key}.launches.json", _launches(program))
            ptx_arch = arch[:-1] if arch.endswith("a") else arch
            try:
                program = emit_llvm(graph, arch=ptx_arch, options=options)
            except MdslError as e:
                write(out / "ptx" / where / f"{key}.error.txt", f"{type(e).__name__}: {e}\n")
                continue
            write(out / "ptx" / where / f"{key}.ll", program.llvm_ir)
            write(out / "ptx" / where / f"{key}.launches.json", _launches(program))
            if set_name == "default" and arch == "sm_90a":
                try:
                    write(out / "ptx" / where / f"{key}.ptx", llvm_to_ptx(program.llvm_ir, ptx_arch))
                except MdslError as e:
                    write(out / "ptx" / where / f"{key}.ptx-error.txt", f"{type(e).__name__}: {e}\n")
    (out / "manifest.json").write_text(json.dumps({"texts": manifest, "skipped_option_sets": skipped},
                                                  indent=1, sort_keys=True) + "\n", encoding="utf-8")
    lacking = f"; option sets this tree lacks: {', '.join(skipped)}" if skipped else ""
    print(f"{len(manifest)} texts in {out}{lacking}")
    return 0


# ---------------------------------------------------------------------------------------------
# compare


def compare(a: Path, b: Path) -> int:
    ma = json.loads((a / "manifest.json").read_text(encoding="utf-8"))
    mb = json.loads((b / "manifest.json").read_text(encoding="utf-8"))
    ta, tb = ma["texts"], mb["texts"]
    common = sorted(ta.keys() & tb.keys())
    differing = [k for k in common if ta[k] != tb[k]]
    only_a, only_b = sorted(ta.keys() - tb.keys()), sorted(tb.keys() - ta.keys())
    kinds: dict = {}
    for k in common:
        kind = k.rsplit("/", 1)[-1].split(".", 1)[-1] if "." in k else k
        kind = Path(k).suffix or kind
        same, total = kinds.get(kind, (0, 0))
        kinds[kind] = (same + (ta[k] == tb[k]), total + 1)
    print(f"{len(common)} texts in both: {len(common) - len(differing)} identical, {len(differing)} differ")
    for kind, (same, total) in sorted(kinds.items()):
        print(f"  {kind}: {same} of {total} identical")
    for label, keys in (("only in " + str(a), only_a), ("only in " + str(b), only_b), ("differ", differing)):
        if keys:
            print(f"{label}: {len(keys)}")
            for k in keys[:40]:
                print(f"  {k}")
            if len(keys) > 40:
                print(f"  ... and {len(keys) - 40} more")
    return 1 if differing else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("collect").add_argument("corpus", type=Path)
    p = sub.add_parser("emit")
    p.add_argument("corpus", type=Path)
    p.add_argument("out", type=Path)
    p = sub.add_parser("compare")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    if args.command == "collect":
        return collect(args.corpus)
    if args.command == "emit":
        return emit(args.corpus, args.out)
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
