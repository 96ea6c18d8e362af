"""The `mdsl` command line.

    mdsl optimize examples/rms_norm_linear.py                  # search every @mdsl.kernel in the file
    mdsl optimize examples/rms_norm_linear.py:rms_norm_linear  # one of them
    mdsl optimize FILE --budget 30 --seed 1 --workers 4 --no-cache --log search.jsonl
    mdsl optimize FILE --explain                               # why each kernel boundary is left
    mdsl optimize FILE --work 20000                            # a larger work budget
    mdsl optimize FILE --format json|dot                       # the chosen mugraphs
    mdsl optimize FILE --format cuda|ptx                       # their generated CUDA C++ or PTX (no GPU needed)
    mdsl optimize FILE --verbose                               # the search's full statistics
    mdsl optimize FILE --trace-only                            # the traced graphs, no search
    mdsl optimize FILE --backend ptx                           # the GPU check compiles through llvmlite's PTX
    mdsl generate --model DIR --prompt-ids 1,2,3 --max-new-tokens 32   # the megakernel (GPU)
    mdsl serve --model DIR --port 8000                          # the OpenAI API over HTTP
    mdsl cache check [--dir DIR] [--jobs N]                     # re-check every cached plan, trust those that pass
    mdsl version

Errors in the user's program (an `MdslError`: shapes, dtypes, tracing) and in the command line are
printed without a Python traceback, with their file, line and hint, and exit with status 2. Other
exceptions raised by the user's file propagate with their traceback, as `python FILE` would show.

`mdsl optimize` stops on SIGINT (Ctrl-C) and SIGTERM alike: the search stops its worker processes and
removes its temporary files, mdsl says "interrupted" or "terminated" and exits with status 130 or 143
(128 + the signal's number, as a shell reports a process the signal killed). Signals that come while
it stops are ignored, so that the clean-up runs to its end.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import signal
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Iterator, Optional, Sequence

from mdsl import __version__
from mdsl.errors import MdslError
from mdsl.frontend.kernel import KernelFunction
from mdsl.ir import dot, serialize
from mdsl.ir.graph import KernelGraph
from mdsl.megakernel.generate_cli import add_generate_command
from mdsl.search.config import SearchConfig
from mdsl.search.progress import StatusLine
from mdsl.server.cli import add_serve_command

EXIT_OK, EXIT_FAILED, EXIT_USER_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130  # 1: the plan failed its GPU check
EXIT_TERMINATED = 143

# the name the loaded file runs under: not "__main__", so that its demo block does not run
_MODULE_NAME = "__mdsl_user_file__"


class CliError(Exception):
    """A bad command line: a missing file, an unknown function name."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt, so that the same clean-up runs."""


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt and SIGTERM Terminated (in the main thread; elsewhere nothing
    changes). The first of them stops the command; those after it are ignored until the clean-up that
    it starts has run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, signal.SIG_IGN)
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------------------------------------
# loading a user's file

def split_target(target: str) -> tuple[Path, Optional[str]]:
    """FILE[:FUNCTION] -> (path, function or None)."""
    path, sep, function = target.rpartition(":")
    if sep and function.isidentifier():
        return Path(path), function
    return Path(target), None


def load_module(path: Path) -> ModuleType:
    """Execute `path` as a module, with its directory on sys.path so that it can import its siblings."""
    if not path.is_file():
        raise CliError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise CliError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[_MODULE_NAME] = module  # some libraries (dataclasses, pickle) look the module up
    directory = str(path.resolve().parent)
    sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(directory)
    return module


def find_kernels(module: ModuleType, path: Path, function: Optional[str]) -> list[KernelFunction]:
    """The module's kernels in definition order (or the one named), each once."""
    kernels = {}
    for name, value in vars(module).items():
        if isinstance(value, KernelFunction) and value not in kernels.values():
            kernels[name] = value
    if function is None:
        if not kernels:
            raise CliError(f"{path} defines no @mdsl.kernel functions")
        return list(kernels.values())
    if function not in kernels:
        available = ", ".join(kernels) or "none"
        raise CliError(f"{path} has no @mdsl.kernel function named {function!r} (its kernels: {available})")
    return [kernels[function]]


