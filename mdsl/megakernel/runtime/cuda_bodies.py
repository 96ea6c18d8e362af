"""The megakernel's task bodies, generated: one rule per (fused) layer op in `CUDA_TASK_RULES` writes the
CUDA of the device task kinds the op's tasks lower to (the op's rule in task_plan.py's `DEVICE_RULES`), and
`generate_bodies` assembles them for a plan: the body functions and
`run_task` (the compute warps' dispatch on the task's kind).

A linear op's body (`LinearBody`) is generated whole: the input row it loads (the residual stream
rms-normalised by the op's norm weight, or an activation buffer), the weight matrices a column multiplies
(rows concatenated, as q|k|v, or paired, as gate and up), the dot products (gemv.cuh's `task_gemv`) and
the op's element-wise epilogue (mdsl.megakernel.modelgraph.epilogues: a thread graph of mdsl's operators), written by
the CUDA backend's rule table (each operator's `expr`, as in every superoptimized kernel) with each
result rounded to the model's dtype where PyTorch's eager ops round it; then the store (a buffer, or the
residual stream). Under tensor parallelism a residual op's partial products leave unrounded, and the
residual goes to rank 0's partial only: valid for epilogues additive in their inputs, which is checked.
Attention and the sampler call the runtime's own device functions (attention.cuh, sampling.cuh).
"""
from __future__ import annotations

from typing import Callable, Optional

import attrs

from mdsl.backend.cuda.loops import emit_chain   # each operator's `expr` (the backend's CUDA_RULES)
from mdsl.backend.cuda.rule_table import CUDA_RULES
from mdsl.backend.cuda.source import CodeWriter
from mdsl.errors import UnsupportedError
from mdsl.ir.graph import ThreadGraph
from mdsl.ir.rules import RuleTable
from mdsl.lowering.names import Namer
from mdsl.megakernel.modelgraph.epilogues import (EPILOGUE_RULES, has_addend, has_bias, has_residual, is_additive,
                                                  products, within)
from mdsl.megakernel.modelgraph.layers import LAYER_OPS
from mdsl.megakernel.runtime.task_plan import DEVICE_RULES, DeviceRule, Kind, KindOp, TaskPlan

@attrs.frozen
class Matrix:
    pointer: str    # C++: the matrix's first element (`w` is the task's layer's LayerWeights)
    rows: str       # C++ constant: its rows (output columns)


@attrs.frozen
class NormedStream:
    """The input row: a residual-stream layer (h or mid) through rms_norm with `norm`'s weights (or 1 + them:
    `unit_offset`, gemv.cuh's StreamRow1p)."""
    single: str     # the buffer (p.hs / p.mids)
    layer: str
    norm: str
    unit_offset: bool = False

    def declare(self) -> str:
        row = "StreamRow1p" if self.unit_offset else "StreamRow"
        return f"{row} row{{{{}}, {self.single}, {self.layer}, {self.norm}}};"

    def load(self) -> str:
        return "row.load();"

    def finish(self) -> str:
        return "row.finish(work, red);"


@attrs.frozen
class Activations:
    """The input row: `width` values of a layer's activation buffer."""
    row: str
    width: str

    def declare(self) -> str:
        return f"InputRow<{self.width}> row;"

    def load(self) -> str:
        return f"row.load({self.row});"

    def finish(self) -> str:
        return "row.finish(work);"


@attrs.frozen
class ToBuffer:
    row: str        # C++: the output row (element r is column r)

    def store(self, value: str) -> str:
        return f"{self.row}[r] = mdsl::from_float<T>({value});"


@attrs.frozen
class ToFloats:
    """A row of floats, each value rounded to the model's dtype (the router's logits)."""
    row: str

    def store(self, value: str) -> str:
        return f"{self.row}[r] = round_t({value});"


@attrs.frozen
class ToStream:
    """Column r of a residual-stream layer; the epilogue's residual is the layer it adds to."""
    single: str
    parts: str      # this rank's partials (tensor parallelism)
    relay: str      # the peers' flagged words (tensor parallelism)
    layer: str
    residual: Optional[str]   # C++: column r of the residual (h_at / mid_at), or None: the epilogue adds none

    def store(self, value: str) -> str:
        return f"stream_put(p, {self.single}, {self.parts}, {self.relay}, {self.layer}, r, {value}, tag);"

    def relay_rows(self) -> str:
        """Under tensor parallelism the tile then sums its rows over the ranks (residual.cuh's relay_rows)."""
        return f"relay_rows(p, {self.single}, {self.parts}, {self.relay}, {self.layer}, t.begin, t.end, tag);"


