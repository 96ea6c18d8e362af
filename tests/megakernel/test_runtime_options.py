"""MegakernelOptions: frozen, validated where it is made (an OptionError naming the field, with a hint), and
the defaults chosen from the world size in one place (`for_world`)."""
import attrs
import pytest

from mdsl.errors import MdslError
from mdsl.megakernel.runtime.megakernel_options import MAX_SPLITS, WEIGHT_KIND_NAMES, MegakernelOptions, OptionError


def test_the_options_are_few_and_frozen():
    assert len(attrs.fields(MegakernelOptions)) <= 12
    options = MegakernelOptions()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        options.rank_sums = 2
    assert hash(options) == hash(MegakernelOptions()) and options == MegakernelOptions()


def test_the_world_size_chooses_a_ranks_defaults():
    """What a None field becomes: one GPU issues no weight loads with a task's input row and has no second
    pass; a rank issues its whole first pass with the row, and its early o-proj has a second pass in flight."""
    one, two = MegakernelOptions().for_world(1), MegakernelOptions().for_world(2)
    assert (one.weights_first, one.second_pass_kinds) == (0.0, ())
    assert (two.weights_first, two.second_pass_kinds) == (1.0, ("oproj",)) == \
        (MegakernelOptions().for_world(4).weights_first, MegakernelOptions().for_world(4).second_pass_kinds)
    # what is given stays; what the plan or the device chooses stays None
    given = MegakernelOptions(weights_first=0.5, second_pass_kinds=()).for_world(2)
    assert (given.weights_first, given.second_pass_kinds) == (0.5, ())
    assert (two.workers, two.attention_splits, two.attention_min_chunk, two.attention_preload) == (None,) * 4
    # a rank's defaults given to one GPU (benchmarks/decode.py --rank-of) stay a rank's
    assert two.for_world(1) == two


def test_kind_names_are_taken_alone_or_as_a_list():
    assert MegakernelOptions(second_pass_kinds="oproj").second_pass_kinds == ("oproj",)
    assert MegakernelOptions(second_pass_kinds=["qkv", "down"]).second_pass_kinds == ("qkv", "down")
    assert MegakernelOptions(second_pass_kinds=WEIGHT_KIND_NAMES).second_pass_kinds == WEIGHT_KIND_NAMES


@pytest.mark.parametrize(("field", "value", "hint"), [
    ("workers", 0, "positive number of worker blocks"), ("workers", 2.5, "positive number"),
    ("attention_splits", 0, f"1 to {MAX_SPLITS} splits per kv head"),
    ("attention_splits", MAX_SPLITS + 1, "one warp's lanes"),
    ("attention_min_chunk", 0, "positions per attention split"), ("attention_min_chunk", 5000, "1 to 4096"),
    ("attention_preload", "yes", "True, False, or None"),
    ("weights_first", 2, "0 (none) to 1 (all)"), ("weights_first", True, "0 (none) to 1 (all)"),
    ("second_pass_kinds", ("attn",), "qkv, oproj, gateup, down, lmhead"),
    ("second_pass_kinds", 3, "qkv, oproj, gateup, down, lmhead"),
    ("rank_sums", 9, "the ranks (2 to 8)"), ("rank_sums", 0, "the ranks (2 to 8)")])
def test_a_bad_value_is_refused_naming_its_field(field, value, hint):
    with pytest.raises(OptionError, match=rf"MegakernelOptions\.{field} ") as info:
        MegakernelOptions(**{field: value})
    assert isinstance(info.value, MdslError) and hint in info.value.hint
    with pytest.raises(OptionError, match=rf"MegakernelOptions\.{field} "):   # evolve validates as well
        attrs.evolve(MegakernelOptions(), **{field: value})


def test_rank_sums_is_one_gpus():
    assert MegakernelOptions(rank_sums=2).for_world(1).rank_sums == 2
    with pytest.raises(OptionError, match="rank_sums 2 under tensor parallelism") as info:
        MegakernelOptions(rank_sums=2).for_world(2)
    assert "leave it 1" in info.value.hint
