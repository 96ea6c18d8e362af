"""Dump what the megakernel engine would put on the GPU, without a GPU: per configuration the generated
source text and every host-side table the engine copies to the device, so that a change meant to leave the
megakernel alone can show that it does.

    python scripts/dump_megakernel_plans.py dump OUT_DIR [--configs NAME,...] [--sources]
    python scripts/dump_megakernel_plans.py compare BEFORE_DIR AFTER_DIR
    python scripts/dump_megakernel_plans.py golden [--check]

`dump` writes OUT_DIR/NAME.json per configuration: the sha256 of the source text of each attention preload
the engine may build (the options' own, or None and then False), its shared memory, the task, wait and
signal tables, the initial event counts, RoPE's tables, and the engine's device layout (every buffer it
allocates, in order, with its size and dtype, every weight it uploads by name and shape, the per-layer
pointer table and the kernel's Params fields, with stand-in addresses numbered in allocation order); with
`--sources` also NAME.cu. The plan is built the way the engine builds it (`MegakernelEngine`'s own plan
function where the checkout has one, else `build_plan` and `for_ranks` as the engine called them), and, for
the step functions `compile_model` takes, from their traced graph as `compile_model` builds it.

The configurations: the tiny models of tests/megakernel (f32 and bf16, the workers the tests use) and of
tests/gpu/test_megakernel.py (every runtime variant it runs, f32 and bf16, the MLP activations), the real
shapes of Llama-3.2-1B, Qwen3-0.6B and Qwen3-8B (bf16, 132 workers) under benchmarks/decode.py's variants
at its KV cache sizes and the engine's default 4096, a rank of Qwen3-8B over two GPUs and its shapes on one
GPU (`--rank-of 2`), and scripts/compare_megakernel_sass.py's configurations. `compare` lists the
configurations whose dumps differ (exit status 1 if any). `golden` writes (or with --check compares)
tests/megakernel/megakernel_plans.sha256, the digests of the tiny configurations' dumps (but `UNPINNED`), which
tests/megakernel/test_megakernel_rules.py holds the current code to. Run `dump` in each checkout (this
script on the PYTHONPATH of the one dumped).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GOLDEN = REPO / "tests" / "megakernel" / "megakernel_plans.sha256"
H200_SMS = 132
DECODE_CONTEXT = 1024                                # benchmarks/decode.py's CONTEXT
DECODE_SEQS = (DECODE_CONTEXT + 32 + 8, DECODE_CONTEXT + 128 + 8, 4096)   # --quick, 128 steps, the default
REAL_MODELS = ("llama-3.2-1b", "qwen3-0.6b", "qwen3-8b")
# tests/gpu/test_megakernel.py's TINY (its checkpoints are written by transformers with these fields)
GPU_TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1)
GPU_TINY_ARCH = {
    "llama3": dict(architectures=["LlamaForCausalLM"], rope_theta=500000.0, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], rope_theta=1000000.0, tie_word_embeddings=True),
}


def _decode_variants() -> dict:
    sys.path.insert(0, str(REPO / "benchmarks"))
    import decode

    return dict(decode.VARIANTS)


def _gpu_variants() -> tuple:
    from tests.gpu import test_megakernel

    return ({},) + tuple(test_megakernel.RUNTIME_VARIANTS)


@functools.lru_cache(maxsize=None)
def _real(model: str):
    import attrs

    from mdsl.ir.dtypes import bf16
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.runtime.models import MODELS

    return attrs.evolve(config_from_dict(MODELS[model]), dtype=bf16)


def configurations() -> dict:
    """name -> (config, workers, max_seq, world, MegakernelOptions fields, graph maker or None). The graph
    maker, where given, is the step function `compile_model` traces (None: the engine's built-in one)."""
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.parallel.gpu_group import shard_config
    from tests.megakernel.tiny import tiny_config_dict

    out = {}
    # tests/megakernel: the tiny models at the workers its plan, source and emulation tests use
    for arch in ("llama3", "qwen3"):
        for dtype in ("float32", "bfloat16"):
            config = config_from_dict(tiny_config_dict(arch, torch_dtype=dtype))
            for workers in (3, 4, 5, 7, 8, 9, 64, H200_SMS):
                out[f"tiny-{arch}-{dtype}-w{workers}"] = (config, workers, 24, 1, {}, None)
            out[f"tiny-{arch}-{dtype}-w8-seq64"] = (config, 8, 64, 1, {}, None)
            for world in (2,):
                out[f"tiny-{arch}-{dtype}-tp{world}-w3"] = (shard_config(config, world), 3, 24, world, {}, None)
                out[f"tiny-{arch}-{dtype}-tp{world}-w{H200_SMS}"] = (shard_config(config, world), H200_SMS, 24,
                                                                     world, {}, None)
            for sampling in (False, True):
                out[f"tiny-{arch}-{dtype}-compiled{'-sampling' if sampling else ''}"] = (
                    config, H200_SMS, 24, 1, {}, ("sampling" if sampling else "builtin"))
    # tests/gpu/test_megakernel.py: its checkpoints' configs, max_seq 64, an H200, every runtime variant
    for arch, extra in GPU_TINY_ARCH.items():
        for dtype in ("float32", "bfloat16"):
            for act in ("silu", "gelu", "relu") if arch == "llama3" else ("silu",):
                config = config_from_dict({**GPU_TINY, **extra, "torch_dtype": dtype, "hidden_act": act})
                variants = _gpu_variants() if act == "silu" else ({},)
                for k, options in enumerate(variants):
                    name = f"gpu-tiny-{arch}-{dtype}-{act}-v{k}"
                    out[name] = (config, options.get("workers", H200_SMS), 64, 1, options, None)
                out[f"gpu-tiny-{arch}-{dtype}-{act}-tp2"] = (shard_config(config, 2), H200_SMS, 64, 2, {}, None)
    # the real shapes: benchmarks/decode.py's variants at its KV cache sizes, a rank of two GPUs
    decode_variants = _decode_variants()
    for model in REAL_MODELS:
        for max_seq in DECODE_SEQS:
            for variant, options in decode_variants.items():
                if variant != "default" and max_seq != DECODE_SEQS[1]:
                    continue
                out[f"{model}-{max_seq}-{variant}"] = (_real(model), H200_SMS, max_seq, 1, options, None)
        out[f"{model}-tp2-rank-{DECODE_SEQS[1]}"] = (shard_config(_real(model), 2), H200_SMS, DECODE_SEQS[1], 2, {},
                                                     None)
    rank = shard_config(_real("qwen3-8b"), 2)
    for max_seq in DECODE_SEQS:
        out[f"qwen3-8b-tp2-rank-{max_seq}"] = (rank, H200_SMS, max_seq, 2, {}, None)
        out[f"qwen3-8b-rank-of-2-{max_seq}"] = (rank, H200_SMS, max_seq, 1, {"for_world": 2}, None)
    for variant, options in decode_variants.items():
        out[f"qwen3-8b-rank-of-2-{DECODE_SEQS[1]}-{variant}"] = (rank, H200_SMS, DECODE_SEQS[1], 1,
                                                                 {**options, "for_world": 2}, None)
    # scripts/compare_megakernel_sass.py's others
    out["qwen3-8b-16384"] = (_real("qwen3-8b"), H200_SMS, 16384, 1, {}, None)
    out["qwen3-8b-rank-sums-2"] = (_real("qwen3-8b"), H200_SMS, 1064, 1,
                                   {"attention_splits": 32, "attention_min_chunk": 32, "rank_sums": 2}, None)
    out["qwen3-8b-tp2-rank-splits4"] = (rank, H200_SMS, 1064, 2, {"attention_splits": 4, "attention_min_chunk": 4},
                                        None)
    for model in REAL_MODELS:
        out[f"{model}-compiled-1160"] = (_real(model), H200_SMS, 1160, 1, {}, "builtin")
    return out


# ---------------------------------------------------------------------------------------------
# the engine's plan and device layout, without a GPU

def _digest(data) -> str:
    if hasattr(data, "tobytes"):
        data = data.tobytes()
    elif isinstance(data, str):
        data = data.encode()
    return hashlib.sha256(data).hexdigest()


def engine_plan(config, workers: int, max_seq: int, world: int, options, graph_maker):
    """The plan as MegakernelEngine makes it (its own function where this checkout has one)."""
    from mdsl.megakernel.runtime import megakernel_engine as me

    graph = None
    if graph_maker is not None:
        from mdsl.megakernel.modelgraph.architectures import sampling_decode, step_function

        fn = step_function(config) if graph_maker == "builtin" else \
            sampling_decode(config.architecture, temperature=0.7, top_p=0.9, seed=5)
        graph = fn.trace(config, max_positions=max_seq)
    if hasattr(me, "device_plan"):
        return me.device_plan(config, graph, workers=workers, max_seq=max_seq, options=options, world=world)
    from mdsl.megakernel.runtime.shape import decoder_shape
    from mdsl.megakernel.runtime.task_plan import build_plan, for_ranks, plan_model

    if graph is not None:   # compile_model's check, then the engine's own tables
        plan_model(graph, decoder_shape(config), workers=1, max_seq=graph.max_positions)
    return for_ranks(build_plan(decoder_shape(config), workers=workers, max_seq=max_seq,
                                splits=options.attention_splits, min_chunk=options.attention_min_chunk), world)


class _FakePE:
    """NVSHMEM's symmetric heap, with stand-in addresses."""

    def __init__(self, layout):
        self.layout = layout

    def malloc(self, nbytes):
        return self.layout.allocate("symmetric", nbytes, None)

    def peer_address(self, ptr, k):
        return ptr + (k + 1) * (1 << 44)


class _Layout:
    """Records the engine's allocations; addresses are numbered in allocation order."""

    def __init__(self):
        self.entries = []
        self.next = 1 << 32

    def allocate(self, what, nbytes, detail):
        ptr = self.next
        self.next += ((max(1, int(nbytes)) + 255) // 256) * 256
        self.entries.append([what, int(nbytes), detail, ptr])
        return ptr


def device_layout(engine_cls, config, plan, max_seq: int, world: int) -> dict:
    """The engine's `_upload_weights` and `_allocate` with every device call replaced by a recorder."""
    from mdsl.megakernel.runtime import megakernel_engine as me

    layout = _Layout()
    engine = object.__new__(engine_cls)
    engine.config, engine.plan, engine.max_seq, engine.world = config, plan, max_seq, world
    engine.shape = plan.shape
    engine.device, engine.eos_token_ids = 0, ()
    engine.params = me.Params()
    engine._arrays, engine._keep = [], []
    engine.ranks = None if world == 1 else me.RankGroup(0, world, _FakePE(layout))
    engine._peer_deltas = None

    def array(values, dtype):
        return layout.allocate("array", values.nbytes, [dtype.name, list(values.shape), _digest(values)])

    def zeros(count, dtype):
        return layout.allocate("zeros", max(1, count) * dtype.itemsize, [dtype.name, int(count)])

    def weight(weights, name, shape):
        return layout.allocate("weight", 0, [name, list(shape), engine.shape.dtype.name])

    engine._array, engine._zeros, engine._weight = array, zeros, weight

    class Driver:
        class CUevent_flags:
            CU_EVENT_DEFAULT = 0

        @staticmethod
        def cuEventCreate(flags):
            return 0

        @staticmethod
        def cuMemsetD8(ptr, value, nbytes):
            return 0

    saved = {name: getattr(me, name) for name in ("driver", "_check", "_cu_stream")}
    try:
        me.driver, me._check, me._cu_stream = Driver, (lambda result, what: result), (lambda stream: 0)
        engine._upload_weights({})
        engine._allocate()
    finally:
        for name, value in saved.items():
            setattr(me, name, value)
    params = {name: getattr(engine.params, name) for name, _ in engine.params._fields_}
    return {"allocations": layout.entries, "params": params,
            "initial_events": engine._initial_events.tolist(),
            "relay_words": [list(r) for r in getattr(engine, "_relay_words", ())]}


def dump_one(name: str, spec, sources: Path = None) -> dict:
    import attrs

    from mdsl.megakernel.runtime.kernel_source import generate_source
    from mdsl.megakernel.runtime.megakernel_engine import MegakernelEngine
    from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions
    from mdsl.megakernel.runtime.shape import rope_tables

    config, workers, max_seq, world, fields, graph_maker = spec
    fields = dict(fields)
    options_world = fields.pop("for_world", world)
    options = MegakernelOptions(**fields).for_world(options_world)
    plan = engine_plan(config, workers, max_seq, world, options, graph_maker)
    tasks, waits, signals = plan.tables()
    cos, sin = rope_tables(plan.shape, max_seq)
    out = {"tasks": _digest(tasks), "waits": _digest(waits), "signals": _digest(signals),
           "table_shapes": [list(tasks.shape), list(waits.shape), list(signals.shape)],
           "initial_events": _digest(plan.initial_events()), "rope": [_digest(cos), _digest(sin)],
           "splits": plan.splits, "min_chunk": plan.min_chunk, "lm_tiles": plan.lm_tiles, "world": plan.world,
           "kind_ops": [[int(k.kind), k.op, repr(k.attrs)] for k in plan.kind_ops],
           "statistics": plan.statistics(), "sources": {}}
    for preload in (None, False) if options.attention_preload is None else (options.attention_preload,):
        try:
            source = generate_source(plan, attrs.evolve(options, attention_preload=preload))
        except ValueError as e:   # KernelOptionError: the engine's OptionError
            out["sources"][str(preload)] = f"refused: {e}"
            continue
        out["sources"][str(preload)] = {"sha256": _digest(source.text), "smem_bytes": source.smem_bytes}
        if sources is not None:
            (sources / f"{name}.preload-{preload}.cu").write_text(source.text)
    layout = device_layout(MegakernelEngine, config, plan, max_seq, world)
    out["layout"] = layout
    return out


def dump(out: Path, names, sources: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    chosen = configurations()
    for name in names or chosen:
        result = dump_one(name, chosen[name], out if sources else None)
        (out / f"{name}.json").write_text(json.dumps(result, indent=1, sort_keys=True))
        print(f"{name}: {result['statistics']['tasks_per_step']} tasks, {result['statistics']['events']} events",
              flush=True)


def compare(before: Path, after: Path) -> int:
    a = {p.stem for p in before.glob("*.json")}
    b = {p.stem for p in after.glob("*.json")}
    differ = 0
    for name in sorted(a | b):
        if name not in a or name not in b:
            print(f"{name}: only in {before if name in a else after}")
            differ += 1
            continue
        x, y = (json.loads((d / f"{name}.json").read_text()) for d in (before, after))
        if x != y:
            keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
            print(f"{name}: differs in {', '.join(keys)}")
            differ += 1
    print(f"{len(a & b)} configurations in both; {differ} differ")
    return 1 if differ else 0


#: what the golden digests leave out: RoPE's tables are numpy's float32 powers and float64 cosines and sines,
#: whose last bits follow the host CPU's SIMD level (X86_V3 and X86_V4 machines round some of them apart);
#: test_rope_tables_match_the_reference_rotation (tests/megakernel/test_runtime_plan.py) checks their values.
#: The layout's allocations of those tables keep their place and size, their contents' digest left out too.
UNPINNED = ("rope",)


def digest_of(name: str, spec) -> str:
    """The sha256 of a configuration's dump, but its `UNPINNED` parts."""
    full = dump_one(name, spec)
    dump = {k: v for k, v in full.items() if k not in UNPINNED}
    rope = set(full["rope"])
    dump["layout"] = {**full["layout"], "allocations": [
        [kind, size, [*what[:-1], "rope"] if kind == "array" and what[-1] in rope else what, address]
        for kind, size, what, address in full["layout"]["allocations"]]}
    return _digest(json.dumps(dump, sort_keys=True))


def golden_digests() -> dict:
    """name -> the digest of the dump of each tiny configuration (tests/megakernel's and tests/gpu's)."""
    chosen = configurations()
    return {name: digest_of(name, spec) for name, spec in chosen.items() if name.startswith(("tiny-", "gpu-tiny-"))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = ap.add_subparsers(dest="command", required=True)
    d = commands.add_parser("dump", help="write each configuration's digests and layout")
    d.add_argument("out", type=Path)
    d.add_argument("--configs", default="", help="comma-separated configuration names (default: all)")
    d.add_argument("--sources", action="store_true", help="also write each generated source")
    c = commands.add_parser("compare", help="compare two dumps")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    g = commands.add_parser("golden", help=f"write {GOLDEN.relative_to(REPO)}")
    g.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = ap.parse_args(argv)
    if args.command == "dump":
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = set(names) - set(configurations())
        if unknown:
            ap.error(f"unknown configuration(s) {sorted(unknown)}")
        dump(args.out, names, args.sources)
        return 0
    if args.command == "compare":
        return compare(args.before, args.after)
    digests = golden_digests()
    text = "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
    if args.check:
        same = GOLDEN.exists() and GOLDEN.read_text() == text
        print("the golden digests agree" if same else f"the digests differ from {GOLDEN}")
        return 0 if same else 1
    GOLDEN.write_text(text)
    print(f"wrote {len(digests)} digests to {GOLDEN}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
