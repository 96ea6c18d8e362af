"""benchmarks/serve_host.py on a tiny checkpoint: the engine's steps around a forward that only waits, every
request decoding, timed as the host's share of a step."""
from __future__ import annotations

import pytest

from benchmarks import serve_host
from tests.serving.conftest import VOCAB, write_checkpoint


@pytest.mark.timeout(120)
def test_the_host_share_of_a_step_is_the_step_less_the_time_its_forwards_wait(tmp_path):
    write_checkpoint(tmp_path, "qwen3", positions=4096 + 64)
    row = serve_host.host_us(str(tmp_path), VOCAB, batch=3, context=20, forward_s=0.002, seconds=0.3)
    assert row["batch"] == 3 and row["context"] == 20 and row["steps"] > 10
    # each step waits out the forward's 2 ms (at least: a sleep overshoots), the host's share what is left
    assert row["forward_us"] >= 2000 and row["step_us"] > row["forward_us"]
    assert row["host_us"] == pytest.approx(row["step_us"] - row["forward_us"])
    assert 0 < row["host_us"] < row["step_us"]


def test_the_devices_forward_is_a_wait_that_checks_the_pool_and_every_sampling_row_takes_token_1():
    """As on the GPU device: the pool's check inside the forward (beside the step's kernels there), and the
    tokens an array in chunk order where every chunk samples (the GPU device's greedy tokens), else a dict."""
    import types

    import numpy as np

    device = serve_host.host_device(0.0)
    chunks = np.array([(0, 0, 3, 0, 1, 0), (1, 5, 1, 3, 0, 0), (2, 9, 1, 4, 1, 0)],
                      dtype=[("entry", "i4"), ("start", "i4"), ("count", "i4"), ("row", "i4"), ("sample", "i4"),
                             ("pad", "i4")])
    checked = []
    me = types.SimpleNamespace(_check_pool_now=lambda: checked.append(1),
                               state={"chunks": chunks, "step": {"num_chunks": np.array([3])}})
    assert sorted(device._forward(me, None, chunks, None)) == [2, 4]   # (each sampling chunk's last row)
    assert checked == [1]
    assert device._samples(me, {}) == {0: 1, 2: 1}
    chunks["sample"] = 1
    tokens = device._samples(me, {})
    assert isinstance(tokens, np.ndarray) and tokens.tolist() == [1, 1, 1]