# ---------------------------------------------------------------------------------------------
# output formats: each writes kernel graphs for a target arch

def _text(graphs: list[KernelGraph], arch: str) -> str:
    return "\n\n".join(str(g) for g in graphs)


def _json(graphs: list[KernelGraph], arch: str) -> str:
    # JSON Lines: one graph per line, so that the output of several kernels stays machine-readable
    return "\n".join(json.dumps(serialize.to_json(g), sort_keys=True, allow_nan=False) for g in graphs)


def _dot(graphs: list[KernelGraph], arch: str) -> str:
    return "\n".join(dot.to_dot(g) for g in graphs)


def _cuda(graphs: list[KernelGraph], arch: str) -> str:
    """The CUDA C++ the GPU runtime compiles with NVRTC (which printing it does not need)."""
    from mdsl.backend.cuda import emit_cuda

    return "\n\n".join(emit_cuda(g, arch=arch).source for g in graphs)


def _ptx(graphs: list[KernelGraph], arch: str) -> str:
    """The PTX the PTX backend makes on the CPU (LLVM IR through llvmlite's NVPTX target)."""
    from mdsl.backend.ptx import compile_ptx, emit_llvm

    return "\n\n".join(f"// PTX generated by mdsl for kernel graph {g.name}, target {arch}\n"
                        + compile_ptx(emit_llvm(g, arch=arch).llvm_ir, arch).ptx for g in graphs)


FORMATS = {"text": _text, "json": _json, "dot": _dot, "cuda": _cuda, "ptx": _ptx}


# ---------------------------------------------------------------------------------------------
# commands

def optimize(args: argparse.Namespace) -> int:
    with _stopped_by_signals():
        try:
            return _optimize(args)
        finally:  # however the command ends, it ends with its whole process tree
            from mdsl.search.worker import end_server

            end_server()


def _optimize(args: argparse.Namespace) -> int:
    path, function = split_target(args.target)
    kernels = find_kernels(load_module(path), path, function)
    config = SearchConfig(**{name: value for name, value in (("budget_s", args.budget), ("seed", args.seed),
                                                             ("workers", args.workers), ("work", args.work))
                             if value is not None})
    if args.trace_only:
        print(FORMATS[args.format]([k.graph for k in kernels], config.arch))
        return EXIT_OK
    progress = StatusLine(verbose=True) if args.verbose else True
    plans = [k.optimize(config=config, cache=not args.no_cache, progress=progress, log_path=args.log)
             for k in kernels]
    if args.format != "text":
        print(FORMATS[args.format]([p.graph for p in plans], config.arch))
        return EXIT_OK
    status = EXIT_OK
    for i, plan in enumerate(plans):
        print(("\n" if i else "") + plan.text(args.verbose))  # each plan: its header comments, then its mugraph
        if args.explain:
            print("\n".join(f"# {line}" for line in ["explain:", *plan.explain().splitlines()]))
        report = _run_on_gpu(plan, args.backend)
        if report is not None:
            print("\n".join(report.lines()))
            status = status if report.ok else EXIT_FAILED
    sys.stdout.flush()   # the plans first, then what to do with them
    print("\n".join(next_steps(args, kernels, config)), file=sys.stderr)
    return status


