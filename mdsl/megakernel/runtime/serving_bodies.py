"""The serving kernel's task bodies, generated per serving plan (serving_plan.py): each linear kind's body over the
step's rows, and `run_task`, the SERVE section's dispatch on the task's kind.

A linear kind's body is its one-row body (cuda_bodies.py: the op's CUDA task rule gives its weight matrices, its
input row and its epilogue, written by the CUDA backend's rule table) over the step's rows: per row its input (the
residual stream's row of that step row, rms-normalised, or a row of an activation buffer), the epilogue's residual
and addend read from that row's residual stream, the result stored into that row. serve_rows.cuh's `rows_linear` runs a
tile's columns over several rows a pass of weight loads, each (row, column) product in the order a row has alone.
A linear task (and the LM head's) is handed over before its inputs are complete (an early kind: worker.cuh), so that
its first pass's weight rows go to L2 while the block waits; its body returns false, having written nothing, where
they never come.
QKV's body then counts its columns on the append counters (serve_attention.cuh's `append_kv`); attention, the LM
head and the samplers are the runtime's own functions (serve_attention.cuh, serve_sampling.cuh), SCHEDULE is
serve.cuh's `schedule_task`.
"""
from __future__ import annotations

from typing import Optional

from mdsl.backend.cuda.source import CodeWriter
from mdsl.errors import UnsupportedError
from mdsl.megakernel.runtime.cuda_bodies import (Activations, LinearBody, NormedStream, ToBuffer, ToStream,
                                                 _epilogue_inputs, _row_expression, emit_epilogue, linear_bodies,
                                                 stream_layer, write_dispatch, write_linear_body)
from mdsl.megakernel.runtime.serving_plan import ServingPlan
from mdsl.megakernel.runtime.task_plan import Kind, KindOp

# the step rows' buffers a kind's output (ToBuffer) and a projection's input (Activations) are rows of: (the
# buffer, its width)
_OUTPUTS = {Kind.QKV: ("p.qkvs", "QKV"), Kind.GATEUP: ("p.acts", "I")}
_INPUTS = {Kind.OPROJ: ("p.attns", "HQ * D"), Kind.DOWN: ("p.acts", "I")}
_STREAMS = {"h": "p.hs", "mid": "p.mids"}   # the residual stream's rows (task_plan.STREAMS)


def _stream_value(stream: Optional[tuple]) -> Optional[str]:
    """C++: column r of the step row's residual-stream row `stream` ((family, layer offset)), as f32."""
    if stream is None:
        return None
    family, offset = stream
    return f"mdsl::to_float(row_of({_STREAMS[family]}, {stream_layer(offset)}, row, H)[r])"


def _refuse(body: LinearBody, why: str) -> UnsupportedError:
    return UnsupportedError(f"the serving kernel has no {body.kind.name} body over a step's rows: {why}",
                            hint="serve the model with mdsl.LLM's cpu or gpu device")


def _input(body: LinearBody) -> str:
    """C++: the statement that stores step row `row`'s input row into xs (serve_rows.cuh's normed_row or input_row)."""
    source = body.source
    if isinstance(source, NormedStream):
        if source.unit_offset:
            raise _refuse(body, "its norm scales by 1 + weight")
        return f"normed_row<{body.k}>(row_of({source.single}, {source.layer}, row, H), {source.norm}, xs);"
    if isinstance(source, Activations) and body.kind in _INPUTS:
        buffer, width = _INPUTS[body.kind]
        assert buffer in source.row and width == source.width, (body.kind, source)
        return f"input_row<{width}>(row_of({buffer}, t.layer, row, {width}), xs);"
    raise _refuse(body, f"its input is {type(source).__name__}")


