"""The megakernel's host side on a machine without a GPU: the engine and `mdsl generate` refuse with
a clear error before touching the driver; what needs no GPU (names, EOS ids, arguments) works."""
import json

import numpy as np
import pytest

from mdsl.backend.cuda.runtime import NoGPUError, has_gpu
from mdsl.cli import main
from mdsl.megakernel.modelgraph.checkpoint import save_checkpoint
from mdsl.megakernel.modelgraph.model_config import eos_token_ids
from mdsl.megakernel.runtime.megakernel_engine import MegakernelEngine, Params, RankGroup, weight_names
from mdsl.megakernel.runtime.shape import LAYER_WEIGHTS, QKV_BIASES, decoder_shape, layer_weight_name
from mdsl.megakernel.runtime.task_plan import build_plan
from mdsl.megakernel.runtime.megakernel_options import MegakernelOptions, OptionError
from mdsl.megakernel.runtime.profile import TaskRecord
from tests.megakernel.tiny import tiny_config_dict, tiny_model

no_gpu = pytest.mark.skipif(has_gpu(), reason="checks the behaviour without a GPU")


@pytest.fixture
def checkpoint(tmp_path):
    _, _, weights = tiny_model("qwen3")
    save_checkpoint(str(tmp_path), {**tiny_config_dict("qwen3"), "eos_token_id": [5, 7]}, weights)
    return tmp_path


def test_weight_names_are_the_model_graphs():
    for arch in ("llama3", "qwen3", "qwen2", "mistral", "phi3", "qwen3_moe"):
        config, graph, _ = tiny_model(arch)
        assert sorted(weight_names(config)) == sorted(w.name for w in graph.weights)


def _layer_table(arch: str, arrays: list = None, **overrides) -> tuple:
    """(the device's per-layer pointer table as the engine fills it, the tensors it uploads by name), with
    stand-in addresses (1 << 32 apart) for the uploads; no GPU. `arrays`: gets every array the engine uploads."""
    config, _, _ = tiny_model(arch, **overrides)
    engine = object.__new__(MegakernelEngine)
    engine.shape, engine.max_seq, engine.params = decoder_shape(config), 24, Params()
    engine.plan = build_plan(engine.shape, workers=4, max_seq=24)
    uploaded, arrays = {}, [] if arrays is None else arrays

    def weight(weights, name, shape):
        uploaded[name] = (len(uploaded) + 1) << 32
        return uploaded[name]

    engine._weight, engine._zeros = weight, lambda count, dtype: 0
    engine._array = lambda values, dtype: arrays.append(values) or 0
    engine._upload_weights({})
    return arrays[-1].view(np.uint64).reshape(config.num_layers, -1), uploaded


def test_phi3s_fused_weights_are_uploaded_once_and_bound_in_place():
    """The device's q, k, v (gate, up) weight pointers point into Phi-3's qkv_proj (gate_up_proj) rows."""
    table, uploaded = _layer_table("phi3")
    s = decoder_shape(tiny_model("phi3")[0])
    parts = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
    assert not any(n.rsplit(".", 2)[-2] in parts for n in uploaded)
    for layer, row in enumerate(table):
        qkv, gate_up = (uploaded[layer_weight_name(layer, w)] for w in ("qkv_proj", "gate_up_proj"))
        wq, wk, wv, _, wg, wu = (int(x) for x in row[:6])
        assert (wq, wk, wv) == (qkv, qkv + 4 * s.attention_width * s.hidden,
                                qkv + 4 * (s.attention_width + s.kv_heads * s.head_dim) * s.hidden)
        assert (wg, wu) == (gate_up, gate_up + 4 * s.intermediate * s.hidden)
    assert table.shape[1] == len(LAYER_WEIGHTS) + 2   # the weights and the two caches: no biases


