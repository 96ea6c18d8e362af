"""benchmarks/prefill.py without a GPU: the arguments, the floor's arithmetic, the tables, and a whole run on
a tiny Qwen3 with the CPU device playing the GPU device (its op profile stubbed)."""
from __future__ import annotations

import json

import pytest

from benchmarks import prefill as P


def test_the_prompts_and_models_parse_and_bad_ones_are_refused():
    args = P.parse_args(["--prompts", "128,1024", "--models", "qwen3-0.6b, qwen3-8b"])
    assert args.prompts == [128, 1024] and args.models == ["qwen3-0.6b", "qwen3-8b"] and args.device == "gpu"
    for bad in (["--prompts", "12,x"], ["--prompts", "0"], ["--prompts", ""], ["--repeats", "0"],
                ["--device", "cpu"]):
        with pytest.raises(SystemExit):
            P.parse_args(bad)


def test_the_floor_counts_the_layers_linears_per_token_the_head_once_and_causal_attention():
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.modelgraph.model_config import config_from_dict
    from mdsl.megakernel.runtime.models import MODELS

    config = config_from_dict(MODELS["qwen3-8b"])
    graph = step_function(config).trace(config)
    h, i, L = 4096, 12288, 36
    per_layer = h * 4096 + 2 * h * 1024 + 4096 * h + 3 * h * i       # q, k, v, o; gate, up, down
    pairs = 1024 * 1025 / 2
    expected = 2 * L * per_layer * 1024 + 2 * 151936 * h + 4 * 128 * 32 * L * pairs
    assert P.prompt_flops(graph, config, 1024) == pytest.approx(expected, rel=1e-12)
    # the layers' 6.95 G weights (not the 1.2 G of the embedding and the head a token) at 1024 tokens: ~19 ms
    assert 0.019 < P.prompt_flops(graph, config, 1024) / P.FLOPS < 0.020


def test_the_tables_show_each_prompt_beside_pytorch_and_the_op_profile():
    result = {"rows": [
        {"model": "m", "prompt": 128, "device": "gpu", "steps": 1, "floor_s": 0.001, "ttft_s": 0.004,
         "torch_s": 0.002, "same_token": True, "ops_us": {"linear": 2000.0, "attention": 500.0}},
        {"model": "m", "prompt": 1024, "device": "gpu", "steps": 4, "floor_s": 0.01, "ttft_s": 0.02,
         "ops_us": {"attention": 9000.0}},
        {"model": "m", "prompt": 256, "device": "gpu", "steps": 1, "floor_s": 0.002, "ttft_s": 0.004,
         "torch_s": 0.004, "same_token": False, "torch_runner_up": True},
        {"model": "m", "prompt": 512, "device": "gpu", "steps": 2, "floor_s": 0.002, "ttft_s": 0.004,
         "torch_s": 0.004, "same_token": False, "torch_runner_up": False}]}
    text = P.tables(result)
    assert "| m | 128 | 1 | 1.0 | 4.0 | 25% | 2.0 | 2.00× | yes |" in text
    assert "| m | 1024 | 4 | 10.0 | 20.0 | 50% | - | - | - |" in text
    assert "| m | 256 | 1 | 2.0 | 4.0 | 50% | 4.0 | 1.00× | no (2nd) |" in text   # PyTorch's runner-up: a near-tie
    assert "| m | 512 | 2 | 2.0 | 4.0 | 50% | 4.0 | 1.00× | no |" in text
    # the op profile of each model's longest prompt
    assert "| model | prompt | attention | sum |" in text and "| m | 1024 | 9.00 | 9.00 |" in text
    assert "| m | 128 | 0.50" not in text


def test_a_whole_run_on_the_cpu_device(tmp_path, monkeypatch):
    """main end to end on a tiny Qwen3: a row per prompt with its steps (the prompt over the step budget),
    the same first token in every run, the op profile kept, and both files written."""
    import mdsl
    from mdsl.megakernel.runtime import models
    from tests.megakernel.tiny import tiny_config_dict

    profiled = []

    class OnTheCpu(mdsl.LLM):
        def __init__(self, folder, device, **engine):
            super().__init__(folder, device="cpu", **engine)
            self.device.profile_ops = lambda on, kernels=False: profiled.append((on, kernels)) or {
                "linear: linear_wgmma_bf16_16": (8.0, 3), "linear: round_rows_bf16": (2.0, 3)}

    monkeypatch.setitem(models.MODELS, "tiny-qwen3", tiny_config_dict("qwen3", max_position_embeddings=512))
    monkeypatch.setattr(mdsl, "LLM", OnTheCpu)
    assert P.main(["--models", "tiny-qwen3", "--prompts", "5,40", "--max-tokens-per-step", "16", "--repeats", "2",
                   "--no-torch", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "prefill.json").read_text())
    assert [(r["prompt"], r["steps"], r["max_tokens_per_step"]) for r in result["rows"]] == [(5, 1, 16), (40, 3, 16)]
    # (an op's time is its kernels')
    assert all(r["ops_us"] == {"linear": 30.0} and r["ttft_s"] > 0 for r in result["rows"])
    assert all(r["kernels_us"] == {"linear: linear_wgmma_bf16_16": 24.0, "linear: round_rows_bf16": 6.0}
               for r in result["rows"])
    assert profiled == [(True, True), (False, False)] * 2
    assert "| tiny-qwen3 | 40 | 3 |" in (tmp_path / "prefill.md").read_text()


def test_an_unknown_model_is_refused_by_name():
    with pytest.raises(SystemExit, match="unknown model.*nope"):
        P.main(["--models", "nope", "--no-torch"])