def next_steps(args: argparse.Namespace, kernels: list[KernelFunction], config: SearchConfig) -> list:
    """What a person can do with the plans just printed: run them, read their code, find them again.
    (Printed on stderr, as the progress is: stdout holds the plans alone.)"""
    from mdsl.search.engine import cache_location

    path, _ = split_target(args.target)
    again = ["mdsl", "optimize", args.target]   # the options that pick the same plan from the cache
    for option, value in (("--budget", args.budget), ("--seed", args.seed), ("--work", args.work)):
        if value is not None:
            again += [option, f"{value:g}" if isinstance(value, float) else str(value)]
    call = f"{kernels[0].__name__}({', '.join(p.name for p in kernels[0].params)})"
    if len(kernels) > 1:
        call = f"each kernel, e.g. {call},"
    lines = ["next steps:",
             f"  run it:  on a machine with a GPU, call {call} on torch CUDA tensors: the call runs its plan",
             f"           ({path} defines it; there this command also checks the plan and times it)",
             f"  code:    {shlex.join([*again, '--format', 'cuda'])} (or ptx)"]
    if args.no_cache:
        lines.append("  cached:  nothing (--no-cache): the command above searches again")
    for k in kernels if not args.no_cache else ():
        location = cache_location(k.graph, config)
        where = str(location) if location.is_file() else f"nothing: {location} could not be written"
        lines.append(f"  cached:  {where}" + (f" ({k.graph.name})" if len(kernels) > 1 else ""))
    more = [f"{option} adds {text}" for option, given, text in (
        ("--explain", args.explain, "why each kernel boundary is left"),
        ("--verbose", args.verbose, "the search's full statistics")) if not given]
    if more:
        lines.append("  more:    " + "; ".join(more))
    return lines


