"""A program that launches nothing (it returns its input) has a plan that prints, and only a plan that
prints is stored: `mdsl optimize` on it works the first time and every time after."""
from __future__ import annotations

import pytest

from mdsl.cli import main
from mdsl.ir.dtypes import f32
from mdsl.ir.graph import KernelGraph, Node, make_var
from mdsl.search.cache import PlanCache
from mdsl.search.config import SearchConfig
from mdsl.search.cost import estimate, roofline_floor
from mdsl.search.plan import Evidence, Plan
from mdsl.search.stats import SearchStats

IDENTITY = '''\
import mdsl
from mdsl import Tensor, f16


@mdsl.kernel
def identity(x: Tensor[4, 8, f16]):
    return x
'''


@pytest.mark.timeout(120)
def test_optimize_on_an_identity_kernel_prints_its_plan_twice(tmp_path, capsys):
    path = tmp_path / "identity.py"
    path.write_text(IDENTITY)
    argv = ["optimize", str(path), "--budget", "20", "--workers", "1"]
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "plan for kernel identity" in first and "the original program" in first
    assert "the plan launches no kernel" in first and "0 launch(es)" in first
    assert first.rstrip().endswith("return %x\n}")
    assert main(argv) == 0   # answered from the cache the first run stored
    second = capsys.readouterr().out.splitlines()
    assert any(line.startswith("# cached:") for line in second)
    assert [line for line in second if not line.startswith("# cached:")] == first.splitlines()


def _plan(original: KernelGraph, chosen: KernelGraph) -> Plan:
    evidence = Evidence(True, "test", 3, 1e-12, 1e-4, 1e-2, 0)
    return Plan(original, chosen, estimate(chosen), roofline_floor(original), evidence, SearchStats(), (),
                SearchConfig(budget_s=10, workers=1), "0.1.0")


def test_a_plan_that_launches_nothing_prints_without_a_ratio():
    x = make_var("x", (4, 8), f32)
    y = make_var("y", (4, 8), f32)
    original = KernelGraph("k", (x,), (Node("mul_scalar", (x,), (y,), (("value", 1.0),)),), (y,))
    chosen = KernelGraph("k", (x,), (), (x,))
    plan = _plan(original, chosen)
    assert plan.cost.seconds == 0 and plan.original_cost.seconds > 0
    header = plan.header()
    assert header[0].endswith(f"no kernel to launch, where the original takes {plan.original_cost.seconds * 1e6:.3g} us")
    assert header[2].endswith("the plan launches no kernel")
    assert "inf" not in "\n".join(header) and "nan" not in "\n".join(header)


def test_a_plan_that_does_not_print_is_not_stored(tmp_path, monkeypatch):
    x = make_var("x", (4, 8), f32)
    plan = _plan(KernelGraph("k", (x,), (), (x,)), KernelGraph("k", (x,), (), (x,)))
    cache = PlanCache(tmp_path)

    def broken(self, verbose=False):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr(Plan, "header", broken)
    with pytest.raises(ZeroDivisionError):
        cache.store("k" * 64, plan)
    assert not cache.path("k" * 64).exists()
    monkeypatch.undo()
    assert cache.store("k" * 64, plan) == cache.path("k" * 64)


def test_the_gpu_report_of_a_plan_that_takes_no_time_has_no_ratio():
    from mdsl.backend.cuda.check import GpuReport

    (_, timing) = GpuReport("H200", 0.0, 1e-3, 0.0, 2.5).lines()
    assert "mdsl 0.0 us per call" in timing and "PyTorch 2.5 us (mean of" in timing and "x)" not in timing
    assert "(2.00x)" in GpuReport("H200", 0.0, 1e-3, 1.25, 2.5).lines()[1]
