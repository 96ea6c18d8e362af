"""benchmarks/serve_http.py on the CPU device: a few streaming clients against the server it starts, the
same requests offline through the engine, identical tokens and no errors; and against a running server."""
from __future__ import annotations

import json

import httpx
import pytest

from benchmarks import serve_http
from tests.server.conftest import API_KEY


def test_the_load_generator_drives_a_server_it_starts_and_compares_with_the_engine_offline(checkpoint, tmp_path):
    code = serve_http.main(["--model", checkpoint, "--clients", "3", "--requests", "7", "--prompt-len", "2:6",
                            "--max-tokens", "4", "--offline", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "serve_http.json").read_text())
    assert code == 0, result
    http, offline = result["runs"]
    for run in (http, offline):
        assert (run["requests"], run["output_tokens"], run["errors"], run["clients"]) == (7, 28, 0, 3)
        assert run["output_tokens_per_s"] > 0 and 0 < run["ttft_p50_s"] <= run["ttft_p99_s"]
        assert 0 < run["tpot_p50_s"] <= run["tpot_p99_s"]
    assert result["mismatched"] == 0 and result["http_over_offline"] > 0
    assert result["engine"] == {"max_batch": 3, "max_seq": 10, "device": "cpu"}
    assert result["meta"]["command"].startswith("benchmarks/serve_http.py --model")
    table = (tmp_path / "serve_http.md").read_text()
    assert "| HTTP (mdsl serve) | 3 | 7 | 28 |" in table and "| offline (LLM.submit) | 3 | 7 | 28 |" in table
    assert "Finished server process" in (tmp_path / "serve_http.server.log").read_text()


def test_the_load_generator_drives_a_running_server(server, checkpoint, tmp_path):
    code = serve_http.main(["--model", checkpoint, "--url", server.url, "--api-key", API_KEY, "--clients", "2",
                            "--requests", "3", "--prompt-len", "3:3", "--max-tokens", "2", "--out", str(tmp_path)])
    (http,) = json.loads((tmp_path / "serve_http.json").read_text())["runs"]
    assert code == 0 and (http["output_tokens"], http["errors"]) == (6, 0)


def test_a_wrong_api_key_stops_the_load_generator_before_it_starts(server, checkpoint, tmp_path):
    with pytest.raises(httpx.HTTPStatusError, match="401"):
        serve_http.main(["--model", checkpoint, "--url", server.url, "--api-key", "nope", "--clients", "1",
                         "--requests", "1", "--max-tokens", "2", "--out", str(tmp_path)])