@attrs.frozen
class RowNorm:
    """After its rows, the tile that finishes last normalises the whole output row and adds the residual to it
    (residual.cuh's norm_residual_row: linear_norm_residual)."""
    norm: str           # C++: the norm weights
    unit_offset: bool   # the norm scales by 1 + weight
    counter: str        # C++: the layer's counter (after attention's)
    tiles: int          # the kind's tiles per layer

    def call(self, sink: "ToStream", residual: str) -> str:
        normed = "NormedRow1p<H>" if self.unit_offset else "NormedRow<H>"
        row = f"{sink.single} + (long long)({sink.layer}) * H"
        return (f"norm_residual_row<{normed}>(p, {row}, {self.norm}, [&](int r) {{ return {residual}; }}, "
                f"{self.counter}, {self.tiles}, tag, work, red);")


@attrs.frozen
class LinearBody:
    kind: Kind
    function: str
    k: str                  # C++ constant: the input row's width (the weights' columns)
    matrices: tuple         # Matrix
    paired: bool            # every column multiplies a row of each matrix (else: the rows are concatenated)
    source: object          # NormedStream | Activations (the LM head's: the row lmhead_task loads)
    sink: object            # ToBuffer | ToStream; None: only the epilogue, a functor `function` the runtime calls
    epilogue: ThreadGraph
    layered: bool = True    # the weights are the task's layer's (else: the kernel's own, as the LM head)
    biases: tuple = ()      # Matrix per matrix (one row each), concatenated as they are: the epilogue's `bias`
    rounded: bool = True    # each epilogue value rounded to T (eager ops), else only the stored result
    addend: Optional[str] = None   # C++: column r of the row the epilogue adds before the residual (its `addend`)
    prologue: tuple = ()           # C++ statements before the products (after `w`): the names the matrices use
    first_row: Optional[str] = None   # C++: the output column of the matrices' row 0 (None: column 0)
    after: Optional[str] = None    # C++: a statement once the task's columns are stored (the router's routing)
    row_norm: Optional[RowNorm] = None   # the output row normalised before its residual add (the residual: C++)
    row_residual: Optional[str] = None

    @property
    def products(self) -> int:
        return len(self.matrices) if self.paired else 1


def _layer_matrices(*fields_rows: tuple) -> tuple:
    return tuple(Matrix(f"w.{field}", rows) for field, rows in fields_rows)


# the residual stream's rows (task_plan.STREAMS): the buffer, this rank's partials and the peers' flagged words
# (tensor parallelism), and the device function reading column r of a layer's row (residual.cuh)
_STREAM_BUFFERS = {"h": ("p.hs", "p.h_parts", "p.h_relay", "h_at"),
                   "mid": ("p.mids", "p.mid_parts", "p.mid_relay", "mid_at")}


def stream_layer(offset: int) -> str:
    """C++: the layer index of a stream row `offset` layers past the task's (the serving bodies' too)."""
    return "t.layer" if offset == 0 else f"t.layer + {offset}"


def _stream_column(stream: Optional[tuple]) -> Optional[str]:
    """C++: column r of the residual-stream row `stream` ((family, layer offset); None: none)."""
    if stream is None:
        return None
    family, offset = stream
    return f"{_STREAM_BUFFERS[family][3]}(p, {stream_layer(offset)}, r)"


def _normed_stream(k: KindOp, norm: str) -> NormedStream:
    """The residual-stream row the kind normalises (its "row" stream: h, or mid) by the `norm` weights."""
    family, offset = k.stream("row")
    return NormedStream(_STREAM_BUFFERS[family][0], stream_layer(offset), norm, k.attr_dict.get("unit_offset", False))


def _norm_linear(k: KindOp, epilogue: ThreadGraph) -> LinearBody:
    return LinearBody(k.kind, "qkv_task", "H", _layer_matrices(("wq", "HQ * D"), ("wk", "HKV * D"), ("wv", "HKV * D")),
                      False, _normed_stream(k, "w.ln1"), ToBuffer("(p.qkvs + (long long)t.layer * QKV)"), epilogue)


