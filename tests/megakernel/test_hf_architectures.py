"""The reference forwards of the architectures added in Python only against transformers' own model classes:
a tiny random model of each class, its weights written under their Hugging Face names with mdsl's writer
and read back through the architecture's mapping, and transformers' logits over the sequence mdsl decoded
(teacher-forced) close to mdsl's in float32, position by position. Skipped only where transformers (and
torch) are not installed."""
import numpy as np
import pytest

from mdsl.megakernel.modelgraph.checkpoint import load_model, save_checkpoint
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig
from tests.megakernel.tiny import ARCHITECTURES, tiny_config_dict

PROMPT = [5, 17, 3]
STEPS = 17


def _hf_model(raw: dict):
    # (imported here, not at collection: torch and transformers take seconds to import)
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    cls = raw["architectures"][0]
    # (special token ids inside the tiny vocabulary)
    config = getattr(transformers, cls.replace("ForCausalLM", "Config"))(**{"pad_token_id": 0, "bos_token_id": 1,
                                                                           "eos_token_id": 2, **raw})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:     # norm weights (and biases) near their usual values
                p.copy_(0.1 * torch.randn_like(p) + (0.0 if name.endswith(".bias") or _offset_norm(cls) else 1.0))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def _offset_norm(cls: str) -> bool:
    """Whether the class's RMSNorm scales by (1 + weight)."""
    return cls.startswith("Gemma")


def _checkpoint_tensors(model) -> dict:
    """The model's weights under their checkpoint names (transformers' state dict, tied copies once)."""
    out = {name: t.detach().float().numpy().copy() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def _compare(tmp_path, raw: dict, tensors=_checkpoint_tensors):
    model = _hf_model(raw)   # (it skips the test where transformers or torch is missing)
    import torch

    save_checkpoint(str(tmp_path), raw, tensors(model))
    loaded = load_model(str(tmp_path))
    ours = ReferenceModel(loaded.graph, loaded.weights).generate(PROMPT, STEPS)
    assert len(set(ours.tokens)) > 3, ours.tokens
    sequence = list(PROMPT) + list(ours.tokens[:-1])
    with torch.no_grad():
        theirs = model(torch.tensor([sequence])).logits[0].float().numpy()
    assert theirs.shape == ours.logits.shape
    np.testing.assert_allclose(ours.logits, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
    assert [int(t) for t in theirs.argmax(axis=1)[len(PROMPT) - 1:]] == list(ours.tokens)
    # and the simulated megakernel on the same checkpoint
    simulated = Simulator(build_task_graph(loaded.graph, PartitionConfig(num_sms=7, kv_splits=3)),
                          loaded.weights).generate(PROMPT, STEPS, workers=5, seed=1)
    assert simulated.tokens == ours.tokens
    return loaded


def test_mistral_matches_transformers(tmp_path):
    loaded = _compare(tmp_path, tiny_config_dict("mistral"))
    assert loaded.config.sliding_window == 5


@pytest.mark.parametrize("window", [7, None])
def test_phi3_matches_transformers(tmp_path, window):
    loaded = _compare(tmp_path, tiny_config_dict("phi3", sliding_window=window))
    assert loaded.config.fused_projections and loaded.config.sliding_window == (window or 0)


def test_gemma2_matches_transformers(tmp_path):
    # (untied: the tiny tied model's scaled embedding of a token points its logits back at the token)
    loaded = _compare(tmp_path, tiny_config_dict("gemma2", num_hidden_layers=3, tie_word_embeddings=False))
    assert loaded.config.sliding_layers == (True, False, True)
    assert loaded.config.attn_softcap == 2.0 and loaded.config.final_softcap == 3.0


def _per_expert_tensors(model) -> dict:
    """transformers 5 holds a layer's experts as two stacked tensors; the Hub's checkpoints (and mdsl's
    mapping) name each expert's gate, up and down weight."""
    out = {}
    for name, t in _checkpoint_tensors(model).items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name[:-len("gate_up_proj")], t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = t[e, :inter], t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_matches_transformers(tmp_path, norm_topk_prob):
    loaded = _compare(tmp_path, tiny_config_dict("qwen3_moe", norm_topk_prob=norm_topk_prob), _per_expert_tensors)
    assert loaded.config.num_experts == 6 and loaded.config.experts_per_token == 2


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen2_moe_with_its_shared_expert_matches_transformers(tmp_path, norm_topk_prob):
    """Qwen2-MoE: Qwen2's q|k|v biases, routed experts beside a wider shared expert scaled by sigmoid of its gate,
    a dense layer between the sparse ones."""
    loaded = _compare(tmp_path, tiny_config_dict("qwen2_moe", norm_topk_prob=norm_topk_prob), _per_expert_tensors)
    config = loaded.config
    assert (config.num_experts, config.shared_expert_size, config.dense_layers) == (6, 24, (1,))
    assert config.qkv_bias and [n.op for n in loaded.graph.nodes].count("gated_scale") == 2
