"""benchmarks/decode.py's contexts without a GPU (the options, the floor, a row's runs through a stand-in
engine, the tables) and benchmarks/report.py's decode tables with and without contexts."""
from __future__ import annotations

import types

import attrs
import pytest

from benchmarks import decode as D
from benchmarks import report as R
from mdsl.ir.dtypes import bf16
from mdsl.megakernel.modelgraph.model_config import config_from_dict
from mdsl.megakernel.parallel.gpu_group import shard_config
from mdsl.megakernel.runtime.models import MODELS
from mdsl.megakernel.runtime.shape import decoder_shape


def config_of(name: str):
    return attrs.evolve(config_from_dict(MODELS[name]), dtype=bf16)


def test_contexts_are_parsed_and_checked():
    assert D.parse_args([]).contexts == [1024]
    assert D.parse_args(["--contexts", "1024, 32768"]).contexts == [1024, 32768]
    assert D.parse_args(["--models", "llama-3.2-1b", "--contexts", "100000"]).contexts == [100000]
    # Qwen3 has 40960 positions: context 40900 with 128 steps reaches position 41026
    for bad in (["--contexts", "1k"], ["--contexts", "0"], ["--contexts", "1024,1024"], ["--contexts", ","],
                ["--models", "qwen3-8b", "--contexts", "40900"]):
        with pytest.raises(SystemExit):
            D.parse_args(bad)
    assert D.parse_args(["--models", "qwen3-8b", "--quick", "--contexts", "40900"]).steps == 32   # 40930 fits


def test_the_floor_counts_the_weights_and_the_kv_bytes_of_the_context():
    shape = decoder_shape(config_of("qwen3-8b"))
    # 32768 positions x 36 layers x (k, v) x 8 kv heads x 128 x 2 bytes: the 4.8 GB cache of a 32k context
    assert D.kv_bytes(shape, 32768) == 32768 * 36 * 2 * 8 * 128 * 2 == 4_831_838_208
    assert D.kv_bytes(shape, 1024) * 32 == D.kv_bytes(shape, 32768)
    assert D.floor_seconds(shape, 32768) == (shape.weight_bytes() + 4_831_838_208) / 4.25e12
    llama = decoder_shape(config_of("llama-3.2-1b"))
    assert D.kv_bytes(llama, 32768) == 32768 * 16 * 2 * 8 * 64 * 2
    rank = decoder_shape(shard_config(config_of("qwen3-8b"), 2))   # a rank reads its 4 kv heads
    assert 2 * D.kv_bytes(rank, 32768) == D.kv_bytes(shape, 32768)


class StandInEngine:
    """What bench_variant reads of a MegakernelEngine; runs return `seconds` per step, recorded."""

    built: list = []

    def __init__(self, config, weights, *, options, max_seq):
        self.max_seq, self.runs = max_seq, []
        self.plan = types.SimpleNamespace(tasks=[None] * 10)
        self.workers, self.smem_bytes = 132, 50_000
        self.module = types.SimpleNamespace(resources={"mdsl_megakernel": types.SimpleNamespace(registers=128)})
        StandInEngine.built.append(self)

    def run(self, tokens, steps, *, start, eos_token_ids, profile=False):
        self.runs.append((len(tokens), start, steps))
        return types.SimpleNamespace(steps=steps, seconds=0.005 * steps)

    def close(self):
        pass


@pytest.mark.parametrize("torch_fails", [False, True])
def test_a_row_runs_at_its_context_and_keeps_the_megakernel_when_pytorch_fails(monkeypatch, tmp_path, torch_fails):
    def time_torch(torch, config, weights, context, args):
        if torch_fails:
            raise RuntimeError("CUDA out of memory")
        return [0.02, 0.02]

    monkeypatch.setattr(D, "time_torch", time_torch)
    StandInEngine.built = []
    args = D.parse_args(["--quick", "--models", "qwen3-8b", "--variants", "default", "--contexts", "1024,32768",
                         "--out", str(tmp_path)])
    config = config_of("qwen3-8b")
    shape = decoder_shape(config)
    row = D.bench_context(None, StandInEngine, config, shape, {}, "qwen3-8b", 32768, args, tmp_path)
    engine, = StandInEngine.built
    assert engine.max_seq == 32768 + 32 + 8
    assert set(engine.runs) == {(32768, 32767, 32)}   # the warm-up and the 2 timed launches
    assert (row["context"], row["kv_bytes"], row["megakernel_ms"]) == (32768, D.kv_bytes(shape, 32768), 5.0)
    assert row["floor_ms"] == D.floor_seconds(shape, 32768) * 1e3
    assert row["megakernel_fraction_of_floor"] == pytest.approx(row["floor_ms"] / 5.0)
    if torch_fails:
        assert row["torch_error"] == "RuntimeError: CUDA out of memory" and "torch_graph_ms" not in row
        assert "| qwen3-8b | 32768 | 15.14 GB | 4.699 ms | 5.000 ms | 94% | - | - | - |" in D.table(
            [{**row, "context": 1024}, row])
    else:
        assert (row["torch_graph_ms"], row["speedup_vs_torch_graph"]) == (20.0, 4.0)