def _norm_linear_bias(k: KindOp, epilogue: ThreadGraph) -> LinearBody:
    """Qwen2's q|k|v with its biases (LayerWeights' bq, bk, bv: the QKV_BIAS section), the bias added to the
    product in f32 and the sum rounded once, as transformers' addmm."""
    return attrs.evolve(_norm_linear(k, epilogue), rounded=False,
                        biases=_layer_matrices(("bq", "HQ * D"), ("bk", "HKV * D"), ("bv", "HKV * D")))


def _norm_gate_up(k: KindOp, epilogue: ThreadGraph) -> LinearBody:
    """act(gate) * up of a normalised row: the residual stream's mid (a sequential block) or h (a parallel
    block, whose attention normalises the same row)."""
    return LinearBody(k.kind, "gateup_task", "H", _layer_matrices(("wg", "I"), ("wu", "I")), True,
                      _normed_stream(k, "w.ln2"), ToBuffer("(p.acts + (long long)t.layer * I)"), epilogue)


def _projection(k: KindOp, epilogue: ThreadGraph) -> LinearBody:
    """The o-proj (OPROJ) or down-proj (DOWN) of linear, linear_residual and linear_add_residual: into the row of
    the residual stream the plan says (its "out" stream), the epilogue's residual and addend the rows it reads as
    those."""
    family, offset = k.stream("out")
    single, parts, relay, _ = _STREAM_BUFFERS[family]
    sink = ToStream(single, parts, relay, stream_layer(offset), _stream_column(k.stream("residual")))
    addend = _stream_column(k.stream("addend"))
    if k.kind is Kind.OPROJ:
        return LinearBody(k.kind, "oproj_task", "HQ * D", _layer_matrices(("wo", "H")), False,
                          Activations("(p.attns + (long long)t.layer * HQ * D)", "HQ * D"), sink, epilogue,
                          addend=addend)
    return LinearBody(k.kind, "down_task", "I", _layer_matrices(("wd", "H")), False,
                      Activations("(p.acts + (long long)t.layer * I)", "I"), sink, epilogue, addend=addend)


def _norm_moe_router(k: KindOp, epilogue: ThreadGraph) -> LinearBody:
    """ROUTER: the router's rows of the normalised row, its logits rounded to T; the tile that finishes last
    routes (moe.cuh's route_experts)."""
    return LinearBody(k.kind, "router_task", "H", _layer_matrices(("router", "MOE_E")), False,
                      _normed_stream(k, "w.ln2"), ToFloats("w.router_logits"), epilogue,
                      after="route_experts(p, t, tag);")


def _norm_moe_experts_residual(k: KindOp, epilogue: ThreadGraph) -> Optional[LinearBody]:
    """EXPERT_UP: act(gate) * up of the normalised row for the expert in the task's slot (its rows slot * MOE_I +
    row, the gate's and up's row `row` of that expert, found through the layer's expert table); EXPERT_DOWN is
    moe.cuh's expert_down_task (_KIND_CALLS)."""
    if k.kind is not Kind.EXPERT_UP:
        return None
    prologue = ("const int slot = t.begin / MOE_I, first = slot * MOE_I;",
                "const int expert = w.route_ids[slot];   // (the routing is complete: no early handover)",
                "const T* const gate = w.experts[expert];",
                "const T* const up = w.experts[MOE_E + expert];")
    return LinearBody(k.kind, "expert_up_task", "H", (Matrix("gate", "MOE_I"), Matrix("up", "MOE_I")), True,
                      _normed_stream(k, "w.ln2"), ToBuffer("w.expert_acts"), epilogue, prologue=prologue,
                      first_row="first")


def _expert_down_call(k: KindOp) -> str:
    """moe.cuh's expert_down_task into the kind's "out" row of the residual stream, adding its "residual" row."""
    family, offset = k.stream("out")
    return (f"expert_down_task(p, t, work, {_STREAM_BUFFERS[family][0]}, {stream_layer(offset)}, "
            f"[&](int r) {{ return {_stream_column(k.stream('residual'))}; }});")


# the kinds whose bodies are the runtime's own device functions with the kind's residual-stream rows: the call
_KIND_CALLS = {Kind.EXPERT_DOWN: _expert_down_call}


