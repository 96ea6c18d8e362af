"""The numpy reference forward against Hugging Face transformers without torch: hf_golden.json holds
transformers' greedy tokens and per-position logits for tiny Llama-3 (llama3 rope scaling, positions
past its original window) and Qwen3 (q/k norm, tied embeddings) checkpoints, which this test writes
again with mdsl's own writer from the same integer-hash weights. Recorded by
`scripts/hf_crosscheck.py --write-golden` (its docstring says how)."""
import json
from pathlib import Path

import numpy as np
import pytest

from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import load_model, pattern_weights, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.modelgraph.reference import ReferenceModel
from mdsl.megakernel.taskgraph.partition import build_task_graph
from mdsl.megakernel.taskgraph.simulator import Simulator
from mdsl.megakernel.taskgraph.tasks import PartitionConfig

GOLDEN = json.loads((Path(__file__).parent / "hf_golden.json").read_text())


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_reference_forward_matches_transformers(arch, tmp_path):
    case = GOLDEN["models"][arch]
    config = config_from_dict(case["config"])
    save_checkpoint(str(tmp_path), case["config"], pattern_weights(step_function(config).trace(config),
                                                                           GOLDEN["weight_scale"]))
    model = load_model(str(tmp_path))
    prompt, steps = GOLDEN["prompt"], GOLDEN["steps"]
    ours = ReferenceModel(model.graph, model.weights).generate(prompt, steps)
    theirs = np.array(case["logits"], np.float32)
    assert ours.logits.shape == theirs.shape
    np.testing.assert_allclose(ours.logits, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())
    assert list(ours.tokens) == case["tokens"]
    assert len(set(case["tokens"])) > 8 and len(prompt) + steps > 2 * 8   # past llama3's original window
    # and the simulated megakernel on the same checkpoint
    task_graph = build_task_graph(model.graph, PartitionConfig(num_sms=12, column_align=4))
    simulated = Simulator(task_graph, model.weights).generate(prompt, steps, workers=7, seed=2)
    assert list(simulated.tokens) == case["tokens"]
    np.testing.assert_allclose(simulated.logits, theirs, rtol=0, atol=2e-5 * np.abs(theirs).max())
