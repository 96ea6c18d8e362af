"""A plan cache entry is served only as it was verified: any change to a stored plan (its graphs, their
attributes, the evidence, the flags, the digest) is caught, reported once, deleted and searched again;
a change whose digest is written to match is caught by the recheck (claims, a finite-field test); stored
costs, derived data, are re-priced by this mdsl's cost model rather than trusted; an entry that is not a small regular file is never read whole."""
from __future__ import annotations

import functools
import json
import math
import os
import shutil
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mdsl
from mdsl import Tensor, f16
from mdsl.search import cache as cache_module
from mdsl.search.cache import PlanCache
from mdsl.search.engine import cached_plan, optimize
from mdsl.search.cost import estimate, same_cost
from mdsl.search.plan import Plan, content_digest, recheck
from tests.search.small_plans import CONFIG, two_guided


@mdsl.kernel
def scaled_linear(x: Tensor[2, 256, f16], y: Tensor[2, 256, f16], w: Tensor[256, 192, f16]):
    return (mdsl.rms_norm(x) / y) @ w


GRAPH = scaled_linear.graph
LOOKUP = dict(generators=[two_guided])
_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                           HealthCheck.function_scoped_fixture])


class Entry(str):
    """An entry's text, shown by its length (hypothesis prints its examples' arguments)."""

    def __repr__(self) -> str:
        return f"<entry text, {len(self)} characters>"


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> str:
    """The text of a real entry: a guided search's fused plan (rms_norm, div, matmul in one block graph),
    verified by the default verifier, with two alternatives (the runner-up and the original)."""
    cache = PlanCache(tmp_path_factory.mktemp("plans"))
    optimize(GRAPH, CONFIG, cache=cache, **LOOKUP)
    key = cache.key(GRAPH, CONFIG, searcher=_searcher())
    return Entry(cache.path(key).read_text())


def _searcher() -> dict:
    return {"generators": ["tests.search.small_plans.two_guided"], "verifier": "default"}


def _cache(tmp_path, text: str) -> tuple:
    cache = PlanCache(tmp_path / "cache")
    path = cache.path(cache.key(GRAPH, CONFIG, searcher=_searcher()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return cache, path


def _refused(cache: PlanCache, path, match: str = "") -> str:
    """Load the entry: it must not be served, must be reported by exactly one warning (containing
    `match`) and must be gone. Returns the warning's text."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        served = cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP)
    assert served is None
    (warning,) = [str(w.message) for w in caught]
    assert f"ignoring the plan cache entry {path}" in warning and match in warning, warning
    assert not os.path.lexists(path)
    return warning


def _chosen_nodes(data: dict) -> list:
    return data["plan"]["chosen"]["graph"]["nodes"][0]["body"]["nodes"]


def _with_digest(data: dict) -> str:
    """The entry with its digest written to match its (changed) plan: a forgery, or a faulty writer."""
    data["digest"] = content_digest(data["plan"])
    return Entry(json.dumps(data))


def test_the_stored_entry_is_served(stored, tmp_path):
    cache, path = _cache(tmp_path, stored)
    plan = cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP)
    assert plan is not None and plan.cache_path == str(path)
    assert [n["op"] for n in _chosen_nodes(json.loads(stored))] == ["rms_norm", "div", "matmul", "accum"]
    assert recheck(plan, seed=1) is None


@pytest.mark.timeout(60)
def test_a_div_edited_into_a_mul_is_not_served_and_the_entry_is_searched_again(stored, tmp_path):
    """The reproduction: the chosen graph's div becomes a mul in the stored JSON."""
    data = json.loads(stored)
    _chosen_nodes(data)[1]["op"] = "mul"
    cache, path = _cache(tmp_path, json.dumps(data))
    _refused(cache, path, "content digest")
    cache, path = _cache(tmp_path, _with_digest(data))
    _refused(cache, path, "the chosen mugraph fails a re-check")
    # optimize searches again (no second warning: the entry is gone) and stores a plan that is served
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = optimize(GRAPH, CONFIG, cache=cache, **LOOKUP)
    assert [n.op for n in again.graph.nodes[0].body.nodes][1] == "div"
    assert cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP) == again


# ---------------------------------------------------------------------------------------------
# any change at all: the digest

def _leaves(value, path=()):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list) and value:
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))
    else:
        yield path