def _normed_projection(k: KindOp, epilogue: ThreadGraph) -> LinearBody:
    """linear_norm_residual's o-proj or down-proj: its tiles' raw rows into the residual stream's row, then the
    last tile's norm and residual add (RowNorm; the norm weights LayerWeights' pn_attn or pn_mlp: the ROW_NORM
    section)."""
    body = _projection(k, epilogue)
    oproj = k.kind is Kind.OPROJ
    return attrs.evolve(body, sink=attrs.evolve(body.sink, residual=None), row_residual=body.sink.residual,
                        row_norm=RowNorm("w.pn_attn" if oproj else "w.pn_mlp", k.attr_dict["unit_offset"],
                                         f"2 * t.layer + {0 if oproj else 1}", 0))


def _lm_head(k: KindOp, epilogue: ThreadGraph) -> Optional[LinearBody]:
    kind = k.kind
    if kind is Kind.SAMPLE:
        return None
    # sampling.cuh's lmhead_task loads the normalised row (the LM_HEAD_1P section's where it scales by 1 + weight)
    # and keeps the tile's best token; the logit is this epilogue's (a functor)
    return LinearBody(kind, "LmHeadLogit", "H", (Matrix("p.lm_head", "V"),), False,
                      NormedStream("p.hs", "L", "p.final_norm", k.attr_dict.get("unit_offset", False)), None, epilogue,
                      layered=False)


# the kinds whose bodies are the runtime's own device functions: the call, by kind
_RUNTIME_CALLS = {
    Kind.ATTN: "attention_task(p, t, ready, step, pos, work);",
    Kind.SAMPLE: "return sample_task(p, t, step, pos, red);",
}

def _no_sections(plan: TaskPlan) -> frozenset:
    return frozenset()


@attrs.frozen
class CudaTaskRule:
    """A device kind's body from a layer op: `body(kind_op, epilogue)` is its `LinearBody` (the plan's KindOp: the
    kind, the op, its attributes and residual-stream rows; the op's epilogue graph, or None where it has none),
    or None where the runtime's own function runs it. `sections(plan)`:
    the runtime's optional sections the body needs (kernel_source.SECTIONS), none for the decoders that
    need none, whose kernel stays the text it is without them."""

    body: Callable
    sections: Callable[[TaskPlan], frozenset] = _no_sections


#: every op that task_plan.DEVICE_RULES lowers to rows (a DeviceRule)
CUDA_TASK_RULES: RuleTable[CudaTaskRule] = RuleTable(
    "megakernel's CUDA task bodies", CudaTaskRule, "mdsl.megakernel.runtime.cuda_bodies (CUDA_TASK_RULES)",
    registry=LAYER_OPS, needs=lambda op: isinstance(DEVICE_RULES.get(op.name), DeviceRule))
for _op, _rule in {"norm_linear": _norm_linear, "norm_gate_up": _norm_gate_up, "linear": _projection,
                   "linear_residual": _projection, "linear_add_residual": _projection,
                   # attention.cuh's attention_task; the embedding's tasks are absorbed (sampling.cuh's sample_task
                   # writes the next step's row)
                   "rope_attention": lambda k, epilogue: None, "embedding": lambda k, epilogue: None,
                   "lm_head_argmax": _lm_head, "lm_head_sample": _lm_head}.items():
    CUDA_TASK_RULES.register(_op, CudaTaskRule(_rule))
CUDA_TASK_RULES.register("norm_linear_bias", CudaTaskRule(_norm_linear_bias, lambda plan: frozenset({"QKV_BIAS"})))
# a mixture of experts (the MOE section: LayerWeights' expert table and routing, moe.cuh)
for _op, _rule in {"norm_moe_router": _norm_moe_router, "norm_moe_experts_residual": _norm_moe_experts_residual}.items():
    CUDA_TASK_RULES.register(_op, CudaTaskRule(_rule, lambda plan: frozenset({"MOE"})))
# attention.cuh's attention_task over the last LAYER_WINDOW[layer] positions, where some layer's window is shorter
# than the KV cache, its scores soft-capped (SOFTCAP) where the op says so
CUDA_TASK_RULES.register("rope_scaled_attention", CudaTaskRule(
    lambda k, epilogue: None,
    lambda plan: frozenset({"WINDOW"} if plan.windows else ()) |
    frozenset({"SOFTCAP"} if plan.op_of(Kind.ATTN).attr_dict["softcap"] else ())))
