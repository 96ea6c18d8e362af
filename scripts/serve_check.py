"""A GPU serving device on a tiny random checkpoint, for compute-sanitizer (scripts/gpu_session.sh's
sanitize stage): 12 requests of 4 to 300 tokens arriving together in a pool small enough to preempt;
exits 1 if a request ends short.

    python scripts/serve_check.py [--device gpu|megakernel]

The GPU device launches and replays its steps; the megakernel device runs them in its resident kernel."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mdsl import LLM, SamplingParams  # noqa: E402
from tests.serving.conftest import write_checkpoint  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("gpu", "megakernel"), default="gpu", help="the serving device (default gpu)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as folder:
        ckpt = write_checkpoint(folder, "qwen3", positions=320, torch_dtype="bfloat16")
        prompts = [[int(t) for t in rng.integers(0, 96, int(n))] for n in rng.integers(4, 300, 12)]
        with LLM(ckpt.folder, device=args.device, max_batch=8, page_size=16, kv_pages=40, max_tokens_per_step=96) as llm:
            handles = [llm.submit(p, SamplingParams(max_new_tokens=8)) for p in prompts]
            lengths = [len(h.result().token_ids) for h in handles]
            stats = llm.stats()
    print(f"{args.device}: tokens per request {lengths}; preemptions {stats.preemptions}; steps {stats.steps}")
    return 0 if lengths == [8] * len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
