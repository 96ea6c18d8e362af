"""`mdsl generate` checks its arguments and the whole checkpoint before it looks for a GPU: on a machine
without one, every mistake gets its own error, and only a valid invocation gets "needs an NVIDIA GPU"."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from mdsl.backend.cuda.runtime import has_gpu
from mdsl.cli import main
from mdsl.megakernel.modelgraph.checkpoint import save_checkpoint
from tests.megakernel.tiny import tiny_config_dict, tiny_model

no_gpu = pytest.mark.skipif(has_gpu(), reason="checks the behaviour without a GPU")


def _save(folder, **config):
    """The weights of the 2-layer tiny Qwen3 under its config with `config`'s changes."""
    _, _, weights = tiny_model("qwen3")
    save_checkpoint(str(folder), tiny_config_dict("qwen3", **config), weights)
    return folder


@pytest.fixture
def checkpoint(tmp_path):
    return _save(tmp_path / "ckpt")


def _generate(folder, *extra, prompt=("--prompt-ids", "1,2,3")):
    return ["generate", "--model", str(folder), *prompt, "--max-new-tokens", "4", *extra]


@pytest.mark.parametrize("extra,words", [
    (["--top-p", "2"], r"argument --top-p: expected a probability mass in \(0, 1\], got 2"),
    (["--top-p", "0"], r"argument --top-p: expected a probability mass in \(0, 1\], got 0"),
    (["--top-p", "nan"], r"argument --top-p: expected a probability mass"),
    (["--tp", "0"], r"argument --tp: expected a positive integer, got 0"),
    (["--tp", "-2"], r"argument --tp: expected a positive integer, got -2"),
    (["--tp", "two"], r"argument --tp: expected a positive integer, got 'two'"),
    (["--max-new-tokens", "0"], r"argument --max-new-tokens: expected a positive integer, got 0"),
    (["--max-new-tokens", "-5"], r"argument --max-new-tokens: expected a positive integer, got -5"),
    (["--temperature", "-0.5"], r"argument --temperature: expected a finite temperature >= 0"),
    (["--temperature", "inf"], r"argument --temperature: expected a finite temperature >= 0"),
    (["--seed", "-1"], r"argument --seed: expected an integer from 0 to 2\*\*64 - 1, got -1"),
    (["--max-seq", "0"], r"argument --max-seq: expected a positive integer, got 0"),
    (["--prompt-ids", "1,-2"], r"argument --prompt-ids: token ids are not negative, got -2"),
    (["--prompt-ids", "1,x"], r"argument --prompt-ids: expected comma-separated token ids"),
])
def test_a_bad_argument_is_named(checkpoint, capsys, extra, words):
    with pytest.raises(SystemExit) as info:
        main(_generate(checkpoint, *extra))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert re.search(words, err), err
    assert "NVIDIA GPU" not in err


@pytest.mark.parametrize("extra,words", [
    (["--prompt-ids", "1,96"], r"prompt token ids \[96\] are outside the vocabulary of .* \(0\.\.95\)"),
    (["--max-seq", "25"], r"--max-seq 25 is more positions than the model's max_position_embeddings \(24\)"),
    (["--max-seq", "6"], r"3 prompt tokens and 4 new ones need 7 positions; the KV cache has 6"),
    (["--max-new-tokens", "22"], r"3 prompt tokens and 22 new ones need 25 positions; the KV cache has 24"),
    (["--tp", "3"], r"--tp 3: tensor parallelism over 3 ranks: .* do not split into 3 equal parts\n"
                    r"hint: world sizes this model allows: 1, 2"),
    (["--tp", "2", "--temperature", "0.7", "--top-p", "0.9"],
     r"nucleus sampling \(--top-p 0.9\) is not implemented for tensor parallelism"),
    (["--profile", "/nonexistent-folder/trace.json"], r"--profile /nonexistent-folder/trace.json: not a file in an "
                                                      r"existing folder"),
])
def test_a_request_that_does_not_fit_the_model_is_named(checkpoint, capsys, extra, words):
    assert main(_generate(checkpoint, *extra)) == 2
    err = capsys.readouterr().err
    assert re.search(words, err), err
    assert "NVIDIA GPU" not in err and "Traceback" not in err


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _broken_generation_config(folder):
    (folder / "generation_config.json").write_text('{"eos_token_id": ')


def _eos_outside(folder):
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 500]}))


def _bad_field(folder):
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(raw, hidden_size="abc")))


def _no_config(folder):
    os.remove(folder / "config.json")


def _one_layer_config(folder):
    _save(folder, num_hidden_layers=1)


def _wrong_shape(folder):
    _, _, weights = tiny_model("qwen3")
    weights = dict(weights, **{"model.norm.weight": np.ones(31, np.float32)})
    save_checkpoint(str(folder), tiny_config_dict("qwen3"), weights)


@pytest.mark.parametrize("damage,words", [
    (_truncate, r"model\.safetensors: tensor .* do not hold its \d+ bytes within the \d+ data bytes"),
    (_broken_generation_config, r"generation_config\.json: the generation config is not valid JSON"),
    (_eos_outside, r"generation_config\.json: eos_token_id must be .* each 0\.\.95, got \[2, 500\]"),
    (_bad_field, r"config\.json: hidden_size must be a positive integer .*got 'abc'"),
    (_no_config, r"no config\.json at"),
    (_one_layer_config, r"tensor\(s\) that qwen3 does not use: model\.layers\.1\."),
    (_wrong_shape, r"model\.norm\.weight in model\.safetensors has shape \[31\], expected \[32\]"),
])
def test_a_damaged_checkpoint_is_named_before_the_gpu(checkpoint, capsys, damage, words):
    damage(checkpoint)
    assert main(_generate(checkpoint)) == 2
    err = capsys.readouterr().err
    assert re.search(words, err), err
    assert "NVIDIA GPU" not in err and "\nhint: " in err


def test_a_missing_model_folder(tmp_path, capsys):
    assert main(_generate(tmp_path / "nothing")) == 2
    assert "no config.json at" in capsys.readouterr().err


@no_gpu
@pytest.mark.parametrize("extra", [[], ["--tp", "2"], ["--temperature", "0.7", "--top-p", "0.9", "--seed", "5"]])
def test_a_valid_request_without_a_gpu_says_so(checkpoint, capsys, extra):
    assert main(_generate(checkpoint, *extra)) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_the_command_line_program_prints_no_traceback(checkpoint):
    _truncate(checkpoint)
    done = subprocess.run([sys.executable, "-m", "mdsl", *_generate(checkpoint)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2 and done.stderr.startswith("mdsl: error: ") and "Traceback" not in done.stderr