# Gemma-2's: its GeGLU MLP (the gate/up body, its epilogue GELU's tanh approximation), the norms of the o-proj's and
# down-proj's output rows (the last tile's: ROW_NORM); its embedding's tasks are absorbed as the embedding's (the
# scale: runtime_sections' EMBED_SCALE)
CUDA_TASK_RULES.register("norm_geglu", CudaTaskRule(_norm_gate_up))
for _op, _rule in {"norm_1p_linear": _norm_linear, "lm_head_1p_argmax": _lm_head, "lm_head_1p_sample": _lm_head}.items():
    CUDA_TASK_RULES.register(_op, CudaTaskRule(_rule))
CUDA_TASK_RULES.register("linear_norm_residual", CudaTaskRule(_normed_projection, lambda plan: frozenset({"ROW_NORM"})))
CUDA_TASK_RULES.register("scaled_embedding", CudaTaskRule(lambda k, epilogue: None))


# ---------------------------------------------------------------------------------------------
# writing the code


def emit_epilogue(w: CodeWriter, graph: ThreadGraph, inputs: dict, *, rounded: bool) -> str:
    """The epilogue's statements, each value in an f32 register (rounded to T where `rounded`), from the C
    expressions of its inputs; returns the register holding its output. The operators' code is the CUDA
    backend's (`emit_chain`: each operator's `expr`, as in every superoptimized kernel)."""
    wrap = (lambda e: f"round_t({e})") if rounded else (lambda e: e)
    inside = within(graph)
    if inside:   # (a function PyTorch computes in one op: its values inside the op are not rounded)
        return _emit_within(w, graph, inputs, wrap, inside)
    reg = emit_chain(w, Namer(), graph, [inputs[v.name] for v in graph.inputs], wrap)
    return reg[graph.outputs[0].name]


def _emit_within(w: CodeWriter, graph: ThreadGraph, inputs: dict, wrap: Callable, inside: frozenset) -> str:
    """emit_chain's statements, the values `inside` one PyTorch op left unwrapped."""
    local, reg = Namer(), {}
    for var in graph.inputs:
        reg[var.name] = local(f"r_{var.name}")
        w(f"const float {reg[var.name]} = {wrap(inputs[var.name])};")
    for node in graph.nodes:
        expr = CUDA_RULES[node.op].expr(node, [reg[v.name] for v in node.inputs])
        reg[node.output.name] = local(f"r_{node.output.name}")
        w(f"const float {reg[node.output.name]} = {expr if node.output.name in inside else wrap(expr)};")
    return reg[graph.outputs[0].name]


def _starts(matrices: tuple) -> list:
    """C++: the first output column of each matrix whose rows are concatenated."""
    starts, first = [], "0"
    for m in matrices:
        starts.append(first)
        first = m.rows if first == "0" else f"{first} + {m.rows}"
    return starts


def _concatenated(matrices: tuple, at: Callable[[str, str], str]) -> str:
    """C++: what output column r reads of the matrix (or vector) whose rows hold it, the matrices'
    rows concatenated: `at(pointer, row)` of its row, as a nested choice over them."""
    choice = None
    for start, m in reversed(list(zip(_starts(matrices), matrices))):
        row = at(m.pointer, f"(r - ({start}))" if start != "0" else "r")
        end = m.rows if start == "0" else f"{start} + {m.rows}"
        choice = row if choice is None else f"r < ({end}) ? {row} : {choice}"
    return choice


def _row_expression(body: LinearBody) -> str:
    """C++: row j of output column r's weights (a pointer), as a nested choice over the matrices."""
    if body.paired:
        pointer = body.matrices[-1].pointer
        for j in reversed(range(len(body.matrices) - 1)):
            pointer = f"(j == {j} ? {body.matrices[j].pointer} : {pointer})"
        row = "r" if body.first_row is None else f"(r - {body.first_row})"
        return f"{pointer} + (long long){row} * ({body.k})"
    return _concatenated(body.matrices, lambda pointer, row: f"{pointer} + (long long){row} * ({body.k})")


