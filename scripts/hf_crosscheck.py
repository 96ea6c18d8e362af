"""Cross-check mdsl's numpy reference forward against Hugging Face transformers on the CPU.

For tiny random Llama-3 (rope_scaling llama3) and Qwen3 (q/k norm, tied embeddings) models: save
the model with save_pretrained (safetensors), load it with mdsl's reader, run greedy decoding with
both and compare the tokens and every step's logits.

Needs torch and transformers, which mdsl never depends on: run it from a separate environment that
has them plus attrs and numpy, with the repository on the path:

    python3 -m venv ~/hfenv
    ~/hfenv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
    ~/hfenv/bin/pip install transformers safetensors numpy attrs
    PYTHONPATH=. ~/hfenv/bin/python scripts/hf_crosscheck.py [--steps 32] [--dtype float32|bfloat16]

`--write-golden tests/megakernel/hf_golden.json` records transformers' tokens and logits for tiny
checkpoints written by mdsl's own writer from `pattern_weights` (integer-hash weights, identical on
every machine), so that CI, which has no torch, checks the reference forward against them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile

import numpy as np
import torch
import transformers

from mdsl.megakernel.modelgraph.architectures import step_function
from mdsl.megakernel.modelgraph.checkpoint import load_weights, pattern_weights, save_checkpoint
from mdsl.megakernel.modelgraph.model_config import config_from_dict, load_config
from mdsl.megakernel.modelgraph.reference import ReferenceModel

COMMON = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5,
              initializer_range=0.15, bos_token_id=1, eos_token_id=2)


def hf_model(arch: str, dtype: torch.dtype, seed: int):
    torch.manual_seed(seed)
    if arch == "llama3":
        config = transformers.LlamaConfig(**COMMON, rope_theta=500000.0, tie_word_embeddings=False,
                                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                        "high_freq_factor": 4.0,
                                                        "original_max_position_embeddings": 32})
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(**COMMON, rope_theta=1000000.0, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():   # norm weights away from 1, so that a missing or misplaced weight shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model.to(dtype).eval()


def check(arch: str, dtype_name: str, steps: int, seed: int) -> dict:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = hf_model(arch, dtype, seed)
    prompt = [1, 45, 201, 7, 99]
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder, safe_serialization=True)
        config = load_config(folder, max_positions=len(prompt) + steps)
        graph = step_function(config).trace(config)
        ours = ReferenceModel(graph, load_weights(graph, folder)).generate(prompt, steps)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
        theirs_tokens = tuple(out[0, len(prompt):].tolist())
        # every position's logits of the same sequence in one forward pass
        theirs_logits = model(out[:, :-1]).logits[0].float().numpy()
    diff = np.abs(ours.logits - theirs_logits)
    scale = np.abs(theirs_logits).max()
    agree = next((i for i, (a, b) in enumerate(zip(ours.tokens, theirs_tokens)) if a != b), len(theirs_tokens))
    return {"arch": arch, "dtype": dtype_name, "steps": steps, "tokens_equal": ours.tokens == theirs_tokens,
            "tokens_agree_for": agree, "max_abs_logit_diff": float(diff.max()), "max_abs_logit": float(scale),
            "max_rel_logit_diff": float(diff.max() / scale), "distinct_tokens": len(set(theirs_tokens))}


GOLDEN_COMMON = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 64, "torch_dtype": "float32", "hidden_act": "silu"}
GOLDEN_CONFIGS = {
    "llama3": {**GOLDEN_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "rope_theta": 500000.0, "tie_word_embeddings": False,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}},
    "qwen3": {**GOLDEN_COMMON, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "rope_theta": 1000000.0, "tie_word_embeddings": True},
}
GOLDEN_PROMPT = [3, 41, 7, 22]
GOLDEN_SCALE = 0.5   # large enough weights that greedy decoding wanders over many tokens


def golden(steps: int) -> dict:
    """transformers' greedy tokens and per-position logits on checkpoints written by mdsl."""
    out = {"transformers": transformers.__version__, "torch": torch.__version__, "prompt": GOLDEN_PROMPT,
           "steps": steps, "weight_scale": GOLDEN_SCALE, "models": {}}
    for arch, raw in GOLDEN_CONFIGS.items():
        config = config_from_dict(raw)
        graph = step_function(config).trace(config)
        with tempfile.TemporaryDirectory() as folder:
            save_checkpoint(folder, raw, pattern_weights(graph, GOLDEN_SCALE))
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.no_grad():
            seq = model.generate(torch.tensor([GOLDEN_PROMPT]), max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            logits = model(seq[:, :-1]).logits[0].float().numpy()
        out["models"][arch] = {"config": raw, "tokens": seq[0, len(GOLDEN_PROMPT):].tolist(),
                               "logits": [[float(f"{v:.7g}") for v in row] for row in logits]}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-golden", metavar="PATH", help="record the CI golden file and stop")
    args = ap.parse_args(argv)
    if args.write_golden:
        with open(args.write_golden, "w") as f:
            json.dump(golden(24), f, separators=(",", ":"))
            f.write("\n")
        print(f"wrote {args.write_golden}")
        return 0
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    ok = True
    for arch in ("llama3", "qwen3"):
        r = check(arch, args.dtype, args.steps, args.seed)
        print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        if args.dtype == "float32":
            ok &= r["tokens_equal"] and r["max_abs_logit_diff"] < 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
