"""The skinny loop as C++: the loop the lowering plans (mdsl.lowering.skinny, which says which block graphs
qualify and describes the load schedule) as a call of `mdsl::Skinny` (prelude), the warps' partial sums
met in shared memory into the accumulators' tiles, and the row accumulators' folds into theirs."""
from __future__ import annotations

from mdsl.backend.cuda.loops import FOLDS, emit_chain
from mdsl.backend.cuda.rule_table import CUDA_RULES
from mdsl.backend.cuda.source import element_ctype, offset
from mdsl.ir.graph import BlockGraph
from mdsl.ir.skinny import MAX_ROWS
from mdsl.lowering.kernel import FINALIZED
from mdsl.lowering.skinny import ROW_FOLDS, SkinnyPlan, straddles


def _fold(node):
    """The fold of a row accumulator of X (mdsl.lowering.skinny.ROW_FOLDS)."""
    return FOLDS[ROW_FOLDS[node.op]]


def emit_skinny(b, bg: BlockGraph, skinny: SkinnyPlan, parts: dict, scratch_offset: int) -> None:
    """The loop: each warp's streamed part, its partial sums met in shared memory into the accumulators'
    tiles (and the row accumulators' folds into theirs, then finalized by their own rules)."""
    plan = skinny.shape
    w, warps = b.w, bg.threads // 32
    mats, kw, k = len(plan.weights), skinny.warps_along_k(warps), plan.k
    x_part = parts[plan.x]
    x_ptr, w_ptrs = x_part.ptr, [parts[name].ptr for name in plan.weights]
    element = element_ctype(skinny.element)
    ldw = parts[plan.weights[0]].strides[0]
    cls = (f"mdsl::Skinny<{element}, {plan.m}, {plan.n}, {k}, {x_part.strides[0]}, {ldw}, {warps}, {mats}, "
           f"{plan.columns_per_load()}{_tail_arguments(skinny, not plan.transposed and straddles(plan, ldw))}>")
    w(f"// skinny loop: X %{plan.x} ({plan.m} rows) times {mats} weight(s) streamed from device memory, "
      f"K = {k} split over {kw} warp(s) along K")
    for i in plan.rows:
        CUDA_RULES[bg.nodes[i].op].init(b, bg.nodes[i])
    part = b.namer("s_skinny_part")
    w(f"float* const {part} = reinterpret_cast<float*>(smem + {scratch_offset});")
    w(f"const {element}* const skinny_w[{mats}] = {{{', '.join(w_ptrs)}}};",
      f"{cls}::Acc skinny_acc;")
    if plan.vectors:   # the prologue's vectors along K, loaded beside X
        v_ptrs = ", ".join(parts[v].ptr for v in plan.vectors)
        w(f"const {element}* const skinny_v[{len(plan.vectors)}] = {{{v_ptrs}}};")
    if skinny.overlap:   # no global memory touched above: the previous kernel may still be running
        w(f"{cls}::prefetch_start(skinny_w);   // changes no value: may run before the previous kernel ends",
          "mdsl::wait_for_previous_kernel();   // its writes are visible from here on",
          "mdsl::let_next_kernel_launch();")
    folds = [b.namer(f"p_{bg.nodes[i].output.name}") for i in plan.rows]
    mt = -(-plan.m // 8)
    for name, i in zip(folds, plan.rows):
        identity = _fold(bg.nodes[i]).identity
        w(f"float {name}[{mt}] = {{{', '.join([identity] * mt)}}};")
    prologue = _prologue(b, bg, plan)
    with w.block(f"{cls}::run(skinny_acc, {x_ptr}, skinny_w, [&](int mt, float x)"):
        for name, i in zip(folds, plan.rows):
            w(f"{{ float& v = {name}[mt]; v = {_fold(bg.nodes[i]).step}; }}")
    tail = f", {prologue}" + (", skinny_v" if plan.vectors else "") if prologue else ""
    w(f"{tail});", f"{cls}::store_part(skinny_acc, {part});")
    for r, (name, i) in enumerate(zip(folds, plan.rows)):
        combine = _fold(bg.nodes[i]).combine
        w(f"// %{bg.nodes[i].output.name}: each warp's fold of its rows, over the quad's lanes")
        with w.block(f"for (int mt = 0; mt < {mt}; ++mt)"):
            w(f"const float v = mdsl::quad_reduce({name}[mt], {combine});",
              "const int row = mt * 8 + (threadIdx.x % 32) / 4;")
            w(f"if (threadIdx.x % 4 == 0 && row < {plan.m}) "
              f"{part}[{skinny.row_folds_at(r, warps)} + threadIdx.x / 32 * {MAX_ROWS} + row] = v;")
    w(b.sync)
    _sums_into_tiles(b, bg, skinny, part, warps)
    w(b.sync)
    finishing = [i for i in plan.rows if bg.nodes[i].op in FINALIZED]
    for i in finishing:
        w.op(bg.nodes[i])
        CUDA_RULES[bg.nodes[i].op].finalize(b, bg.nodes[i])
    if finishing:
        w(b.sync)


def _prologue(b, bg: BlockGraph, plan) -> str:
    """The prologue's functor (`mdsl::prologue` of a lambda: an element of X in f32, and with vectors along
    K their elements at its k (`v`, in `plan.vectors`' order) -> the operand's element, each node's value
    rounded to its dtype as its tile would hold it), or "" where there is none."""
    if not plan.prologue:
        return ""
    w = b.w
    name = b.namer("skinny_prologue")
    arguments = "float x, const float* v" if plan.vectors else "float x"
    with w.block(f"const auto {name} = mdsl::prologue([]({arguments})"):
        reg = {plan.x: "x", **{vector: f"v[{i}]" for i, vector in enumerate(plan.vectors)}}
        for i in plan.prologue:
            node = bg.nodes[i]
            w.op(node)
            args = [reg[v.name] for v in node.inputs]
            if node.op == "fused":   # a chain of element-wise ops in f32, rounded where it is stored
                value = emit_chain(w, b.namer, node.body, args)[node.body.outputs[0].name]
            else:
                value = CUDA_RULES[node.op].expr(node, args)
            reg[node.output.name] = b.namer(f"r_{node.output.name}")
            w(f"const float {reg[node.output.name]} = {_rounded(value, node.output.type.dtype.name)};")
        w(f"return {reg[plan.left]};")
    w(");")
    return name


def _rounded(value: str, dtype: str) -> str:
    """`value` (an f32 expression) rounded to `dtype` and back (as a tile of `dtype` holds it)."""
    return value if dtype == "f32" else f"mdsl::to_float(mdsl::from_float<{element_ctype(dtype)}>({value}))"


def _tail_arguments(skinny: SkinnyPlan, straddle: bool) -> str:
    """mdsl::Skinny's defaulted template arguments (STAGGER, LEAD, STRADDLE, WIDE_X, VECS, WT), up to the last
    that differs from its default (so that the sources of plans without them stay as they were, and their
    cached kernels)."""
    vectors, transposed = len(skinny.shape.vectors), skinny.shape.transposed
    tail = [("true" if skinny.stagger else "false", skinny.stagger), (str(skinny.lead), skinny.lead != 2),
            ("true" if straddle else "false", straddle),
            ("true" if skinny.wide_x else "false", skinny.wide_x), (str(vectors), vectors > 0),
            ("true" if transposed else "false", transposed)]
    while tail and not tail[-1][1]:
        tail.pop()
    return "".join(f", {text}" for text, _ in tail)


def _sums_into_tiles(b, bg: BlockGraph, skinny: SkinnyPlan, part: str, warps: int) -> None:
    """The block's sums over its warps' partials, in a fixed order, into the accumulators' tiles (`i`: the
    element of M x N), and the row accumulators' folds over the warps combined into theirs (threadIdx.x:
    the row)."""
    plan, w = skinny.shape, b.w
    kw, row = skinny.warps_along_k(warps), skinny.part_row()
    for mat, i in enumerate(plan.sums):
        w.op(bg.nodes[i])
        w("// the warps' partial sums, in a fixed order")
        tile = b.tile(bg.nodes[i].output)
        with b.threads.each(w, plan.m * plan.n):
            w("float sum = 0.0f;", "#pragma unroll")
            with w.block(f"for (int kw = 0; kw < {kw}; ++kw)"):
                w(f"sum += {part}[({mat} * {kw} + kw) * {plan.m * row} + i / {plan.n} * {row} + i % {plan.n}];")
            w(f"{tile.at(offset('i', (plan.m, plan.n), tile))} = mdsl::from_float<{tile.ctype}>(sum);")
    for r, i in enumerate(plan.rows):
        node = bg.nodes[i]
        w.op(node)
        combine, base = _fold(node).combine, skinny.row_folds_at(r, warps)
        tile = b.tile(node.output)
        at = tile.at(offset("threadIdx.x", tuple(tile.shape), tile))
        with w.block(f"if (threadIdx.x < {plan.m})"):
            w(f"float v = {part}[{base} + threadIdx.x];", "#pragma unroll")
            with w.block(f"for (int warp = 1; warp < {warps}; ++warp)"):
                w(f"v = {combine}(v, {part}[{base} + warp * {MAX_ROWS} + threadIdx.x]);")
            w(f"{at} = {combine}({at}, v);")