def test_the_printed_tables_name_the_context():
    row = {"model": "qwen3-8b", "weight_bytes": 15.14e9, "floor_ms": 3.6, "megakernel_ms": 4.5,
           "megakernel_fraction_of_floor": 0.8, "torch_graph_ms": 9.0, "torch_fraction_of_floor": 0.4,
           "speedup_vs_torch_graph": 2.0, "variants": {"default": {"megakernel_ms": 4.5,
                                                                   "megakernel_fraction_of_floor": 0.8}}}
    one = D.table([row, {"model": "llama-3.2-1b", "error": "CudaError: boom"}])   # a row without a context: 1024
    assert one.splitlines()[0].startswith("| model (bf16, batch 1, context 1024) | weights | floor (weights + KV) |")
    assert "| qwen3-8b | 15.14 GB | 3.600 ms | 4.500 ms | 80% | 9.000 ms | 40% | 2.00x |" in one
    long = {**row, "context": 32768, "floor_ms": 4.7, "megakernel_ms": 5.875, "megakernel_fraction_of_floor": 0.8}
    both = D.table([{**row, "context": 1024}, long, {"model": "llama-3.2-1b", "context": 32768, "error": "boom"}])
    lines = both.splitlines()
    assert lines[0].startswith("| model (bf16, batch 1) | context | weights |")
    assert len(lines[1].split("|")) == len(lines[0].split("|"))
    assert "| qwen3-8b | 1024 | 15.14 GB | 3.600 ms |" in both and "| qwen3-8b | 32768 | 15.14 GB | 4.700 ms |" in both
    assert "| llama-3.2-1b | 32768 | failed: boom |" in both
    assert "| qwen3-8b @ 32768 | 4.500 ms (80%) |" in D.variant_table([{**row, "context": 1024}, long])
    assert "| qwen3-8b | 4.500 ms (80%) |" in D.variant_table([row])


def decode_json(rows: list, meta: dict) -> dict:
    return {"schema": 1, "meta": {"date": "2026-12-02", "command": "benchmarks/decode.py", "steps": 128,
                                  "repeats": 3, "trace_model": "none", **meta}, "models": rows}


def test_the_report_renders_rows_without_contexts_as_before():
    rows = [{"model": "qwen3-8b", "weight_bytes": 4.25e9, "megakernel_ms": 1.25, "torch_graph_ms": 2.5}]
    text = "\n".join(R.decode_section(decode_json(rows, {"context": 1024})))
    assert "batch 1, context 1024:" in text and "Floor: the weight bytes over 4.25 TB/s." in text
    assert "| model | weights | floor | megakernel |" in text
    assert "| Qwen3-8B | 4.25 GB | 1.000 ms | 1.250 ms | 80% | 2.500 ms | 40% | 2.00× |" in text
    h = R.headlines({"decode": decode_json(rows, {"context": 1024})})
    assert (h["decode_floor"], h["decode_ms_qwen3-8b"], h["decode_floor_qwen3-8b_1024"]) == ("80%", "1.25 ms", "80%")