def _get(data, path):
    for step in path:
        data = data[step]
    return data


def _different(draw, old):
    """A JSON value other than `old` (never equal as JSON: 1 and 1.0 print differently, so both count)."""
    if isinstance(old, bool):
        return draw(st.sampled_from([not old, int(old), str(old).lower(), None]))
    if isinstance(old, (int, float)):
        new = draw(st.one_of(st.integers(-3, 3), st.sampled_from([0.5, -1.0, 1e-5, 1e-6, 2.0, 1e30]),
                             st.sampled_from(["nan", "inf", None, True])))
        return new if json.dumps(new) != json.dumps(old) else old + 1
    if isinstance(old, str):
        new = draw(st.sampled_from(["mul", "add", "sub", "div", "exp", "accum_max", "f32", "bf16", "", "0" * 64]))
        return new if new != old else old + "x"
    return draw(st.sampled_from([v for v in (0, "", [], {}) if json.dumps(v) != json.dumps(old)]))


@st.composite
def edits(draw, text: str):
    """(description, edited entry text): one leaf of the entry replaced, one key dropped or one list
    element dropped or repeated, anywhere (graphs, attributes such as eps, evidence, flags, the digest)."""
    data = json.loads(text)
    leaf = draw(st.sampled_from(sorted(_leaves(data), key=repr)))
    parent, last = _get(data, leaf[:-1]), leaf[-1]
    kind = draw(st.sampled_from(["replace", "drop", "repeat"]))
    if kind == "replace" or (kind == "repeat" and not isinstance(parent, list)):
        parent[last] = _different(draw, parent[last])
    elif kind == "drop":
        del parent[last]
    else:
        parent.insert(last, parent[last])
    return f"{kind} {'/'.join(map(str, leaf))}", Entry(json.dumps(data))


@_SETTINGS
@given(data=st.data())
def test_no_edited_entry_is_ever_served(stored, tmp_path_factory, data):
    what, text = data.draw(edits(stored))
    cache, path = _cache(tmp_path_factory.mktemp("edited"), text)
    _refused(cache, path)


# ---------------------------------------------------------------------------------------------
# changes whose digest matches: the recheck

_BINARY = ("add", "sub", "mul", "div")


def _graph_nodes(data: dict) -> list:
    """(candidate name, node dict) of every node of the stored candidates' graphs, block graphs included."""
    plan = data["plan"]
    candidates = [("chosen", plan["chosen"])] + [(f"alternative {i}", c) for i, c in enumerate(plan["alternatives"], 1)]
    out = []
    for name, candidate in candidates:
        stack = list(candidate["graph"]["nodes"])
        while stack:
            node = stack.pop()
            out.append((name, node))
            stack.extend((node.get("body") or {}).get("nodes", []))
    return out


@st.composite
def forgeries(draw, text: str):
    """A stored plan changed in what it computes or claims, with a digest that matches: an op swapped
    for another binary op, a scalar attribute (eps) changed, or evidence that no verification backs."""
    data = json.loads(text)
    plan = data["plan"]
    kind = draw(st.sampled_from(["op", "attribute", "evidence"]))
    if kind == "op":
        name, node = draw(st.sampled_from([(c, n) for c, n in _graph_nodes(data) if n["op"] in _BINARY]))
        new = draw(st.sampled_from([op for op in _BINARY if op != node["op"]]))
        what = f"{name}: {node['op']} -> {new}"
        node["op"] = new
    elif kind == "attribute":
        name, node = draw(st.sampled_from([(c, n) for c, n in _graph_nodes(data) if "eps" in n.get("attrs", {})]))
        new = draw(st.sampled_from([1e-5, 1e-3, 0.0, 2e-6, 0.5]))
        what = f"{name}: {node['op']} eps {node['attrs']['eps']} -> {new}"
        node["attrs"]["eps"] = new
    else:
        index = draw(st.integers(0, len(plan["alternatives"])))
        candidate = [plan["chosen"], *plan["alternatives"]][index]
        field, value = draw(st.sampled_from([("equivalent", False), ("equivalent", "true"), ("equivalent", 1),
                                             ("finite_field_tests", 0), ("false_pass_probability", 1.5),
                                             ("false_pass_probability", "nan"), ("false_pass_probability", -0.1)]))
        if candidate["graph"] == plan["original"] and field != "equivalent":
            index, candidate = 0, plan["chosen"]   # the original needs no verification: its claims do not matter
        what = f"candidate {index}: evidence {field} -> {value!r}"
        candidate["evidence"][field] = value
    return what, _with_digest(data)