def _run_on_gpu(plan, backend: str = "cuda"):
    """On a machine with a GPU: run the plan, check it against the reference, time it next to PyTorch."""
    from mdsl.backend.cuda import runtime

    if not runtime.has_gpu():
        return None
    from mdsl.backend.cuda.check import run_plan

    return run_plan(plan, backend=backend)


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"expected a positive {kind.__name__}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def _log_file(text: str) -> Path:
    """--log: a file the search can append to, checked before the search starts."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; name a file in it, e.g. {path / 'search.jsonl'}")
    if not path.parent.is_dir():
        raise argparse.ArgumentTypeError(f"the folder of {text} does not exist")
    if not os.access(path if path.exists() else path.parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text} is not writable")
    return path


def cache_check(args: argparse.Namespace) -> int:
    with _stopped_by_signals():
        try:
            return _cache_check(args)
        finally:  # however the command ends, it ends with its worker processes
            from mdsl.search.worker import end_server

            end_server()


def _cache_check(args: argparse.Namespace) -> int:
    from mdsl.search.cache import default_dir
    from mdsl.search.cache_check import FAILED, check_cache

    root = Path(args.dir) if args.dir is not None else default_dir()
    if not root.is_dir():
        raise CliError(f"no plan cache at {root}: no such folder (--dir names one; the default is $MDSL_CACHE_DIR, "
                       f"else ~/.cache/mdsl)")
    start = time.perf_counter()

    def report(c) -> None:
        timing = f" ({c.seconds:.1f} s)" if c.outcome != "skipped" else ""
        why = (f": {c.reason}" + (" (deleted)" if c.deleted else "")) if c.reason else ""
        print(f"{c.outcome:8} {c.kind:8} {c.path}{timing}{why}", flush=True)

    results = check_cache(root, args.jobs, report)
    counts = {o: sum(c.outcome == o for c in results) for o in ("passed", "failed", "skipped")}
    kinds = {k: sum(c.kind == k for c in results) for k in ("plan", "variants")}
    print(f"mdsl cache check {root}: {_count(len(results), 'entry', 'entries')} ({_count(kinds['plan'], 'plan')}, "
          f"{_count(kinds['variants'], 'variants entry', 'variants entries')}): {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped, {time.perf_counter() - start:.1f} s")
    return EXIT_FAILED if any(c.outcome == FAILED for c in results) else EXIT_OK


def _count(n: int, one: str, many: Optional[str] = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def version(args: argparse.Namespace) -> int:
    print(f"mdsl {__version__}")
    return EXIT_OK


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mdsl", description="mdsl: a tensor-program superoptimizer.")
    parser.add_argument("--version", action="version", version=f"mdsl {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    opt = commands.add_parser(
        "optimize", help="search a file's kernels for faster verified mugraphs and print the plans",
        description="Trace the @mdsl.kernel functions of FILE (or only FUNCTION), using their Tensor[...] "
                    "annotations, search each for the fastest equivalent mugraph (verified, ranked by the "
                    "cost model; no GPU needed) and print its plan. Progress goes to stderr. Plans are "
                    "cached on disk ($MDSL_CACHE_DIR, default ~/.cache/mdsl): the same program and search "
                    "settings are answered from the cache. After the plans, stderr says how to run them, see "
                    "their code and find their cache files. Ctrl-C (SIGINT) or SIGTERM stops the search and its "
                    "worker processes; the exit status is then 130 or 143.")
    opt.add_argument("target", metavar="FILE[:FUNCTION]", help="a Python file, optionally with a kernel's name")
    opt.add_argument("-f", "--format", choices=list(FORMATS), default="text",
                     help="text (default: each plan's header as # comments, then its mugraph in the textual IR), "
                          "json (the chosen mugraphs, one per line), dot (Graphviz), cuda (the plans' CUDA C++) "
                          "or ptx (their PTX, made by llvmlite); none needs a GPU")
    opt.add_argument("--budget", type=_positive(float), metavar="SECONDS",
                     help="wall-clock cap of each search: a search it cuts short returns the best plan so far, "
                          "stored as provisional and searched again by the next run (default 120)")
    opt.add_argument("--work", type=_positive(int), metavar="STEPS",
                     help="work budget of each search: steps each generator and the verification queue may "
                          "take (liftings, enumeration states and their z3 queries' resource units at 5000 a "
                          "step, 100 per candidate verified); the plan depends on "
                          "it and not on the machine's speed (default 10000)")
    opt.add_argument("--explain", action="store_true",
                     help="after each plan, say why each kernel boundary left in it could not be removed")
    opt.add_argument("--seed", type=int, help="the seed all of the search's randomness derives from (default 0)")
    opt.add_argument("--workers", type=_positive(int), help="processes that verify candidates (default: one per core)")
    opt.add_argument("--no-cache", action="store_true", help="search even if a cached plan exists (and do not store it)")
    opt.add_argument("--log", type=_log_file, metavar="FILE.jsonl",
                     help="append the search's events to FILE.jsonl, one JSON object a line")
    opt.add_argument("--trace-only", action="store_true", help="print the traced kernel graphs, without searching")
    opt.add_argument("-v", "--verbose", action="store_true",
                     help="show the search's full statistics (candidates by generator, pruned by reason) in its "
                          "progress and in each plan's header")
    opt.add_argument("--backend", choices=("cuda", "ptx"), default="cuda",
                     help="the code generator of the GPU check on a machine with a GPU: cuda (CUDA C++ by NVRTC, "
                          "the default) or ptx (PTX by llvmlite)")
    opt.set_defaults(run=optimize)

    add_generate_command(commands)
    add_serve_command(commands)

    cache = commands.add_parser("cache", help="work on the plan cache",
                                description="Work on the plan cache ($MDSL_CACHE_DIR, default ~/.cache/mdsl).")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    check = cache_commands.add_parser(
        "check", help="re-check every cached plan and tuning variant; trust those that pass, delete those that fail",
        description="Re-check every entry of the plan cache (each plan and the tuning variants stored beside it: "
                    "claims, costs, a finite-field test and the float tests of every candidate against the "
                    "original program), as reading an entry does, in worker processes. An entry that passes is "
                    "trusted: this user's mdsl reads it later without re-checking it (the record is kept in "
                    "$MDSL_STATE_DIR, default ~/.local/state/mdsl, not in the cache). An entry that fails is "
                    "deleted, so that the next search replaces it; one of another mdsl version is left alone. "
                    "Run it once on a cache carried from another machine, before the first compile. Prints one "
                    "line an entry and a summary; the exit status is 1 if an entry failed.")
    check.add_argument("--dir", metavar="DIR", help="the cache folder (default: $MDSL_CACHE_DIR, else ~/.cache/mdsl)")
    check.add_argument("--jobs", type=_positive(int), metavar="N",
                       help="processes that re-check entries (default: one per CPU)")
    check.set_defaults(run=cache_check)

    ver = commands.add_parser("version", help="print mdsl's version")
    ver.set_defaults(run=version)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.run(args)
    except (MdslError, CliError) as e:
        print(f"mdsl: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except Terminated:  # the search has stopped its workers on the way out
        print("\nmdsl: terminated", file=sys.stderr)
        return EXIT_TERMINATED
    except KeyboardInterrupt:
        print("\nmdsl: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
