"""`mdsl serve`'s command line: its devices are the engine's."""
from __future__ import annotations

import pytest

from mdsl.cli import make_parser
from mdsl.serving.engine import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_every_device_of_the_engine_is_a_choice(device):
    assert make_parser().parse_args(["serve", "--model", "m", "--device", device]).device == device


def test_the_device_is_the_cpu_unless_asked_and_an_unknown_one_is_refused(capsys):
    assert make_parser().parse_args(["serve", "--model", "m"]).device == "cpu"
    assert "megakernel" in DEVICES
    with pytest.raises(SystemExit) as exit_:
        make_parser().parse_args(["serve", "--model", "m", "--device", "tpu"])
    assert exit_.value.code == 2 and "choose from 'cpu', 'gpu', 'megakernel'" in capsys.readouterr().err
