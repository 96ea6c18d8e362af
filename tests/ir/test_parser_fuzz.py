"""Fuzzing the IR readers: whatever text or JSON they are given, `mdsl.ir.text.parse` and
`mdsl.ir.serialize.loads` either return a valid graph or raise an `MdslError` (never another exception).

The inputs are valid graphs (a fixed pool: the hand-written examples and random graphs from
tests/strategies.py, drawn once so that the examples are spent on mutations), printed or serialized and then mutated:
tokens deleted, repeated, swapped or replaced (numbers by extreme ones), lines repeated, the text
cut short, bodies nested deeper; JSON values replaced, deleted, wrapped and nested; plus arbitrary
text and token soup. A kernel graph that is accepted must survive printing and serializing unchanged.
"""
import copy
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mdsl.errors import MdslError
from mdsl.ir.graph import KernelGraph
from mdsl.ir.serialize import from_json, loads, to_json
from mdsl.ir.text import parse, print_graph
from tests.strategies import example_graphs, kernel_graphs

FUZZ = settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))

_TOKEN = re.compile(r"\s+|%?[A-Za-z_][A-Za-z0-9_.]*|-?\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|.", re.DOTALL)
_NUMBER = re.compile(r"-?\d")

NUMBERS = ["0", "-1", "1", "-0", "3", "31", "33", "65535", "65536", "2147483647", "2147483648", "4294967296",
           "9223372036854775808", "9" * 40, "9" * 5000, "1e400", "-1e400", "1e-320", "nan", "inf", "-inf",
           "0.5", "-0.0", "true", "false", "-"]
TOKENS = ["[", "]", "{", "}", "(", ")", ",", ":", "=", "-", "#", "# @ f.py:1", "# @ /dev/zero:1:0-1", "\n", " ",
          "%x", "%zz", "%", "kernel", "block", "thread", "custom", "fused", "in", "out", "return", "imap", "fmap",
          "omap", "grid", "threads", "forloop", "f16", "bf16", "f32", "i32", "f64", "exp", "accum", "accum_rms",
          "matmul", "rms_norm", "clamp", "cast", "split", "reshape", "{eps=nan}", "{dim=99}", "{min=nan, max=1.0}",
          "{value=1e400}", "{shape=[0, 4]}", "{sizes=[]}", "{perm=[[0]]}", "{dtype=f64}", "é", "\u2028", "\x00",
          "block(grid=[0], threads=32, forloop=1) {", "thread {", "f32[0]", "f32[-1]", "f16[65536, 65536]"]
NESTING = ["  %n{k}: f32[4] = fused() thread {{", "  %n{k}: f32[4] = custom() block(grid=[1], threads=32, forloop=1) {{"]


def _check(read, source) -> None:
    """`read(source)` returns a graph or raises an MdslError; an accepted kernel graph round-trips."""
    try:
        graph = read(source)
    except MdslError as e:
        str(e)   # the message renders (it may name any file as the source location)
        return
    if isinstance(graph, KernelGraph):
        assert parse(print_graph(graph)) == graph
        assert from_json(json.loads(json.dumps(to_json(graph)))) == graph


