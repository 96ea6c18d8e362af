"""Model graphs: `@mdsl.model` traces a step function over named weights into a DAG of layer ops.

    @mdsl.model
    def tiny(m, cfg):
        x = m.embedding(m.weight("embed", [cfg.vocab, cfg.hidden]))
        ...
        return m.argmax(logits)

    graph = tiny.trace(cfg)          # a ModelGraph
    print(graph)                     # its textual form; graph.to_dot() for Graphviz

Values are `mdsl.ir.types.Var`s: weights (read-only, named as in the checkpoint), state (the token
history and the KV caches, updated in place across steps) and activations (one row per step).
"""
from __future__ import annotations

import functools
import hashlib
import sys
from typing import Any, Callable, Optional

import attrs
from attrs import field

from mdsl.errors import MdslError, ParseError, ShapeError, SourceLoc, TraceError
from mdsl.frontend.source import caller_loc, frame_loc
from mdsl.ir.dtypes import DType, f32, i32
from mdsl.ir.text import _comment_loc, _loc_comment, _Parser, format_attrs
from mdsl.ir.types import TensorType, Var
from mdsl.megakernel.modelgraph.layers import get_layer_op

TOKENS = "tokens"   # the name of the token-history state every model graph has


@attrs.frozen(cache_hash=True)
class LayerNode:
    """One layer op application; `attrs` are (name, value) pairs in the op's declared order."""

    op: str
    inputs: tuple = field(converter=tuple)
    outputs: tuple = field(converter=tuple)
    attrs: tuple = field(default=(), converter=tuple)
    loc: Optional[SourceLoc] = field(default=None, eq=False, hash=False)

    @property
    def opdef(self):
        return get_layer_op(self.op)

    @property
    def attr_dict(self) -> dict:
        return dict(self.attrs)

    @property
    def output(self) -> Var:
        return self.outputs[0]


@attrs.frozen(cache_hash=True)
class ModelGraph:
    """weights: read-only Vars; states: Vars updated in place across steps (the first is `tokens`);
    nodes in execution order; outputs: (logits, next token)."""

    name: str
    weights: tuple = field(converter=tuple)
    states: tuple = field(converter=tuple)
    nodes: tuple = field(converter=tuple)
    outputs: tuple = field(converter=tuple)

    @property
    def logits(self) -> Var:
        return self.outputs[0]

    @property
    def token(self) -> Var:
        return self.outputs[1]

    @property
    def max_positions(self) -> int:
        return self.states[0].shape[0]

    def weight(self, name: str) -> Var:
        for w in self.weights:
            if w.name == name:
                return w
        raise KeyError(name)

    @property
    def key(self) -> str:
        """Equal for graphs that differ only in activation names and source locations."""
        names = {v.name: v.name for v in (*self.weights, *self.states)}

        def ref(v: Var):
            return (names[v.name], str(v.type))

        body = []
        for n in self.nodes:
            ins = tuple(ref(v) for v in n.inputs)
            for v in n.outputs:
                names[v.name] = f"v{len(names)}"
            body.append((n.op, ins, tuple(ref(v) for v in n.outputs), tuple((k, repr(v)) for k, v in n.attrs)))
        text = repr((tuple(map(str, self.weights)), tuple(map(str, self.states)), tuple(body),
                     tuple(ref(v) for v in self.outputs)))
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def __str__(self) -> str:
        return print_model_graph(self)

    def to_dot(self) -> str:
        return model_graph_to_dot(self)

    def weight_bytes(self) -> int:
        return sum(w.type.nbytes for w in self.weights)


def _decl(v: Var) -> str:
    return f"{v}: {v.type}"


def print_model_graph(g: ModelGraph) -> str:
    lines = [f"model {g.name} {{"]
    lines += [f"  weight {_decl(w)}" for w in g.weights]
    lines += [f"  state {_decl(s)}" for s in g.states]
    for n in g.nodes:
        outs = ", ".join(map(_decl, n.outputs))
        line = f"  {outs} = {n.op}({', '.join(map(str, n.inputs))}) {format_attrs(n.attrs)}".rstrip()
        lines.append(line + _loc_comment(n.loc))
    lines.append(f"  return {', '.join(map(str, g.outputs))}")
    lines.append("}")
    return "\n".join(lines)


