"""How long the verifier takes on the best guided candidate of each benchmark case (benchmarks/cases.py).

    python benchmarks/verify_time.py                          # this tree
    python benchmarks/verify_time.py --before HEAD~1          # and a git revision's, side by side
    python benchmarks/verify_time.py --cases lora,gated_mlp   # some cases only

For each case: the candidate's custom kernels as blocks × loop iterations, the first verification in
this process (the original's side of the tests included) and the next one (what a search pays for every
later candidate: each worker keeps the original's runs), in wall-clock and in processor seconds (the
latter hardly depends on what else the machine runs), and whether both trees give the same answer.
A revision's times come from a copy of it (git archive) that verifies the same graphs, handed over as
JSON, once each, in a subprocess that runs just before this tree's verifications of the same case.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _measure(graphs: dict, tests: int, seed: int, repeats: int) -> dict:
    """case -> {"seconds": [each verification's], "cpu_seconds": [its processor time], "answer": repr of
    the first Verification}. Processor time is what a verification costs whatever else the machine runs."""
    from mdsl.ir import serialize
    from mdsl.passes.verify import verify

    out = {}
    for name, texts in graphs.items():
        original, candidate = serialize.loads(texts["original"]), serialize.loads(texts["candidate"])
        seconds, cpu_seconds = [], []
        for _ in range(repeats):
            start, cpu_start = time.perf_counter(), time.process_time()
            answer = repr(verify(original, candidate, tests=tests, seed=seed))
            seconds.append(time.perf_counter() - start)
            cpu_seconds.append(time.process_time() - cpu_start)
        out[name] = {"seconds": seconds, "cpu_seconds": cpu_seconds, "answer": answer}
    return out


def _candidates(names: list) -> dict:
    sys.path.insert(0, str(ROOT))
    from benchmarks.cases import cases
    from mdsl.search.guided import generate
    from mdsl.search.worker import graph_text

    out = {}
    for name, kernel in cases().items():
        if names and name not in names:
            continue
        candidate = next(iter(generate(kernel.graph)))
        shapes = " + ".join(f"{n.body.num_blocks}×{n.body.forloop}" for n in candidate.nodes if n.body is not None)
        out[name] = {"original": graph_text(kernel.graph), "candidate": graph_text(candidate), "shape": shapes}
    return out


@contextlib.contextmanager
def _revision(revision: Optional[str]) -> Iterator[Optional[str]]:
    """A copy of a git revision's files (None without a revision)."""
    if revision is None:
        yield None
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        yield tmp


def _measure_in(tree: str, graphs: dict, tests: int, seed: int) -> dict:
    """_measure, once per case, by the code in `tree`, in a subprocess."""
    graphs_path = pathlib.Path(tree) / "graphs.json"
    graphs_path.write_text(json.dumps(graphs))
    done = subprocess.run([sys.executable, __file__, "--measure", str(graphs_path), "--tests", str(tests),
                           "--seed", str(seed)], env={**os.environ, "PYTHONPATH": tree}, cwd=tree, check=True,
                          stdout=subprocess.PIPE)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="REVISION", help="a git revision to compare with")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all ten)")
    parser.add_argument("--tests", type=int, default=3, help="finite-field tests per verification")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--measure", metavar="GRAPHS_JSON", help=argparse.SUPPRESS)  # a revision's subprocess
    args = parser.parse_args()

    if args.measure:
        import mdsl
        assert pathlib.Path(mdsl.__file__).is_relative_to(os.environ["PYTHONPATH"]), mdsl.__file__
        json.dump(_measure(json.loads(pathlib.Path(args.measure).read_text()), args.tests, args.seed, 1), sys.stdout)
        return

    graphs = _candidates([c for c in args.cases.split(",") if c])
    print(f"{'case':<22}{'blocks × iterations':<22}{'before':>9}    {'first':>7}{'next':>8}{'speedup':>9}"
          f"{'cpu first':>11}{'cpu next':>10}  same answer")
    with _revision(args.before) as tree:
        # case by case, each tree right after the other, so that both see much the same machine load
        for name, graph in graphs.items():
            texts = {name: {"original": graph["original"], "candidate": graph["candidate"]}}
            old = _measure_in(tree, texts, args.tests, args.seed)[name] if tree else None
            new = _measure(texts, args.tests, args.seed, 2)[name]
            first, following = new["seconds"]
            cpu_first, cpu_following = new["cpu_seconds"]
            columns = [f"{old['seconds'][0]:8.2f}s" if old else f"{'':9}", "→" if old else " ",
                       f"{first:6.2f}s", f"{following:7.2f}s",
                       f"{old['seconds'][0] / following:8.1f}×" if old else f"{'':9}",
                       f"{cpu_first:10.2f}s", f"{cpu_following:9.2f}s",
                       ("yes" if old["answer"] == new["answer"] else "NO") if old else ""]
            print(f"{name:<22}{graph['shape']:<22}{' '.join(columns)}", flush=True)


if __name__ == "__main__":
    main()