def test_the_report_renders_a_row_per_model_and_context_with_the_kv_bytes_in_the_floor():
    rows = [{"model": "qwen3-8b", "context": 1024, "weight_bytes": 4.0e9, "kv_bytes": 0.25e9, "megakernel_ms": 1.25,
             "torch_graph_ms": 2.5},
            {"model": "qwen3-8b", "context": 32768, "weight_bytes": 4.0e9, "kv_bytes": 8.75e9,
             "megakernel_ms": 4.0},
            {"model": "llama-3.2-1b", "context": 32768, "error": "CudaError: boom"}]
    data = decode_json(rows, {"contexts": [1024, 32768]})
    text = "\n".join(R.decode_section(data))
    assert "batch 1, contexts 1024, 32768:" in text and "Floor: the weight bytes plus the KV cache bytes" in text
    assert "| model | context | weights | floor | megakernel |" in text
    assert "| Qwen3-8B | 1024 | 4.00 GB | 1.000 ms | 1.250 ms | 80% | 2.500 ms | 40% | 2.00× |" in text
    assert "| Qwen3-8B | 32768 | 4.00 GB | 3.000 ms | 4.000 ms | 75% | - | - | - |" in text
    assert "| Llama-3.2-1B | 32768 | failed: CudaError: boom | - |" in text
    h = R.headlines({"decode": data})
    # the README's figures by model are the first context's; every row's are keyed by its context too
    assert (h["decode_floor"], h["decode_ms_qwen3-8b"], h["decode_speedups"]) == ("80%", "1.25 ms", "2.00×")
    assert (h["decode_floor_qwen3-8b_32768"], h["decode_ms_qwen3-8b_32768"]) == ("75%", "4.00 ms")
    one = decode_json(rows[1:2], {"contexts": [32768]})
    assert "batch 1, context 32768:" in "\n".join(R.decode_section(one))
    assert "| context |" not in "\n".join(R.decode_section(one))


def test_the_report_reads_a_tensor_parallel_run_as_decode_py_writes_it():
    run = {"rank_weight_bytes": 3.0e9, "rank_kv_bytes": 1.25e9, "megakernel_ms": 1.25, "one_gpu_ms": 2.0}
    assert R.tp_floor_ms(run) == pytest.approx(1.0)
    assert R.tp_floor_ms({"weight_bytes": 4.25e9}) == pytest.approx(1.0)   # copied by hand: weights only
    rows = [{"model": "qwen3-8b", "context": c, "tensor_parallel": {"default": {**run, "megakernel_ms": ms}}}
            for c, ms in ((1024, 1.25), (32768, 1.6))]
    data = decode_json(rows, {"contexts": [1024, 32768]})
    text = "\n".join(R.tp_section(data))
    assert "Floor per rank: the shard's weight bytes plus its KV bytes a step reads over 4.25 TB/s." in text
    assert "| Qwen3-8B | 1024 | 3.00 GB | 1.000 ms | 2.000 ms | 1.250 ms | 80% | 0.625× |" in text
    assert "| Qwen3-8B | 32768 |" in text
    assert R.headlines({"decode_tp": data})["tp_ratio_qwen3-8b"] == "0.625×"   # the first context's


def test_a_model_yields_a_row_per_context_and_a_failing_context_leaves_the_others(monkeypatch, tmp_path):
    import mdsl.megakernel.runtime.megakernel_engine as engine_module

    class TooLong(StandInEngine):
        def __init__(self, config, weights, *, options, max_seq):
            if max_seq > 4096:
                raise MemoryError("no room for the KV cache")
            super().__init__(config, weights, options=options, max_seq=max_seq)

    freed = []
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None,
                                                                 empty_cache=lambda: freed.append(True)))
    monkeypatch.setattr(engine_module, "MegakernelEngine", TooLong)
    monkeypatch.setattr(D, "random_weights", lambda torch, config: {})
    monkeypatch.setattr(D, "time_torch", lambda torch, config, weights, context, args: [0.02, 0.02])
    StandInEngine.built = []
    args = D.parse_args(["--quick", "--models", "llama-3.2-1b", "--variants", "default", "--trace-model", "none",
                         "--contexts", "1024,32768,2048", "--out", str(tmp_path)])
    rows = list(D.bench_model(fake_torch, "llama-3.2-1b", args, tmp_path))
    assert [(r["context"], "error" in r) for r in rows] == [(1024, False), (32768, True), (2048, False)]
    assert rows[1]["error"] == "MemoryError: no room for the KV cache"
    assert [e.max_seq for e in StandInEngine.built] == [1024 + 40, 2048 + 40] and freed