def _store(body: LinearBody, value: str) -> str:
    """C++: column r of step row `row`'s output row = value, rounded to T."""
    sink = body.sink
    if isinstance(sink, ToBuffer) and body.kind in _OUTPUTS:
        buffer, width = _OUTPUTS[body.kind]
        assert buffer in sink.row, (body.kind, sink)
        return f"row_of({buffer}, t.layer, row, {width})[r] = mdsl::from_float<T>({value});"
    if isinstance(sink, ToStream):
        return f"row_of({sink.single}, {sink.layer}, row, H)[r] = mdsl::from_float<T>({value});"
    raise _refuse(body, f"its output is {type(sink).__name__}")


def write_rows_body(w: CodeWriter, body: LinearBody, kind_op: KindOp) -> None:
    """The body of a linear kind over the step's rows: rows_linear with the kind's input, weight rows, epilogue and
    store per step row (each result rounded to T where the one-row body rounds it); QKV's then appends the kv heads
    its columns complete."""
    if body.row_norm is not None or body.prologue or body.after is not None or not body.layered:
        raise _refuse(body, "its body has steps beyond a linear's")
    inputs = _epilogue_inputs(body, 1)
    for role in ("residual", "addend"):
        if role in inputs:
            inputs[role] = _stream_value(kind_op.stream(role))
    w("", f"// {body.kind.name} over the step's rows: generated from the epilogue",
      *(f"//   {line}" for line in str(body.epilogue).splitlines()))
    with w.block(f"__device__ bool {body.function}(const Params& p, const Task& t, int ready, float* work, "
                 "float* red, long long step)"):
        w("const LayerWeights& w = p.layers[t.layer];")
        w(f"const bool inputs = rows_linear<{body.k}, {body.products}>(")
        w.depth += 4
        w("p, t, ready, int(step_header(p).num_rows), [](int j) { return j; },")
        w(f"[&](int row, RowsInput<{body.k}, {body.products}> xs) {{ {_input(body)} }},")
        w(f"[&](int r, int j) {{ return {_row_expression(body)}; }},")
        with w.block("[&](int, int row, int r, const float* acc)"):
            value = emit_epilogue(w, body.epilogue, inputs, rounded=body.rounded)
            w(_store(body, value))
        w.lines[-1] += ","
        w("work);")
        w.depth -= 4
        w("if (!inputs) return false;")
        if body.kind is Kind.QKV:
            w("append_kv(p, t, step, work);")
        w("return true;")


# the kinds whose bodies are the runtime's own functions (serve.cuh, serve_attention.cuh, serve_sampling.cuh)
_RUNTIME_CALLS = {
    Kind.SCHEDULE: "return schedule_task(p, step, work);",
    Kind.ATTN: "attention_items_task(p, t, work);",
    Kind.SAMPLE: "sample_rows_task(p, t, red);",
}


def generate_serving_bodies(plan: ServingPlan) -> str:
    """The CUDA of the serving plan's task bodies and run_task (inserted into device.cu's SERVE kernel)."""
    w = CodeWriter()
    w("// ---- task bodies over a step's rows, generated by mdsl/megakernel/runtime/serving_bodies.py")
    linear = {body.kind: body for body in linear_bodies(plan.base)}
    calls = [(Kind.SCHEDULE, _RUNTIME_CALLS[Kind.SCHEDULE])]
    for kind_op in plan.base.kind_ops:
        kind, body = kind_op.kind, linear.get(kind_op.kind)
        if kind is Kind.LMHEAD:   # its epilogue as the functor the runtime's lmhead_rows_task calls
            write_linear_body(w, body, 1)
            calls.append((kind, f"return lmhead_rows_task(p, t, ready, k - LM_FIRST, work, red, {body.function}{{}});"))
        elif body is not None:
            write_rows_body(w, body, kind_op)
            calls.append((kind, f"return {body.function}(p, t, ready, work, red, step);"))
        elif kind in _RUNTIME_CALLS:
            calls.append((kind, _RUNTIME_CALLS[kind]))
        else:
            raise UnsupportedError(f"the serving kernel has no body for the {kind.name} tasks of {kind_op.op}")
    write_dispatch(w, calls)
    return w.text()
