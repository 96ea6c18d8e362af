"""The textual form of the mugraph at its three levels, printed and parsed back exactly.

    kernel rms_norm_linear(%x: f16[16, 4096], %w: f16[4096, 6144]) {
      %t0: f16[16, 4096] = rms_norm(%x) {dim=-1, eps=1e-06}  # @ examples/rms_norm_linear.py:8:11-27
      %y: f16[16, 6144] = custom(%t0, %w) block(grid=[48, 1, 1], threads=128, forloop=64) {
        in %bx: f16[16, 64] imap=[-, -, -] fmap=1
        in %bw: f16[64, 128] imap=[1, -, -] fmap=-
        %m: f16[16, 128] = matmul(%bx, %bw)
        %acc: f16[16, 128] = accum(%m)
        out %acc omap=[1, -, -]
      }  # @ examples/rms_norm_linear.py:8:11-31
      return %y
    }

`-` stands for None in imap/fmap/omap. A block-level `fused` node's body is `thread { ... }` with
`in %p: TYPE` and `out %r` lines. A node's source location is a trailing `# @ FILE:LINE[:COL][-END]`
comment (on the closing `}` of a node with a body); other comments and blank lines are ignored.
Indentation is printed for people and ignored by the parser.
"""
from __future__ import annotations

import json
import re
from typing import NamedTuple, Optional, Union

from mdsl.errors import MdslError, ParseError, SourceLoc
from mdsl.ir.dtypes import DTYPES
from mdsl.ir.graph import BlockGraph, BlockInput, BlockOutput, KernelGraph, Node, ThreadGraph
from mdsl.ir.ops import OpDef, get_op
# the printer's names, read from here too (the text form's two directions in one place)
from mdsl.ir.printer import (_loc_comment, format_attrs, print_block_graph, print_graph, print_node,  # noqa: F401
                             print_thread_graph)
from mdsl.ir.types import TensorType, Var, check_shape
from mdsl.ir.validate import check_launch, validate_kernel_graph

Graph = Union[KernelGraph, BlockGraph, ThreadGraph]

_TEXT = "<text>"  # the file name parse errors report

# ---------------------------------------------------------------------------------------------
# printing (mdsl.ir.printer)


def print_ir(graph: Graph) -> str:
    """The text of a graph of any level."""
    if isinstance(graph, KernelGraph):
        return print_graph(graph)
    if isinstance(graph, BlockGraph):
        return print_block_graph(graph)
    if isinstance(graph, ThreadGraph):
        return print_thread_graph(graph)
    raise TypeError(f"not a mugraph: {type(graph).__name__}")


# ---------------------------------------------------------------------------------------------
# parsing

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<var>%[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<ident>[A-Za-z_][A-Za-z0-9_.]*)
  | (?P<num>-?(?:\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|inf|nan)(?![A-Za-z0-9_.]))
  | (?P<punct>[()\[\]{},:=-])