@_SETTINGS
@given(data=st.data())
def test_no_forged_entry_is_ever_served(stored, tmp_path_factory, monkeypatch, data):
    # the recheck's randomness fixed, so that the outcome is a function of the forgery (a wrong graph
    # passes one finite-field test with probability about its degree over q, ~1e-4 here: not flaky)
    monkeypatch.setattr(cache_module, "recheck", functools.partial(recheck, seed=7))
    what, text = data.draw(forgeries(stored))
    cache, path = _cache(tmp_path_factory.mktemp("forged"), text)
    _refused(cache, path)


def test_an_entry_marked_not_equivalent_is_never_served_as_verified(stored, tmp_path):
    data = json.loads(stored)
    data["plan"]["chosen"]["evidence"]["equivalent"] = False
    cache, path = _cache(tmp_path, _with_digest(data))
    _refused(cache, path, "the chosen mugraph is marked not equivalent")


def test_a_wrong_graph_claiming_to_be_the_original_is_not_served(stored, tmp_path):
    """The original program needs no verification; a changed graph under its evidence gets none."""
    data = json.loads(stored)
    alternative = data["plan"]["alternatives"][-1]
    assert alternative["graph"] == data["plan"]["original"]
    node = next(n for n in alternative["graph"]["nodes"] if n["op"] == "div")
    node["op"] = "mul"
    cache, path = _cache(tmp_path, _with_digest(data))
    _refused(cache, path, "alternative 2 claims 0 finite-field test(s)")


def test_an_entry_whose_times_another_python_rounded_is_served(stored, tmp_path):
    """A plan's estimated times as another Python sums them (3.12's sum() of floats compensates its
    rounding, 3.11's does not): the last bit of each candidate's time differs from this Python's estimate,
    and the entry is still the same plan, re-checked and served where it was carried."""
    data = json.loads(stored)
    for candidate in [data["plan"]["chosen"], *data["plan"]["alternatives"]]:
        candidate["cost"]["seconds"] = math.nextafter(candidate["cost"]["seconds"], math.inf)
    cache, path = _cache(tmp_path, _with_digest(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP)
    assert plan is not None and plan.cache_path == str(path)


@pytest.mark.parametrize("field", ["seconds", "dram_bytes", "launches"])
def test_a_stored_cost_is_re_priced_not_trusted(stored, tmp_path, field):
    """Costs are what the cost model derives from each graph: one written by another cost model (or
    forged) is replaced by this mdsl's estimate, and the plan is served with the search's choice kept."""
    data = json.loads(stored)
    for candidate in [data["plan"]["chosen"], *data["plan"]["alternatives"]]:
        cost = candidate["cost"]
        cost[field] = cost[field] / 2 if field == "seconds" else cost[field] // 2
    cache, path = _cache(tmp_path, _with_digest(data))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP)
    assert plan is not None and plan.cache_path == str(path)
    original = json.loads(stored)["plan"]
    assert plan.graph == Plan.from_json(original).graph
    for c in (plan.chosen, *plan.alternatives):
        assert same_cost(c.cost, estimate(c.graph))
    assert plan.cost.seconds == pytest.approx(original["chosen"]["cost"]["seconds"], rel=1e-9)


def test_another_mdsl_versions_entry_is_not_served(stored, tmp_path):
    data = json.loads(stored)
    data["plan"]["mdsl_version"] = "0.0.1"
    cache, path = _cache(tmp_path, _with_digest(data))
    _refused(cache, path, "verified by mdsl 0.0.1")