def _epilogue_inputs(body: LinearBody, world: int) -> dict:
    names = products(body.epilogue)
    if len(names) != body.products:
        raise UnsupportedError(f"the {body.kind.name} epilogue reads {len(names)} product(s), its body makes "
                               f"{body.products}", hint="one product per matrix a column multiplies")
    inputs = {name: f"acc[{j}]" for j, name in enumerate(names)}
    if has_bias(body.epilogue) != bool(body.biases):
        raise UnsupportedError(f"the {body.kind.name} epilogue reads {'a' if has_bias(body.epilogue) else 'no'} bias; "
                               f"its body has {len(body.biases)} bias vector(s)", hint="one bias per matrix, or none")
    if body.biases:
        inputs["bias"] = f"mdsl::to_float({_concatenated(body.biases, lambda pointer, row: f'{pointer}[{row}]')})"
    if has_residual(body.epilogue):
        if not isinstance(body.sink, ToStream) or body.sink.residual is None:
            raise UnsupportedError(f"the {body.kind.name} epilogue reads a residual its output is not added to")
        inputs["residual"] = body.sink.residual if world == 1 else f"(p.rank == 0 ? {body.sink.residual} : 0.0f)"
    if has_addend(body.epilogue) != (body.addend is not None):
        raise UnsupportedError(f"the {body.kind.name} epilogue reads {'an' if has_addend(body.epilogue) else 'no'} "
                               f"addend; its body has {'one' if body.addend else 'none'}")
    if body.addend is not None:   # (read in the epilogue; the residual alone is staged in shared memory)
        inputs["addend"] = body.addend if world == 1 else f"(p.rank == 0 ? {body.addend} : 0.0f)"
    return inputs


def _partial(body: LinearBody, world: int) -> bool:
    """Whether the body's results are this rank's partial sums (the residual stream under tensor
    parallelism), which its readers add up and round."""
    return world > 1 and isinstance(body.sink, ToStream)


def residual_columns(plan: TaskPlan) -> int:
    """The widest tile of the kinds whose epilogue adds a residual: the most columns whose residual a
    task keeps in shared memory (after the input row: source.shared_memory_bytes)."""
    kinds = {b.kind for b in linear_bodies(plan) if b.sink is not None and has_residual(b.epilogue)}
    return max((t.end - t.begin for t in plan.tasks if t.kind in kinds), default=0)


def _write_residual_declaration(w: CodeWriter, body: LinearBody, world: int) -> dict:
    """The registers of the task's columns' residual, RESIDUAL_PER a thread (loaded with the input row:
    _write_residual_load), and its place in shared memory. Returns the epilogue's inputs, the residual read
    from shared memory (residual_row, written once the input row is loaded: _write_residual_store)."""
    inputs = _epilogue_inputs(body, world)
    if "residual" not in inputs:
        return inputs
    w("float residual_value[RESIDUAL_PER];")
    w("float* residual_row = work + RESIDUAL_OFFSET;   // after the input row")
    return {**inputs, "residual": "residual_row[r - t.begin]", "residual_load": inputs["residual"]}


def _write_residual_load(w: CodeWriter, residual: str) -> None:
    """The residual loaded into registers just before the input row, in the row's half that runs once the
    task's inputs are complete (both in flight at once): the epilogue, which runs one column after
    another, read each with a dependent global round trip."""
    w("#pragma unroll")
    with w.block("for (int c = 0; c < RESIDUAL_PER; ++c)"):
        w("const int r = t.begin + int(threadIdx.x) + c * NT;")
        w(f"residual_value[c] = r < t.end ? {residual} : 0.0f;")


def _write_residual_store(w: CodeWriter) -> None:
    w("#pragma unroll")
    with w.block("for (int c = 0; c < RESIDUAL_PER; ++c)"):
        w("const int r = t.begin + int(threadIdx.x) + c * NT;")
        w("if (r < t.end) residual_row[r - t.begin] = residual_value[c];")
    w("compute_sync();")


def _sums_like_ranks(body: LinearBody, world: int, rank_sums: int) -> bool:
    """Whether one GPU's body sums its products as `rank_sums` ranks would (generate_bodies)."""
    return world == 1 and rank_sums > 1 and isinstance(body.sink, ToStream)


def _write_rank_slices(w: CodeWriter, body: LinearBody, rank_sums: int, inputs: dict) -> None:
    """Slices 1 .. rank_sums - 1 of a residual kind's products, each as rank k would compute its partial (the
    same weight chunks in each lane, in the same order, reduced by the same shuffles), added in rank order to
    the running sum slice 0 left in shared memory; the last one stores the rounded sum, as the relay does."""
    slice_k = f"({body.k}) / {rank_sums}"
    later = {**inputs, **{name: "0.0f" for name in ("residual", "addend") if name in inputs}}   # (slice 0's)
    for k in range(1, rank_sums):
        w(f"gemv<{slice_k}, {body.products}>(t.begin, t.end, work + {k} * ({slice_k}),")
        w.depth += 4
        w(f"[&](int r, int j) {{ return {_row_expression(body)} + {k} * ({slice_k}); }},")
        with w.block("[&](int r, const float* acc)"):
            value = emit_epilogue(w, body.epilogue, later, rounded=False)
            w(f"const float sum = rank_sums_row[r - t.begin] + {value};")
            w(body.sink.store("sum") if k == rank_sums - 1 else "rank_sums_row[r - t.begin] = sum;")
        w.lines[-1] += ");"
        w.depth -= 4


