"""The aten -> mdsl mapping table (mdsl.torch.aten): every entry names an aten overload torch has and
registry operators mdsl has, and the operators the backend is asked to compute are in it."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="mdsl.torch needs PyTorch (the test extra installs its CPU build)")

from mdsl.ir.ops import OPS  # noqa: E402
from mdsl.torch.aten import ATEN_RULES, AtenRule, aten_name  # noqa: E402


def _overload(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


@pytest.mark.parametrize("name", sorted(ATEN_RULES))
def test_every_entry_names_an_aten_overload_and_registered_operators(name):
    entry = ATEN_RULES[name]
    assert isinstance(entry, AtenRule) and entry.aten == name
    overload = _overload(name)
    assert aten_name(overload) == name
    unknown = [op for op in entry.ops if op not in OPS]
    assert not unknown, f"{name} names operators the registry does not have: {unknown}"
    assert entry.doc, f"{name} has no description"


def test_the_table_covers_the_operators_of_transformer_blocks():
    wanted = ["aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default",
              "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default",
              "aten.exp.default", "aten.rsqrt.default", "aten.sqrt.default", "aten.reciprocal.default",
              "aten.pow.Tensor_Scalar", "aten.silu.default", "aten.gelu.default", "aten.relu.default",
              "aten.sigmoid.default", "aten.mean.dim", "aten.sum.dim_IntList", "aten._softmax.default",
              "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.transpose.int",
              "aten.permute.default", "aten.t.default", "aten.expand.default", "aten.cat.default",
              "aten.split.Tensor", "aten.slice.Tensor", "aten._to_copy.default"]
    assert [w for w in wanted if w not in ATEN_RULES] == []


def test_only_entries_with_arithmetic_make_a_region_worth_a_kernel():
    assert ATEN_RULES["aten.mm.default"].computes and ATEN_RULES["aten.silu.default"].computes
    assert not ATEN_RULES["aten.view.default"].computes and not ATEN_RULES["aten.clone.default"].computes
    assert not ATEN_RULES["aten.expand.default"].computes


def test_an_entry_is_registered_once():
    from mdsl.torch.aten import rule

    with pytest.raises(ValueError, match="already"):
        rule("aten.mm.default", ("matmul",))(lambda args, kwargs: None)