def test_a_plan_this_process_checked_is_not_checked_again(stored, tmp_path, monkeypatch):
    cache, path = _cache(tmp_path, stored)
    assert cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP) is not None
    calls = []
    monkeypatch.setattr(cache_module, "recheck", lambda plan: calls.append(plan))
    assert cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP) is not None and calls == []
    data = json.loads(stored)
    data["plan"]["chosen"]["evidence"]["reason"] += " "   # other content: checked (the stub passes it)
    path.write_text(_with_digest(data))
    assert cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP) is not None and len(calls) == 1


# ---------------------------------------------------------------------------------------------
# bounded reads

@pytest.mark.timeout(20)
def test_a_link_to_an_endless_file_is_not_read(stored, tmp_path):
    cache, path = _cache(tmp_path, "")
    path.unlink()
    os.symlink("/dev/zero", path)
    _refused(cache, path, "not a regular file")
    assert os.path.exists("/dev/zero")


@pytest.mark.timeout(20)
def test_a_fifo_is_not_waited_on(stored, tmp_path):
    cache, path = _cache(tmp_path, "")
    path.unlink()
    os.mkfifo(path)
    _refused(cache, path, "not a regular file")


def test_an_entry_over_the_size_limit_is_not_read(stored, tmp_path, monkeypatch):
    monkeypatch.setattr(cache_module, "MAX_ENTRY_BYTES", len(stored) - 1)
    cache, path = _cache(tmp_path, stored)
    _refused(cache, path, f"more than a plan's limit of {len(stored) - 1}")


def test_a_link_to_a_missing_file_and_a_folder_are_refused(tmp_path):
    cache, path = _cache(tmp_path, "")
    path.unlink()
    os.symlink(tmp_path / "nowhere.json", path)
    _refused(cache, path, "a link to a missing file")
    path.mkdir()
    with pytest.warns(UserWarning, match="not a regular file"):
        assert cached_plan(GRAPH, CONFIG, cache=cache, **LOOKUP) is None
    assert path.is_dir()   # not deleted: a folder is not an entry mdsl wrote
    shutil.rmtree(path)


def test_the_entry_is_json_with_a_digest_of_its_plan(stored):
    data = json.loads(stored)
    assert set(data) == {"mdsl_plan_cache", "key", "plan", "digest"}
    assert data["digest"] == content_digest(data["plan"]) and len(data["digest"]) == 64


# ---------------------------------------------------------------------------------------------
# a change the field cannot see: the float tests of the re-check

def _softmax_shift_added(value):
    """A plan's JSON with its softmax's maximum added rather than subtracted (every `sub` whose second operand
    is a `max`'s output becomes an `add`): the same rational function, which overflows on large logits."""
    if isinstance(value, dict):
        if value.get("kind") == "block" or "nodes" in value:
            maxima = {out for n in value.get("nodes", []) if n.get("op") == "max" for out in _outputs(n)}
            for n in value.get("nodes", []):
                if n.get("op") == "sub" and _inputs(n)[1] in maxima:
                    n["op"] = "add"
        for v in value.values():
            _softmax_shift_added(v)
    elif isinstance(value, list):
        for v in value:
            _softmax_shift_added(v)
    return value


def _inputs(node: dict) -> list:
    return [v if isinstance(v, str) else v["name"] for v in node["inputs"]]


def _outputs(node: dict) -> list:
    return [v if isinstance(v, str) else v["name"] for v in node["outputs"]]


@pytest.mark.timeout(120)
def test_a_softmax_with_its_maximum_added_passes_the_field_and_fails_the_floats(tmp_path):
    from mdsl.search.plan import Plan
    from tests.search.small_plans import small_plan

    plan, _ = small_plan("gqa", tmp_path)
    data = plan.to_json()
    before = json.dumps(data, sort_keys=True)
    _softmax_shift_added(data["chosen"]["graph"])
    assert json.dumps(data, sort_keys=True) != before, "the chosen mugraph has no max-subtracting softmax"
    forged = Plan.from_json(data)
    problem = recheck(forged, seed=3)
    assert problem is not None and "float test" in problem, problem
    assert recheck(plan, seed=3) is None