def write_linear_body(w: CodeWriter, body: LinearBody, world: int, rank_sums: int = 1) -> None:
    """The body of a linear kind. `rank_sums` (one GPU only): the o-proj's and down-proj's products summed as
    that many tensor-parallel ranks sum them, each rank's slice of the input row and weight rows reduced
    alone, the residual in the first, the slices' sums added in rank order from 0 and rounded once, so that
    one GPU computes the bits of that many (with the same attention splits)."""
    partial = _partial(body, world)
    by_ranks = _sums_like_ranks(body, world, rank_sums)
    if body.row_norm is not None and by_ranks:
        raise UnsupportedError(f"the {body.kind.name} rows normalised before their residual add are not summed as "
                               "ranks sum them", hint="leave MegakernelOptions.rank_sums at 1 for this model")
    if partial and not is_additive(body.epilogue):
        raise UnsupportedError(f"the {body.kind.name} epilogue is not additive in its inputs, so tensor-parallel "
                               "ranks cannot apply it to their partial products",
                               hint="run the model on one GPU, or give the op an epilogue of sums")
    w("", f"// {body.kind.name}: generated from the epilogue", *(f"//   {line}" for line in str(body.epilogue).splitlines()))
    if body.sink is None:   # the LM head: its logit functor, for the runtime's lmhead_task
        with w.block(f"struct {body.function}"):
            with w.block("__device__ __forceinline__ float operator()(const float* acc) const"):
                value = emit_epilogue(w, body.epilogue, _epilogue_inputs(body, world), rounded=body.rounded)
                w(f"return {value};")
        w.lines[-1] += ";"
        return
    with w.block(f"__device__ void {body.function}(const Params& p, const Task& t, int ready, float* work, "
                 "float* red, unsigned tag)"):
        if body.layered:
            w("const LayerWeights& w = p.layers[t.layer];")
        for line in body.prologue:
            w(line)
        inputs = _write_residual_declaration(w, body, world)
        residual = inputs.pop("residual_load", None)
        w(body.source.declare())
        k = f"({body.k}) / {rank_sums}" if by_ranks else body.k
        if by_ranks:
            w(f"static_assert(({body.k}) % ({rank_sums} * VEC) == 0, \"rank_sums slices are whole 16-byte chunks\");")
            w("float* rank_sums_row = work + RESIDUAL_OFFSET + RESIDUAL_COLUMNS;   // (after the residual)")
        w(f"task_gemv<{k}, {body.products}>(t, ready, work, [&](int r, int j) {{ return {_row_expression(body)}; }},")
        w.depth += 4
        with w.block("[&](int r, const float* acc)"):
            value = emit_epilogue(w, body.epilogue, inputs, rounded=body.rounded and not partial and not by_ranks)
            w(f"rank_sums_row[r - t.begin] = 0.0f + {value};" if by_ranks else body.sink.store(value))
        w.lines[-1] += ","
        # the input row in two halves (task_gemv issues the first weight loads between them: WEIGHTS_FIRST,
        # or before the first, which runs once the task's inputs are complete: an early task), the residual
        # loaded with the first and stored with the second
        if residual is None:
            w(f"[&] {{ {body.source.load()} }},")
        else:
            with w.block("[&]"):
                _write_residual_load(w, residual)
                w(body.source.load())
            w.lines[-1] += ","
        with w.block("[&]"):
            w(body.source.finish())
            if "residual" in inputs:
                _write_residual_store(w)
            w("mark(p, 0);   // the input row is in shared memory")
        w.lines[-1] += ");"
        w.depth -= 4
        if by_ranks:
            _write_rank_slices(w, body, rank_sums, inputs)
        if partial:
            w(body.sink.relay_rows())
        if body.row_norm is not None:
            if world > 1:
                raise UnsupportedError(f"the {body.kind.name} rows normalised before their residual add are not "
                                       "implemented under tensor parallelism", hint="run the model on one GPU")
            w(body.row_norm.call(body.sink, body.row_residual))
        if body.after is not None:
            w(body.after)