def parse_model_graph(text: str) -> ModelGraph:
    """Read a model graph's textual form (`print_model_graph`; print -> parse -> print gives the same
    text). Each node's output types are checked against its op's rule; an error points at the line."""
    return _ModelParser(text).model_graph()


class _ModelParser(_Parser):
    """The kernel-graph text's tokens and pieces (mdsl.ir.text), with the model graph's statements."""

    def model_graph(self) -> ModelGraph:
        self.expect("model")
        name = self.expect_kind("ident", "a model name").text
        self.expect("{")
        self.end_line()
        scope: dict = {}
        weights, states = self.declarations("weight", scope), self.declarations("state", scope)
        if not states or states[0].name != TOKENS or states[0].dtype is not i32 or states[0].type.rank != 1:
            raise self.error(f"the token history 'state %{TOKENS}: i32[max_positions]' first")
        nodes = []
        while not self.at("return"):
            if self.peek().kind != "var":
                raise self.error("a node (%name: type = op(...)) or 'return'")
            nodes.append(self.layer_node(scope))
        return_tok = self.expect("return")
        outputs = [self.use(scope)]
        while self.accept(","):
            outputs.append(self.use(scope))
        if len(outputs) != 2:
            raise ParseError(f"a model returns (logits, token), got {len(outputs)} value(s)", loc=self.loc(return_tok))
        self.end_line()
        self.expect("}")
        self.end_line()
        if self.peek().kind != "eof":
            raise self.error("end of text")
        return ModelGraph(name, weights, states, nodes, outputs)

    def declarations(self, word: str, scope: dict) -> list:
        found = []
        while self.accept(word):
            found.append(self.define(scope, self.declaration()))
            self.end_line()
        return found

    def layer_node(self, scope: dict) -> LayerNode:
        start = self.peek()
        outputs = [self.declaration()]
        while self.accept(","):
            outputs.append(self.declaration())
        self.expect("=", "',' or '='")
        op_tok = self.expect_kind("ident", "a layer op name")
        try:
            op = get_layer_op(op_tok.text)
        except MdslError as e:
            raise ParseError(e.message, loc=self.loc(op_tok), hint=e.hint) from None
        inputs = self.seq(lambda: self.use(scope), ")", opened="(")
        pairs = self.attributes(op, op_tok)
        loc = _comment_loc(self.end_line())
        try:
            types = op.infer_types(tuple(v.type for v in inputs), pairs)
        except MdslError as e:
            raise ParseError(e.message, loc=self.loc(op_tok), hint=e.hint) from None
        declared = tuple(v.type for _, v in outputs)
        if types != declared:
            raise ParseError(f"{op.name} gives {', '.join(map(str, types))}, declared {', '.join(map(str, declared))}",
                             loc=self.loc(start))
        return LayerNode(op.name, inputs, [self.define(scope, out) for out in outputs], pairs, loc)


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def model_graph_to_dot(g: ModelGraph) -> str:
    """Weights are grey notes, state cylinders, ops boxes; edges carry the activation's name and type."""
    lines = ["digraph model {", '  node [fontname="monospace"]; edge [fontname="monospace"];',
             f"  label={_quote('model ' + g.name)}; labelloc=t;"]
    vertex: dict = {}
    for i, w in enumerate(g.weights):
        vertex[w.name] = f"w{i}"
        lines.append(f"  w{i} [shape=note, style=filled, fillcolor=gray90, label={_quote(_decl(w))}];")
    for i, s in enumerate(g.states):
        vertex[s.name] = f"s{i}"
        lines.append(f"  s{i} [shape=cylinder, label={_quote(_decl(s))}];")
    for i, n in enumerate(g.nodes):
        lines.append(f"  n{i} [shape=box, label={_quote((n.op + ' ' + format_attrs(n.attrs)).rstrip())}];")
        for v in n.inputs:
            label = "" if v.name not in vertex or vertex[v.name][0] != "n" else f" [label={_quote(_decl(v))}]"
            lines.append(f"  {vertex[v.name]} -> n{i}{label};")
        for k in n.opdef.state_inputs:
            lines.append(f"  n{i} -> {vertex[n.inputs[k].name]} [style=dashed, label=\"update\"];")
        for v in n.outputs:
            vertex[v.name] = f"n{i}"
    for j, v in enumerate(g.outputs):
        lines.append(f"  o{j} [shape=ellipse, label={_quote('out ' + _decl(v))}];")
        lines.append(f"  {vertex[v.name]} -> o{j};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# tracing

def _step_function_loc() -> Optional[SourceLoc]:
    """The line of the step function (a user's or a built-in one) that applied the op."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    return frame_loc(frame) if frame is not None else None


class ModelBuilder:
    """The `m` a step function receives: declares weights and state, and applies layer ops."""

    def __init__(self, name: str, dtype: DType, max_positions: int):
        self.name = name
        self.dtype = dtype
        self.max_positions = int(max_positions)
        self.weights: dict = {}
        self.states: dict = {}
        self.nodes: list = []
        self._count = 0
        self.tokens = self.state(TOKENS, [self.max_positions], i32)

    # declarations ---------------------------------------------------------------------------

    def weight(self, name: str, shape, dtype: Optional[DType] = None) -> Var:
        """A named weight; declaring a name twice with the same type returns the same value (tied weights)."""
        var = Var(name, TensorType(tuple(shape), dtype or self.dtype))
        known = self.weights.get(name)
        if known is not None and known != var:
            raise ShapeError(f"weight {name} declared as {known.type} and again as {var.type}", loc=caller_loc())
        self.weights[name] = var
        return var

    def state(self, name: str, shape, dtype: Optional[DType] = None) -> Var:
        if name in self.states or name in self.weights:
            raise TraceError(f"state {name} declared twice", loc=caller_loc(), hint="give each cache its own name")
        var = Var(name, TensorType(tuple(shape), dtype or f32))
        self.states[name] = var
        return var

    def kv_cache(self, layer: int, kv_heads: int, head_dim: int):
        """The key and value caches of one layer, [max_positions, kv_heads, head_dim] each."""
        shape = [self.max_positions, kv_heads, head_dim]
        return self.state(f"k_cache.{layer}", shape), self.state(f"v_cache.{layer}", shape)

    # layer ops ------------------------------------------------------------------------------

    def apply(self, op: str, *inputs: Var, **attrs_given: Any) -> tuple:
        loc = _step_function_loc()
        for i, v in enumerate(inputs):
            if not isinstance(v, Var):
                raise TraceError(f"{op}: operand {i} is a {type(v).__name__}, not a traced value", loc=loc,
                                 hint="pass values made by m.weight, m.state or another layer op")
        opdef = get_layer_op(op)
        try:
            pairs = opdef.normalize_attrs(attrs_given)
            types = opdef.infer_types(tuple(v.type for v in inputs), pairs)
        except MdslError as e:
            raise e.with_loc(loc)
        outs = []
        for t in types:
            outs.append(Var(f"t{self._count}", t))
            self._count += 1
        self.nodes.append(LayerNode(op, inputs, outs, pairs, loc))
        return tuple(outs)

    def embedding(self, table: Var) -> Var:
        return self.apply("embedding", self.tokens, table)[0]

    def rms_norm(self, x: Var, weight: Var, eps: float) -> Var:
        return self.apply("rms_norm", x, weight, eps=eps)[0]

    def linear(self, x: Var, *weights: Var) -> Var:
        return self.apply("linear", x, *weights)[0]

    def add_bias(self, x: Var, *biases: Var) -> Var:
        """x + concat(biases): a (fused) projection's biases, one vector per weight, in the weights' order."""
        return self.apply("add_bias", x, *biases)[0]

    def head_rms_norm(self, qkv: Var, q_weight: Var, k_weight: Var, *, eps: float, **heads: int) -> Var:
        return self.apply("head_rms_norm", qkv, q_weight, k_weight, eps=eps, **heads)[0]

    def rope(self, qkv: Var, **attrs_given: Any) -> Var:
        return self.apply("rope", qkv, **attrs_given)[0]

    def attention(self, qkv: Var, k_cache: Var, v_cache: Var, **heads: int) -> Var:
        return self.apply("attention", qkv, k_cache, v_cache, **heads)[0]

    def scaled_attention(self, qkv: Var, k_cache: Var, v_cache: Var, *, window: int = 0, scale: float = 0.0,
                         softcap: float = 0.0, **heads: int) -> Var:
        """Attention over the last `window` positions (0: all), scores scaled by `scale` (0: 1/sqrt(head_dim))
        and soft-capped by `softcap` (0: none)."""
        return self.apply("scaled_attention", qkv, k_cache, v_cache, window=window, scale=scale, softcap=softcap,
                          **heads)[0]

    def act_mul(self, gate_up: Var, act: str = "silu") -> Var:
        """act(gate) * up over the gate|up row; `act` names an element-wise operator (mdsl.ir.ops)."""
        return self.apply("act_mul", gate_up, act=act)[0]

    def rms_norm_1p(self, x: Var, weight: Var, eps: float) -> Var:
        """rms_norm scaled by (1 + weight) (Gemma's RMSNorm)."""
        return self.apply("rms_norm_1p", x, weight, eps=eps)[0]

    def geglu(self, gate_up: Var) -> Var:
        """gelu_tanh(gate) * up over the gate|up row."""
        return self.apply("geglu", gate_up)[0]

    def scale(self, x: Var, factor: float) -> Var:
        return self.apply("scale", x, factor=factor)[0]

    def softcap(self, x: Var, cap: float) -> Var:
        """cap * tanh(x / cap)."""
        return self.apply("softcap", x, cap=cap)[0]

    def gated_scale(self, x: Var, gate: Var, act: str = "sigmoid") -> Var:
        """act(gate) * x, `gate` a row of one value (a shared expert's gate: sigmoid of a [1, 1] linear)."""
        return self.apply("gated_scale", x, gate, act=act)[0]

    def moe_router(self, x: Var, router: Var, *, top_k: int, norm_topk_prob: bool = False) -> Var:
        """The routing row [1, E]: the top_k of softmax(x @ router.T), zero elsewhere."""
        return self.apply("moe_router", x, router, top_k=top_k, norm_topk_prob=norm_topk_prob)[0]

    def moe_experts(self, x: Var, routing: Var, *weights: Var, act: str = "silu") -> Var:
        """The picked experts' gated MLPs weighted by the routing row; weights: E gate, E up, E down."""
        return self.apply("moe_experts", x, routing, *weights, act=act)[0]

    def add(self, x: Var, y: Var) -> Var:
        return self.apply("add", x, y)[0]

    def argmax(self, logits: Var) -> Var:
        return self.apply("argmax", logits, self.tokens)[0]

    def sample(self, logits: Var, *, temperature: float, top_p: float = 1.0, seed: int = 0) -> Var:
        return self.apply("sample", logits, self.tokens, temperature=temperature, top_p=top_p, seed=seed)[0]

    def build(self, logits: Var, token: Var) -> ModelGraph:
        return ModelGraph(self.name, tuple(self.weights.values()), tuple(self.states.values()), tuple(self.nodes),
                          (logits, token))


class ModelFunction:
    """What `@mdsl.model` returns. `fn(m, config)` must return `(logits, token)`; `trace(config)`
    gives the ModelGraph (cached per config)."""

    def __init__(self, fn: Callable, name: Optional[str] = None):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.name = name or fn.__name__
        self._graphs: dict = {}

    def trace(self, config: Any, *, dtype: Optional[DType] = None, max_positions: Optional[int] = None) -> ModelGraph:
        dtype = dtype or getattr(config, "dtype", f32)
        positions = max_positions or getattr(config, "max_positions", None)
        if positions is None:
            raise TraceError(f"model {self.name}: the number of positions is unknown",
                             hint="pass max_positions=..., or a config with a max_positions attribute")
        try:
            cache_key = (config, dtype, positions)
            graph = self._graphs.get(cache_key)
        except TypeError:  # an unhashable config is traced every time
            cache_key, graph = None, None
        if graph is None:
            m = ModelBuilder(self.name, dtype, positions)
            result = self.fn(m, config)
            if not (isinstance(result, tuple) and len(result) == 2 and all(isinstance(v, Var) for v in result)):
                raise TraceError(f"model {self.name} must return (logits, token), got {type(result).__name__}",
                                 hint="end the step function with `return logits, m.argmax(logits)`")
            logits, token = result
            if logits.type.rank != 2 or not token.dtype is i32:
                raise TraceError(f"model {self.name} returned ({logits.type}, {token.type}); expected "
                                 "(f32[1, vocab], i32[1])")
            graph = m.build(logits, token)
            if cache_key is not None:
                self._graphs[cache_key] = graph
        return graph

    def __repr__(self) -> str:
        return f"<mdsl.model {self.name}>"


def model(fn: Optional[Callable] = None, *, name: Optional[str] = None):
    """Decorator: `@mdsl.model` or `@mdsl.model(name=...)`."""
    if fn is None:
        return lambda f: ModelFunction(f, name)
    return ModelFunction(fn, name)