def test_qwen2s_biases_follow_the_caches_in_the_layer_table():
    """sync.cuh's LayerWeights under its QKV_BIAS section: bq, bk, bv after the caches."""
    table, uploaded = _layer_table("qwen2")
    assert table.shape[1] == len(LAYER_WEIGHTS) + 2 + 3
    for layer, row in enumerate(table):
        assert [int(x) for x in row[-3:]] == [uploaded[layer_weight_name(layer, b)] for b in QKV_BIASES]


def test_a_mixture_of_experts_table_follows_the_caches_in_the_layer_table():
    """sync.cuh's LayerWeights under its MOE section: the router, the expert table (every expert's gate, then up,
    then down weight, each uploaded once), the routing buffers; null in a dense layer, whose MLP slots are filled."""
    arrays = []
    table, uploaded = _layer_table("qwen3_moe", arrays, num_hidden_layers=3, mlp_only_layers=[1])
    config = tiny_model("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])[0]
    e = config.num_experts
    assert table.shape[1] == len(LAYER_WEIGHTS) + 2 + 7
    experts = [a.view(np.uint64) for a in arrays[:-1] if a.size == 2 * 3 * e]
    assert len(experts) == 2
    for layer, row in enumerate(table):
        moe = [int(x) for x in row[len(LAYER_WEIGHTS) + 2:]]
        if layer == 1:
            assert moe == [0] * 7 and int(row[LAYER_WEIGHTS.index("gate_proj")]) != 0
            continue
        assert moe[0] == uploaded[f"model.layers.{layer}.mlp.gate.weight"]
        assert int(row[LAYER_WEIGHTS.index("gate_proj")]) == 0
        pointers = experts.pop(0)
        assert [int(x) for x in pointers] == [uploaded[f"model.layers.{layer}.mlp.experts.{x}.{proj}.weight"]
                                              for proj in ("gate_proj", "up_proj", "down_proj") for x in range(e)]


def test_eos_ids_come_from_the_generation_config_first(checkpoint):
    assert eos_token_ids(str(checkpoint)) == (5, 7)
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert eos_token_ids(str(checkpoint)) == (3,)
    assert eos_token_ids(str(checkpoint / "missing")) == ()


@no_gpu
def test_the_engine_needs_a_gpu(checkpoint):
    config, _, weights = tiny_model("qwen3")
    with pytest.raises(NoGPUError, match="needs an NVIDIA GPU") as info:
        MegakernelEngine(config, weights)
    assert "build_plan" in info.value.hint
    with pytest.raises(NoGPUError):
        MegakernelEngine.from_pretrained(str(checkpoint))


@no_gpu
def test_mdsl_generate_without_a_gpu_says_so(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt-ids", "1,2,3", "--max-new-tokens", "4"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_mdsl_generate_text_needs_a_tokenizer(checkpoint, capsys):
    assert main(["generate", "--model", str(checkpoint), "--prompt", "hello"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err


def test_mdsl_generate_rejects_bad_token_ids(checkpoint, capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "--model", str(checkpoint), "--prompt-ids", "1,x"])
    assert info.value.code == 2
    assert "comma-separated token ids" in capsys.readouterr().err


def generate_source_for(options: MegakernelOptions):
    """The kernel a tiny Llama-3 engine builds with `options` (its plan's attention splits theirs)."""
    from mdsl.megakernel.runtime.kernel_source import generate_source
    from mdsl.megakernel.runtime.shape import decoder_shape
    from mdsl.megakernel.runtime.task_plan import build_plan

    config, _, _ = tiny_model("llama3")
    plan = build_plan(decoder_shape(config), workers=8, max_seq=24, splits=options.attention_splits,
                      min_chunk=options.attention_min_chunk)
    return generate_source(plan, options).text


def test_the_decode_benchmarks_best_ratio_divides_the_fastest_n_gpus_by_the_fastest_one_gpu():
    from benchmarks import decode

    result = {"variants": {"default": {"megakernel_ms": 4.5}, "splits32": {"megakernel_ms": 4.66},
                           "broken": {"error": "CudaError: boom"}},
              "tensor_parallel": {"default": {"megakernel_ms": 2.835}, "splits32": {"megakernel_ms": 2.789},
                                  "broken": {"error": "TensorParallelError: boom"}}}
    best = decode.best_ratio(result)
    # splits32's own ratio (2.789 / 4.66 = 0.599) divides by a slower one-GPU choice: not the one that counts
    assert (best["tp_variant"], best["one_gpu_variant"]) == ("splits32", "default")
    assert best["ratio"] == 2.789 / 4.5
    assert decode.best_ratio({"variants": result["variants"]}) is None
    assert decode.best_ratio({"variants": result["variants"], "tensor_parallel": {"x": {"error": "e"}}}) is None


def test_decode_benchmark_options_and_table_without_a_gpu(tmp_path):
    from benchmarks import decode

    args = decode.parse_args(["--quick", "--models", "qwen3-0.6b", "--out", str(tmp_path)])
    assert (args.steps, args.repeats, args.models) == (32, 2, ["qwen3-0.6b"])
    assert args.variants == list(decode.VARIANTS) and args.variants[0] == "default" and len(args.variants) <= 10
    assert (args.tp, args.tp_models, args.tp_variants) == (1, ["qwen3-8b"], ["default"])
    tp = decode.parse_args(["--quick", "--tp", "2", "--tp-variants", "default,splits16"])
    assert decode.variants_of("qwen3-8b", tp) == ["default", "splits16"]   # one GPU under the same
    assert decode.parse_args(["--tp", "2", "--tp-models", "qwen3-8b,llama-3.2-1b"]).tp_models == ["qwen3-8b",
                                                                                                 "llama-3.2-1b"]
    assert decode.parse_args(["--variants", "no-preload"]).variants == ["no-preload"]
    assert decode.variants_of("qwen3-0.6b", args) == ["default"]         # --quick: the extra variants ...
    assert decode.variants_of(args.trace_model, args) == args.variants   # ... for the profiled model only
    assert decode.variants_of("qwen3-0.6b", decode.parse_args([])) == args.variants
    assert (args.rank_of, decode.parse_args(["--rank-of", "2"]).rank_of) == (1, 2)   # a rank's shapes on one GPU
    for bad in (["--models", "gpt-2"], ["--variants", "random"], ["--variants", ""], ["--rank-of", "0"],
                ["--rank-of", "2", "--tp", "2"]):
        with pytest.raises(SystemExit):
            decode.parse_args(bad)
    row = {"model": "qwen3-0.6b", "weight_bytes": 1.19e9, "floor_ms": 0.28, "megakernel_ms": 0.35,
           "megakernel_fraction_of_floor": 0.8, "torch_graph_ms": 3.5, "torch_fraction_of_floor": 0.08,
           "speedup_vs_torch_graph": 10.0}
    text = decode.table([row, {"model": "qwen3-8b", "error": "CudaError: boom"}])
    assert "| qwen3-0.6b | 1.19 GB | 0.280 ms | 0.350 ms | 80% | 3.500 ms | 8% | 10.00x |" in text
    assert "| qwen3-8b | failed: CudaError: boom |" in text
    row["variants"] = {"default": {"megakernel_ms": 0.35, "megakernel_fraction_of_floor": 0.8},
                       "no-preload": {"error": "CudaError: boom"}}
    variants = decode.variant_table([row, {"model": "qwen3-8b", "error": "x"}])
    assert "| model | default | no-preload |" in variants      # the variants measured, in VARIANTS' order
    assert "| qwen3-0.6b | 0.350 ms (80%) | failed: CudaError: boom |" in variants
    assert "| qwen3-8b | - | - |" in variants
    for variant in decode.VARIANTS:   # every variant is one the engine takes, on one GPU and a rank's shapes
        assert generate_source_for(decode.variant_options(variant))
        assert generate_source_for(decode.variant_options(variant, 2))
    assert decode.variant_options("default", 2) == MegakernelOptions().for_world(2)
    assert decode.profile_step_us([TaskRecord(0, 1, 1000, 1000, 1000, 3000), TaskRecord(1, 2, 500, 900, 900, 2000),
                                   TaskRecord(2, 1, 3000, 3500, 3500, 9000)], 2) == [2.5, 6.0]
    phases = decode.phase_table({"qkv": {"tasks": 2, "body_ns": 2_000_000, "wait_ns": 500_000,
                                         "exposed_wait_ns": 250_000, "queued_ns": 0}})
    assert "| qkv | 2 | 2.00 | 0.50 | 0.25 | 0.00 |" in phases
    layer = decode.layer_table({"attn": {"span_us": 9.3, "body_us": 7.8, "gap_us": 0.5}, "layer": {"span_us": 126.0}},
                               {"attn": {"parts_ns": {"scores": 3000, "softmax": 1000}}})
    assert "| attn | 9.3 | 7.8 | 0.5 | scores 75%, softmax 25% |" in layer and "| layer | 126.0 | - | - |  |" in layer
    idle = decode.idle_json({("qkv", "down"): {"tasks": 132, "body_us": 9.02, "idle_before_us": 5.06}})
    assert idle == {"qkv after down": {"tasks": 132, "body_us": 9.02, "idle_before_us": 5.06}}
    assert "| qkv | down | 132 | 9.02 | 5.06 |" in decode.idle_table(idle)


@no_gpu
def test_decode_benchmark_says_it_needs_a_gpu(tmp_path, capsys):
    from benchmarks import decode

    assert decode.main(["--quick", "--out", str(tmp_path)]) == 1
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_compile_model_lowers_by_rule_and_refuses_what_the_device_does_not_hold():
    from mdsl.errors import UnsupportedError
    from mdsl.megakernel.modelgraph.architectures import sampling_decode, step_function
    from mdsl.megakernel.modelgraph.model import model
    from mdsl.megakernel.runtime.megakernel_engine import compile_model

    config, _, weights = tiny_model("qwen3")

    @model
    def no_mlp(m, cfg):   # a user's model: attention only
        h = cfg.hidden_size
        x = m.embedding(m.weight("model.embed_tokens.weight", [cfg.vocab_size, h]))
        logits = m.linear(m.rms_norm(x, m.weight("model.norm.weight", [h]), cfg.rms_norm_eps),
                          m.weight("model.embed_tokens.weight", [cfg.vocab_size, h]))
        return logits, m.argmax(logits)

    with pytest.raises(UnsupportedError, match="cannot run lm_head_argmax .* where the device reads h2") as info:
        compile_model(no_mlp, config, weights)
    assert "test_runtime_engine.py" in str(info.value)   # the line of the user's step function
    cases = [(step_function(config), {"temperature": 0.0, "top_p": 1.0, "seed": 0}),
             (sampling_decode("qwen3", temperature=0.7, top_p=0.9, seed=4), {"temperature": 0.7, "top_p": 0.9, "seed": 4})]
    for fn, sampling in cases:   # the built-in graphs, argmax or sample at the end, are accepted
        if has_gpu():
            assert compile_model(fn, config, weights, max_seq=16).sampling == sampling
        else:
            with pytest.raises(NoGPUError):
                compile_model(fn, config, weights)


def test_bad_options_are_refused_before_the_gpu_is_needed():
    config, _, weights = tiny_model("qwen3")
    with pytest.raises(OptionError, match="options is a dict, not a MegakernelOptions") as info:
        MegakernelEngine(config, weights, options={"attention_splits": 4})
    assert "MegakernelOptions(...)" in info.value.hint
    with pytest.raises(OptionError, match="rank_sums 2 under tensor parallelism"):
        MegakernelEngine(config, weights, options=MegakernelOptions(rank_sums=2), ranks=RankGroup(0, 2, None))