def write_dispatch(w: CodeWriter, calls: list) -> None:
    """run_task: the task's body by its kind; false where the body says its events are not to be
    signalled (the sampler, after the last step)."""
    w("", "// the compute warps' task: its body by kind")
    with w.block("__device__ __forceinline__ bool run_task(const Params& p, const Task& t, int ready, float* work, "
                 "float* red, long long step, long long pos, int k)"):
        with w.block("switch (t.kind)"):
            for kind, call in calls:
                w(f"case KIND_{kind.name}: {call}" + ("" if call.startswith("return") else " return true;"))
            w("default: __trap();   // a task table the generated bodies do not know")
        w("return false;")


def linear_bodies(plan: TaskPlan) -> list:
    """The plan's linear kinds' bodies, by the rule of each kind's layer op in `CUDA_TASK_RULES`."""
    bodies = []
    for k in plan.kind_ops:
        rule = CUDA_TASK_RULES.get(k.op)
        if rule is None:
            raise UnsupportedError(f"the layer op {k.op} has no CUDA task body rule (its {k.kind.name} tasks)")
        epilogue = EPILOGUE_RULES.get(k.op)
        body = rule.body(k, epilogue.graph(k.attr_dict) if epilogue is not None else None)
        if body is not None:
            bodies.append(body)
    return bodies


def runtime_sections(plan: TaskPlan) -> frozenset:
    """The runtime's optional sections the plan's task bodies need (their rules' `sections`; NORM_1P where a fused
    norm scales by 1 + weight, its `unit_offset`, and LM_HEAD_1P where the LM head's does; EMBED_SCALE where the
    sampler scales the embedding row it writes: a scaled_embedding, whose tasks have no kind)."""
    sections = frozenset().union(*(CUDA_TASK_RULES.lookup(k.op).sections(plan) for k in plan.kind_ops))
    if any(k.attr_dict.get("unit_offset") for k in plan.kind_ops):
        sections |= {"NORM_1P"}
    if any(k.kind is Kind.LMHEAD and k.attr_dict.get("unit_offset") for k in plan.kind_ops):
        sections |= {"LM_HEAD_1P"}
    if plan.embedding_scale:
        sections |= {"EMBED_SCALE"}
    return sections


def _tiles_per_layer(plan: TaskPlan, kind: Kind) -> int:
    """The tiles of a kind in one layer (every layer has as many)."""
    counts = {}
    for t in plan.tasks:
        if t.kind is kind:
            counts[t.layer] = counts.get(t.layer, 0) + 1
    assert len(set(counts.values())) == 1, counts
    return next(iter(counts.values()))


def generate_bodies(plan: TaskPlan, rank_sums: int = 1) -> str:
    """The CUDA of the plan's task bodies and run_task (inserted into device.cu). `rank_sums`:
    on one GPU, the residual kinds sum their products as that many ranks would (write_linear_body)."""
    w = CodeWriter()
    w("// ---- task bodies, generated by mdsl/megakernel/runtime/cuda_bodies.py from the plan's layer ops")
    bodies = [attrs.evolve(b, row_norm=attrs.evolve(b.row_norm, tiles=_tiles_per_layer(plan, b.kind)))
              if b.row_norm is not None else b for b in linear_bodies(plan)]
    for body in bodies:
        write_linear_body(w, body, plan.world, rank_sums)
    calls = []
    linear = {body.kind: body for body in bodies}
    for kind in (k.kind for k in plan.kind_ops):
        if kind in linear:
            body = linear[kind]
            # the body's `tag`: the relay's, step + 1 (0: the host's reset)
            calls.append((kind, f"{body.function}(p, t, ready, work, red, unsigned(step + 1));" if body.sink is not None
                          else f"lmhead_task(p, t, ready, pos, k - LM_FIRST, work, red, {body.function}{{}});"))
        elif kind in _RUNTIME_CALLS:
            calls.append((kind, _RUNTIME_CALLS[kind]))
        elif kind in _KIND_CALLS:
            calls.append((kind, _KIND_CALLS[kind](plan.op_of(kind))))
        else:
            raise UnsupportedError(f"no task body for the {kind.name} tasks of {plan.op_of(kind).op}")
    write_dispatch(w, calls)
    return w.text()
