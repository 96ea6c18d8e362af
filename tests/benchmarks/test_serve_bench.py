"""benchmarks/serve.py without a GPU: the seeded workload, the summaries and the tables."""
from __future__ import annotations

from benchmarks import serve as S


def test_the_workload_is_seeded_and_within_its_ranges():
    args = S.parse_args(["--requests", "50", "--prompt-len", "3:9", "--output-len", "2:4", "--seed", "5"])
    work = S.workload(args, vocab=100)
    assert work == S.workload(args, vocab=100) and len(work) == 50
    assert all(3 <= len(p) <= 9 and 2 <= n <= 4 and all(0 <= t < 100 for t in p) for p, n in work)
    assert work != S.workload(S.parse_args(["--requests", "50", "--prompt-len", "3:9", "--output-len", "2:4"]), 100)


def test_a_summary_counts_tokens_and_times_from_the_records():
    records = [{"start": 0.0, "times": [1.0, 1.5, 2.0], "expected": 3}, {"start": 1.0, "times": [1.5, 3.5], "expected": 4}]
    s = S.summary("offline", records)
    assert s["output_tokens"] == 5 and s["wall_s"] == 3.5 and s["short"] == 1
    assert s["ttft_p50_s"] == 0.75 and s["tpot_p50_s"] == 1.25


def test_the_tables_show_every_measurement():
    result = {"model": "qwen3-0.6b", "decode": [{"batch": 8, "context": 1024, "mean_context": 1040.4, "steps": 31,
                                                  "step_s": 0.004, "floor_s": 0.001, "ops_us": {"linear": 1500.0}}],
              "runs": [S.summary("online 4/s", [{"start": 0.0, "times": [0.1, 0.2], "expected": 2}])]}
    text = S.tables(result)
    assert "| 8 | 1024 | 1040 | 4.00 ms | 1.000 ms | 25% | 2000 | - | - |" in text and "| online 4/s | 1 | 2 |" in text
    result["decode"][0]["torch_step_s"] = 0.006
    assert "| 8 | 1024 | 1040 | 4.00 ms | 1.000 ms | 25% | 2000 | 6.00 ms | 1.50 |" in S.tables(result)
    assert "| batch | linear | sum |" in text and "| 8 | 1500 | 1500 |" in text


def test_every_timed_decode_step_has_the_whole_batch(tmp_path):
    """decode_steps on the CPU device (its op profile stubbed): the prompts are read oldest first, so the
    first requests decode while the last ones' prompts are read; none may end before the timed and profiled
    steps are over, and all are cancelled after."""
    from mdsl import LLM
    from tests.serving.conftest import write_checkpoint

    ckpt = write_checkpoint(tmp_path, "qwen3", positions=400, torch_dtype="float32")
    batch, context, tokens = 6, 40, 5
    with LLM(ckpt.folder, device="cpu", max_batch=8, max_seq=400, max_tokens_per_step=32) as llm:
        llm.device.profile_ops = lambda on: {}
        llm.device.replays = 0
        d = S.decode_steps(llm, batch, context, tokens, 96, 0)
        assert d["steps"] >= tokens and d["batch"] == batch
        assert context < d["mean_context"] < context + S.decode_budget(32, batch, context, tokens)
        assert llm.stats().running == 0 and llm.stats().peak_running == batch