""", re.VERBOSE)
_INT = re.compile(r"-?\d+")
# A kernel's custom op holds a block graph, whose fused op holds a thread graph: nothing nests deeper.
_MAX_BODY_DEPTH = 2
_LOC_TAIL = r":(\d+)(?::(\d+))?(?:-(\d+))?"


class _Tok(NamedTuple):
    kind: str  # var | ident | num | punct | eol | eof
    text: str
    line: int
    col: int


class _Line:
    """One line of text as tokens (ending with an end-of-line token) and its comment, if any."""

    def __init__(self, number: int, raw: str):
        # no token contains '#', so the first one starts the comment
        code, hash_, comment = raw.partition("#")
        self.number = number
        self.comment = comment if hash_ else None
        self.comment_col = len(code)
        self.toks = _tokenize(code, number) + [_Tok("eol", "", number, len(code.rstrip()))]


def _tokenize(code: str, number: int) -> list:
    toks, pos = [], 0
    while pos < len(code):
        m = _TOKEN.match(code, pos)
        if m is None:
            raise ParseError(f"unexpected character {code[pos]!r}", loc=SourceLoc(_TEXT, number, pos))
        if m.lastgroup != "space":
            toks.append(_Tok(m.lastgroup, m.group(), number, pos))
        pos = m.end()
    return toks


def parse(text: str, *, validate: bool = True) -> Graph:
    """Read a kernel, block or thread graph (by its header). Kernel graphs are validated, and a
    validation error points at the line of the text where the bad node is."""
    graph = _Parser(text).graph()
    if validate and isinstance(graph, KernelGraph):
        try:
            validate_kernel_graph(graph)
        except MdslError as e:
            raise _at_text_line(text, e) from None
    return graph


def parse_graph(text: str, *, validate: bool = True) -> KernelGraph:
    graph = parse(text, validate=validate)
    if not isinstance(graph, KernelGraph):
        raise ParseError(f"expected a kernel graph, got a {type(graph).__name__}", loc=SourceLoc(_TEXT, 1, 0))
    return graph


def _at_text_line(text: str, error: MdslError) -> MdslError:
    # Validation errors point at node.loc, the user's source line. Validating again the graph read
    # with every node's loc set to its line in the text makes the error point there instead.
    try:
        validate_kernel_graph(_Parser(text, text_locs=True).graph())
    except MdslError as e:
        return e.with_loc(SourceLoc(_TEXT, 1, 0))
    return error


class _Parser:
    """Recursive descent over lines: every statement is one line, except a node with a body,
    which runs to its closing `}` line."""

    def __init__(self, text: str, *, text_locs: bool = False):
        raw = text.split("\n")
        lines = (_Line(i + 1, s) for i, s in enumerate(raw))
        self.lines = [ln for ln in lines if ln.toks[0].kind != "eol"]
        self.end = _Line(len(raw) + 1, "")
        self.end.toks = [_Tok("eof", "", self.end.number, 0)]
        self.text_locs = text_locs
        self.index = 0
        self.pos = 0
        self.depth = 0   # bodies open around the current line (a top-level block or thread graph is one)

    # --- tokens -------------------------------------------------------------------------------

    @property
    def line(self) -> _Line:
        return self.lines[self.index] if self.index < len(self.lines) else self.end

    def peek(self, ahead: int = 0) -> _Tok:
        toks = self.line.toks
        return toks[min(self.pos + ahead, len(toks) - 1)]

    def take(self) -> _Tok:
        tok = self.peek()
        if tok.kind not in ("eol", "eof"):
            self.pos += 1
        return tok

    def at(self, text: str) -> bool:
        tok = self.peek()
        return tok.kind in ("ident", "punct") and tok.text == text

    def accept(self, text: str) -> bool:
        if self.at(text):
            self.pos += 1
            return True
        return False

    def expect(self, text: str, what: Optional[str] = None) -> _Tok:
        if not self.at(text):
            raise self.error(what or repr(text))
        return self.take()

    def expect_kind(self, kind: str, what: str) -> _Tok:
        if self.peek().kind != kind:
            raise self.error(what)
        return self.take()

    @staticmethod
    def loc(tok: _Tok) -> SourceLoc:
        return SourceLoc(_TEXT, tok.line, tok.col)

    def error(self, expected: str, tok: Optional[_Tok] = None, hint: Optional[str] = None) -> ParseError:
        tok = tok or self.peek()
        got = {"eol": "end of line", "eof": "end of text"}.get(tok.kind, repr(tok.text))
        return ParseError(f"expected {expected}, got {got}", loc=self.loc(tok),
                          hint=hint or "the parser reads the form mdsl prints (str(graph)); compare the line with "
                                       "a printed graph")

    def end_line(self) -> _Line:
        """Check that the line is fully read and move to the next one; return the finished line."""
        if self.peek().kind != "eol":
            raise self.error("end of line")
        line = self.line
        self.index += 1
        self.pos = 0
        return line

    # --- graphs -------------------------------------------------------------------------------

    def graph(self) -> Graph:
        if self.at("kernel"):
            graph = self.kernel()
        elif self.at("block") or self.at("thread"):
            graph, _ = self.body()
        else:
            raise self.error("'kernel', 'block' or 'thread'")
        if self.peek().kind != "eof":
            raise self.error("end of text")
        return graph

    def kernel(self) -> KernelGraph:
        self.expect("kernel")
        name = self.expect_kind("ident", "a kernel name").text
        scope: dict = {}
        self.expect("(")
        inputs = self.seq(lambda: self.define(scope, self.declaration()), ")")
        self.expect("{")
        self.end_line()
        nodes = self.nodes(scope, ("return",))
        self.expect("return")
        outputs = []
        if self.peek().kind != "eol":
            outputs.append(self.use(scope))
            while self.accept(","):
                outputs.append(self.use(scope))
        self.end_line()
        self.expect("}")
        self.end_line()
        return KernelGraph(name, inputs, nodes, outputs)

    def body(self) -> tuple:
        """A block or thread graph from its header through its closing `}` line: (graph, that line)."""
        self.depth += 1
        try:
            return self._body()
        finally:
            self.depth -= 1

    def _body(self) -> tuple:
        if self.depth > _MAX_BODY_DEPTH:
            raise ParseError(f"graph bodies nest more than {_MAX_BODY_DEPTH} deep", loc=self.loc(self.peek()),
                             hint="a kernel's custom op holds a block graph, a block graph's fused op holds a "
                                  "thread graph, and a thread graph holds element-wise ops only")
        if self.accept("block"):
            self.expect("(")
            grid = self.keyword_value("grid", lambda: self.triple(self.integer))
            self.expect(",")
            threads = self.keyword_value("threads", self.integer)
            self.expect(",")
            forloop = self.keyword_value("forloop", self.integer)
            try:
                check_launch(tuple(grid) + (1,) * (3 - len(grid)), threads, forloop)
            except MdslError as e:
                raise e.with_loc(self.loc(self.peek()))
            self.expect(")")
            self.expect("{")
            self.end_line()
            graph = self.block_lines(grid, threads, forloop)
        else:
            self.expect("thread", "'block' or 'thread'")
            self.expect("{")
            self.end_line()
            graph = self.thread_lines()
        self.expect("}", "'out' or '}'")
        return graph, self.end_line()

    def block_lines(self, grid, threads: int, forloop: int) -> BlockGraph:
        scope: dict = {}
        inputs = []
        while self.accept("in"):
            var = self.define(scope, self.declaration())
            imap = self.keyword_value("imap", self.grid_map)
            fmap = self.keyword_value("fmap", self.entry)
            self.end_line()
            inputs.append(BlockInput(var, imap, fmap))
        nodes = self.nodes(scope, ("out", "}"))
        outputs = []
        while self.accept("out"):
            var = self.use(scope)
            omap = self.keyword_value("omap", self.grid_map)
            self.end_line()
            outputs.append(BlockOutput(var, omap))
        return BlockGraph(grid, threads, forloop, inputs, nodes, outputs)

    def thread_lines(self) -> ThreadGraph:
        scope: dict = {}
        inputs = []
        while self.accept("in"):
            inputs.append(self.define(scope, self.declaration()))
            self.end_line()
        nodes = self.nodes(scope, ("out", "}"))
        outputs = []
        while self.accept("out"):
            outputs.append(self.use(scope))
            self.end_line()
        return ThreadGraph(inputs, nodes, outputs)

    def nodes(self, scope: dict, stop: tuple) -> list:
        nodes = []
        while not any(self.at(word) for word in stop):
            if self.peek().kind != "var":
                raise self.error(f"a node (%name: type = op(...)) or {' or '.join(map(repr, stop))}")
            nodes.append(self.node(scope))
        return nodes

    def node(self, scope: dict) -> Node:
        start = self.peek()
        outputs = [self.declaration()]
        while self.accept(","):
            outputs.append(self.declaration())
        self.expect("=", "',' or '='")
        op_tok = self.expect_kind("ident", "an operator name")
        try:
            op = get_op(op_tok.text)
        except MdslError as e:
            raise e.with_loc(self.loc(op_tok))
        self.expect("(")
        inputs = self.seq(lambda: self.use(scope), ")")
        attrs = self.attributes(op, op_tok)
        if self.at("block") or self.at("thread"):
            body, last = self.body()
        else:
            body, last = None, self.end_line()
        for out in outputs:
            self.define(scope, out)
        loc = self.loc(start) if self.text_locs else _comment_loc(last)
        return Node(op.name, inputs, [v for _, v in outputs], attrs, body, loc)

    # --- pieces -------------------------------------------------------------------------------

    def seq(self, item, close: str, *, opened: Optional[str] = None) -> list:
        """Items separated by commas up to `close` (consumed), after `opened` when given; maybe none."""
        if opened:
            self.expect(opened)
        items: list = []
        if self.accept(close):
            return items
        while True:
            items.append(item())
            if self.accept(close):
                return items
            self.expect(",", f"',' or {close!r}")

    def keyword_value(self, key: str, value):
        self.expect(key)
        self.expect("=")
        return value()

    def declaration(self) -> tuple:
        """`%name: TYPE` as (the name's token, the Var)."""
        tok = self.expect_kind("var", "a value name (%name)")
        self.expect(":")
        return tok, Var(tok.text[1:], self.tensor_type())

    def define(self, scope: dict, declaration: tuple) -> Var:
        tok, var = declaration
        if var.name in scope:
            raise ParseError(f"%{var.name} is already defined", loc=self.loc(tok))
        scope[var.name] = var
        return var

    def use(self, scope: dict) -> Var:
        tok = self.expect_kind("var", "a value name (%name)")
        var = scope.get(tok.text[1:])
        if var is None:
            raise ParseError(f"undefined value {tok.text}", loc=self.loc(tok))
        return var

    def tensor_type(self) -> TensorType:
        tok = self.expect_kind("ident", "a dtype (f16, bf16, f32, i32)")
        dtype = DTYPES.get(tok.text)
        if dtype is None:
            raise self.error(f"a dtype ({', '.join(DTYPES)})", tok)
        shape = self.seq(self.integer, "]", opened="[")
        try:
            check_shape(shape, dtype, "the tensor type")
        except MdslError as e:
            raise e.with_loc(self.loc(tok))
        return TensorType(shape, dtype)

    def integer(self) -> int:
        tok = self.peek()
        if tok.kind != "num" or not _INT.fullmatch(tok.text):
            raise self.error("an integer")
        return self.number(self.take())

    def number(self, tok: _Tok) -> Union[int, float]:
        if not _INT.fullmatch(tok.text):
            return float(tok.text)
        try:
            return int(tok.text)
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            raise ParseError(f"the integer {tok.text[:20]}... has {len(tok.text)} digits, too many to read",
                             loc=self.loc(tok), hint="no size, dim or attribute of a mugraph needs that many") from None

    def entry(self) -> Optional[int]:
        """A tensor dim in a grid map or fmap, or `-` for none."""
        return None if self.accept("-") else self.integer()

    def grid_map(self) -> list:
        return self.triple(self.entry)

    def triple(self, item) -> list:
        """`[x, y, z]`: one entry per grid dim, trailing ones may be left out."""
        start = self.peek()
        entries = self.seq(item, "]", opened="[")
        if len(entries) > 3:
            raise ParseError(f"expected at most 3 entries (grid x, y, z), got {len(entries)}", loc=self.loc(start))
        return entries

    def attributes(self, op: OpDef, op_tok: _Tok) -> tuple:
        """The optional `{name=value, ...}`, normalized by the operator (defaults filled in)."""
        raw: dict = {}

        def attribute():
            tok = self.expect_kind("ident", "an attribute name")
            if tok.text in raw:
                raise ParseError(f"attribute {tok.text!r} is given twice", loc=self.loc(tok))
            self.expect("=")
            raw[tok.text] = self.value()

        where = op_tok
        if self.at("{") and self.peek(1).kind != "eol":  # a body's '{' ends its line
            where = self.expect("{")
            self.seq(attribute, "}")
        try:
            return op.normalize_attrs(raw)
        except MdslError as e:
            raise ParseError(e.message, loc=self.loc(where), hint=e.hint) from None

    def value(self):
        """An attribute value as read: int, float, bool, a name (dtype) or a list of those."""
        if self.at("["):
            return self.seq(self.scalar, "]", opened="[")
        return self.scalar()

    def scalar(self):
        tok = self.peek()
        if tok.kind == "num":
            return self.number(self.take())
        if tok.kind == "ident":
            self.take()
            words = {"true": True, "false": False, "inf": float("inf"), "nan": float("nan")}
            return words.get(tok.text, tok.text)
        raise self.error("an attribute value", hint="attribute values are numbers, true, false, names (dtypes, "
                                                    "operators) and flat lists of them")


def _comment_loc(line: _Line) -> Optional[SourceLoc]:
    """The source location in a line's `# @ FILE:LINE[:COL][-END]` comment; None for other comments."""
    comment = (line.comment or "").strip()
    if not comment.startswith("@"):
        return None
    text = comment[1:].strip()
    if text.startswith('"'):
        try:
            file, end = json.JSONDecoder().raw_decode(text)
        except ValueError:
            file, end = None, 0
        m = re.fullmatch(_LOC_TAIL, text[end:]) if isinstance(file, str) else None
    else:
        m = re.fullmatch(r"(.*?)" + _LOC_TAIL, text, re.DOTALL)
        file = m and m.group(1)
    if m is None:
        raise ParseError("expected a source location FILE:LINE[:COL][-END] after '# @'",
                         loc=SourceLoc(_TEXT, line.number, line.comment_col),
                         hint="a comment that starts with '@' is a node's source location; write '# note' for "
                              "other comments")
    try:
        line_no, col, end_col = (None if g is None else int(g) for g in m.groups()[-3:])
    except ValueError:  # more digits than Python converts
        raise ParseError("the source location's numbers have too many digits to read",
                         loc=SourceLoc(_TEXT, line.number, line.comment_col),
                         hint="write it as # @ FILE:LINE[:COL][-END]") from None
    return SourceLoc(file, line_no, col, end_col)
