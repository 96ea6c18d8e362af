"""The aten -> mdsl mapping table (mdsl.torch.aten): every entry names an aten overload torch has and
registry operators mdsl has, and the operators the backend is asked to compute are in it."""
from __future__ import annotations

import pytest

#: the table's entries, named here so that collecting the tests imports no torch (the first test checks that
#: they are the table's)
ENTRIES = ("aten._softmax.default", "aten._to_copy.default", "aten._unsafe_view.default", "aten.add.Tensor",
           "aten.addmm.default", "aten.alias.default", "aten.amax.default", "aten.bmm.default", "aten.cat.default",
           "aten.clone.default", "aten.detach.default", "aten.div.Tensor", "aten.exp.default",
           "aten.expand.default", "aten.gelu.default", "aten.matmul.default", "aten.mean.dim", "aten.mm.default",
           "aten.mul.Tensor", "aten.neg.default", "aten.permute.default", "aten.pow.Tensor_Scalar",
           "aten.reciprocal.default", "aten.relu.default", "aten.reshape.default", "aten.rsqrt.default",
           "aten.rsub.Scalar", "aten.select.int", "aten.sigmoid.default", "aten.silu.default",
           "aten.slice.Tensor", "aten.split.Tensor", "aten.split_with_sizes.default", "aten.sqrt.default",
           "aten.squeeze.dim", "aten.sub.Tensor", "aten.sum.dim_IntList", "aten.t.default", "aten.transpose.int",
           "aten.unsqueeze.default", "aten.view.default")


@pytest.fixture
def aten(torch):
    import mdsl.torch.aten

    return mdsl.torch.aten


def _overload(torch, name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def test_the_entries_named_here_are_the_tables(aten):
    assert sorted(aten.ATEN_RULES) == sorted(ENTRIES), "name a new entry in ENTRIES too"


@pytest.mark.parametrize("name", ENTRIES)
def test_every_entry_names_an_aten_overload_and_registered_operators(torch, aten, name):
    from mdsl.ir.ops import OPS

    entry = aten.ATEN_RULES[name]
    assert isinstance(entry, aten.AtenRule) and entry.aten == name
    overload = _overload(torch, name)
    assert aten.aten_name(overload) == name
    unknown = [op for op in entry.ops if op not in OPS]
    assert not unknown, f"{name} names operators the registry does not have: {unknown}"
    assert entry.doc, f"{name} has no description"


def test_the_table_covers_the_operators_of_transformer_blocks(aten):
    wanted = ["aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.matmul.default",
              "aten.add.Tensor", "aten.sub.Tensor", "aten.mul.Tensor", "aten.div.Tensor", "aten.neg.default",
              "aten.exp.default", "aten.rsqrt.default", "aten.sqrt.default", "aten.reciprocal.default",
              "aten.pow.Tensor_Scalar", "aten.silu.default", "aten.gelu.default", "aten.relu.default",
              "aten.sigmoid.default", "aten.mean.dim", "aten.sum.dim_IntList", "aten._softmax.default",
              "aten.view.default", "aten.reshape.default", "aten._unsafe_view.default", "aten.transpose.int",
              "aten.permute.default", "aten.t.default", "aten.expand.default", "aten.cat.default",
              "aten.split.Tensor", "aten.slice.Tensor", "aten._to_copy.default"]
    assert [w for w in wanted if w not in aten.ATEN_RULES] == []


def test_only_entries_with_arithmetic_make_a_region_worth_a_kernel(aten):
    rules = aten.ATEN_RULES
    assert rules["aten.mm.default"].computes and rules["aten.silu.default"].computes
    assert not rules["aten.view.default"].computes and not rules["aten.clone.default"].computes
    assert not rules["aten.expand.default"].computes


def test_an_entry_is_registered_once(aten):
    with pytest.raises(ValueError, match="already"):
        aten.rule("aten.mm.default", ("matmul",))(lambda args, kwargs: None)
