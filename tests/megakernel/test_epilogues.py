"""The fused linear ops' epilogues (thread graphs of mdsl operators) against the unfused layer ops'
references, their eager rounding, and the additivity tensor parallelism relies on."""
import numpy as np
import pytest

from mdsl.errors import ValidationError
from mdsl.ir.dtypes import bf16, round_to_dtype
from mdsl.megakernel.modelgraph.epilogues import (PRODUCT, RESIDUAL_ADD, epilogue_of, evaluate, gated, has_residual,
                                                   is_additive, products)
from mdsl.megakernel.modelgraph.layers import get_layer_op
from mdsl.megakernel.modelgraph.model_config import ACTIVATIONS

RNG = np.random.default_rng(7)


def _row(n=64):
    return (RNG.standard_normal((1, n)) * 3).astype(np.float32)


@pytest.mark.parametrize("act", sorted(set(ACTIVATIONS.values())))
def test_the_gated_epilogue_is_the_act_mul_reference(act):
    gu = _row(128)
    (expected,) = get_layer_op("act_mul").reference([gu], {"act": act}, None)
    got = evaluate(epilogue_of("norm_gate_up", {"eps": 1e-6, "act": act}), {"gate": gu[:, :64], "up": gu[:, 64:]})
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_the_residual_epilogue_is_the_add_reference():
    r, p = _row(), _row()
    (expected,) = get_layer_op("add").reference([r, p], {}, None)
    np.testing.assert_array_equal(evaluate(epilogue_of("linear_residual", {}), {"product": p, "residual": r}), expected)
    assert products(RESIDUAL_ADD) == ("product",) and has_residual(RESIDUAL_ADD)


def test_eager_evaluation_rounds_every_result():
    g, u = _row(), _row()

    def r(x):
        return round_to_dtype(np.asarray(x, np.float32), bf16).astype(np.float32)

    gate, up = r(g), r(u)
    act = r(gate / (1 + np.exp(-gate)))
    np.testing.assert_allclose(evaluate(gated("silu"), {"gate": g, "up": u}, bf16), r(act * up), rtol=0, atol=0)
    # unrounded, the same chain differs somewhere in its low bits
    assert not np.array_equal(evaluate(gated("silu"), {"gate": g, "up": u}), r(act * up))


def test_additivity():
    assert is_additive(RESIDUAL_ADD) and is_additive(PRODUCT)
    assert not is_additive(gated("silu")) and not is_additive(gated("relu"))


def test_every_fused_linear_op_has_an_epilogue_and_others_say_so():
    for op in ("norm_linear", "norm_gate_up", "linear_residual", "lm_head_argmax", "lm_head_sample"):
        assert epilogue_of(op, {"act": "silu", "eps": 1e-6}).outputs
    with pytest.raises(ValidationError, match="rope_attention has no epilogue"):
        epilogue_of("rope_attention", {})


def test_gemmas_epilogues_round_only_what_pytorch_rounds():
    """GeGLU's GELU (tanh approximation) and the LM head's soft-cap are written with mdsl's operators; evaluated
    eagerly, the values inside one PyTorch op (`within`) stay in f32 and the op's result is rounded once."""
    from mdsl.megakernel.modelgraph.layers import gelu_tanh, softcap_row

    gate, up = _row(4096), _row(4096)
    geglu = epilogue_of("norm_geglu", {"eps": 1e-6, "unit_offset": True})
    np.testing.assert_allclose(evaluate(geglu, {"gate": gate, "up": up}), gelu_tanh(gate) * up, rtol=1e-5, atol=1e-5)
    g, u = round_to_dtype(gate, bf16), round_to_dtype(up, bf16)
    want = round_to_dtype(round_to_dtype(gelu_tanh(g), bf16) * u, bf16)
    got = evaluate(geglu, {"gate": gate, "up": up}, bf16)
    # the same bits but in the far negative tail, where PyTorch's 0.5 x (1 + tanh) cancels (x sigmoid does not)
    body = np.abs(g) < 3
    assert np.array_equal(got[body], want[body]) and np.allclose(got, want, rtol=0, atol=1e-3)
    capped = epilogue_of("lm_head_1p_argmax", {"eps": 1e-6, "unit_offset": True, "softcap": 3.0})
    np.testing.assert_allclose(evaluate(capped, {"product": gate}), softcap_row(gate, {"cap": 3.0}), atol=1e-5)
    assert epilogue_of("lm_head_1p_argmax", {"eps": 1e-6, "unit_offset": True, "softcap": 0.0}) == PRODUCT