@pytest.fixture(scope="module")
def pool() -> list:
    """The graphs that are mutated: the hand-written examples and 40 random ones (the same every run)."""
    graphs = list(example_graphs().values())

    @settings(max_examples=40, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(kernel_graphs(max_nodes=5))
    def collect(graph):
        graphs.append(graph)

    collect()
    return graphs


# ---------------------------------------------------------------------------------------------
# text


@st.composite
def mutated_texts(draw, pool: list) -> str:
    # positions come from a seeded Random: hypothesis's own integers favour 0, the first token
    rnd = draw(st.randoms(use_true_random=False))
    tokens = _TOKEN.findall(print_graph(rnd.choice(pool)))
    for _ in range(rnd.randint(1, 4)):
        kind = rnd.choice(["delete", "insert", "replace", "number", "number", "number", "swap", "repeat_lines",
                           "truncate", "nest"])
        i = rnd.randrange(max(len(tokens), 1))
        if kind == "delete":
            del tokens[i:i + rnd.randint(1, 3)]
        elif kind == "insert":
            tokens.insert(i, rnd.choice(TOKENS + NUMBERS + tokens))
        elif kind == "replace" and tokens:
            tokens[i] = rnd.choice(TOKENS + NUMBERS)
        elif kind == "number":
            numbers = [k for k, t in enumerate(tokens) if _NUMBER.match(t)]
            if numbers:
                tokens[rnd.choice(numbers)] = rnd.choice(NUMBERS + [str(rnd.randint(-2**70, 2**70))])
        elif kind == "swap" and tokens:
            j = rnd.randrange(len(tokens))
            tokens[i], tokens[j] = tokens[j], tokens[i]
        elif kind in ("repeat_lines", "nest"):
            lines = "".join(tokens).split("\n")
            at = rnd.randint(0, len(lines))
            if kind == "nest":
                pattern = rnd.choice(NESTING)
                extra = [pattern.format(k=k) for k in range(rnd.choice([1, 2, 3, 40]))]
                extra += ["}"] * rnd.randint(0, len(extra))
            else:
                extra = lines[at:at + rnd.randint(1, 4)] * rnd.randint(2, 4)
            tokens = _TOKEN.findall("\n".join(lines[:at] + extra + lines[at:]))
        elif kind == "truncate":
            tokens = tokens[:i]
    return "".join(tokens)


@FUZZ
@given(data=st.data())
def test_mutated_text_raises_only_mdsl_errors(pool, data):
    _check(parse, data.draw(mutated_texts(pool)))


@FUZZ
@given(st.lists(st.sampled_from(TOKENS + NUMBERS) | st.text(max_size=3), max_size=40).map(" ".join)
       | st.text(max_size=200))
def test_arbitrary_text_raises_only_mdsl_errors(text):
    _check(parse, text)


# ---------------------------------------------------------------------------------------------
# JSON

JSON_VALUES = ([0, -1, 1, 2**31, 2**63, 10**40, 1.5, -0.0, 1e308, float("nan"), float("inf"), "nan",
                               "inf", "-inf", "", "x", "f16", "f64", "exp", "custom", "fused", "kernel", "block",
                               "thread", None, True, False, [], {}, [0], [None, None, None, None], {"kind": "thread"}])


def _paths(value, path=()) -> list:
    """Every place in a JSON document: (container path, key) pairs."""
    out = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        out.append(path + (key,))
        out += _paths(child, path + (key,))
    return out


def _parent(data, path):
    for key in path[:-1]:
        data = data[key]
    return data


@st.composite
def mutated_json(draw, pool: list) -> str:
    rnd = draw(st.randoms(use_true_random=False))
    data = to_json(rnd.choice(pool))
    for _ in range(rnd.randint(1, 4)):
        paths = _paths(data)
        if not paths:
            break
        path = rnd.choice(paths)
        parent, key = _parent(data, path), path[-1]
        kind = rnd.choice(["replace", "replace", "delete", "wrap", "nest", "duplicate", "number", "number"])
        if kind == "replace":
            parent[key] = copy.deepcopy(rnd.choice(JSON_VALUES))   # the samples are shared; the document is edited
        elif kind == "delete":
            del parent[key]
        elif kind == "wrap":
            parent[key] = rnd.choice([[parent[key]], {"kind": parent[key]}, {"body": parent[key]}])
        elif kind == "nest":
            value = parent[key]
            for _ in range(rnd.choice([2, 50, 300])):
                value = [value]
            parent[key] = value
        elif kind == "duplicate" and isinstance(parent, list):
            parent.insert(key, copy.deepcopy(parent[key]))
        elif kind == "number":
            numbers = [p for p in paths if type(_parent(data, p)[p[-1]]) in (int, float)]
            if numbers:
                p = rnd.choice(numbers)
                _parent(data, p)[p[-1]] = rnd.choice([0, -1, 2**31, 2**63, 10**5000, 1e-320, 0.5, float("nan"),
                                                      rnd.randint(-2**70, 2**70)])
    try:
        text = json.dumps(data)
    except (RecursionError, ValueError):  # nested past what json writes, or an int too long to print
        text = json.dumps(to_json(pool[0]))
    if rnd.random() < 0.3:  # and the text itself: cut short, a character changed
        i = rnd.randint(0, len(text))
        tail = text[i + rnd.randint(0, 2):] if rnd.random() < 0.5 else ""
        text = text[:i] + rnd.choice(["", "[" * 5000, "9" * 5000, "}", '"', "\\u0000", "NaN"]) + tail
    return text


@FUZZ
@given(data=st.data())
def test_mutated_json_raises_only_mdsl_errors(pool, data):
    _check(loads, data.draw(mutated_json(pool)))


@settings(FUZZ, max_examples=300)
@given(st.recursive(st.sampled_from(JSON_VALUES) | st.text(max_size=4) | st.integers(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
                        st.sampled_from(["mdsl_ir", "kind", "name", "inputs", "nodes", "outputs", "shape", "dtype",
                                         "op", "attrs", "body", "grid", "threads", "forloop", "var", "imap", "fmap",
                                         "omap", "loc", "file", "line"]), inner, max_size=6), max_leaves=30))
def test_arbitrary_json_data_raises_only_mdsl_errors(data):
    _check(from_json, data if not isinstance(data, dict) else {"mdsl_ir": 1, **data})
