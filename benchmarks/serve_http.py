"""Load test of `mdsl serve`: N concurrent streaming clients over HTTP, and with --offline the same
requests N at a time through the engine in this process, for the throughput the HTTP path keeps.

    python3 benchmarks/serve_http.py --model DIR --clients 64 --requests 256 --max-tokens 128 --offline --out $OUT
    python3 benchmarks/serve_http.py --model qwen3-8b --device gpu ...   # random weights at Qwen3-8B's shapes
    python3 benchmarks/serve_http.py --model DIR --url http://HOST:8000 --api-key KEY   # a server already running

Requests: `--requests` token-id prompts (no tokenizer needed) of seeded random lengths in --prompt-len
LO:HI and random ids below the vocabulary, each generating exactly --max-tokens tokens (greedy,
`ignore_eos`). Each of the --clients clients takes the next request as soon as its last one ends (a
closed loop), so at most --clients requests are in flight; the server starts with max_batch = clients
and max_seq = HI + max-tokens. The HTTP clients are asyncio coroutines on one httpx connection pool,
reading the server-sent events of /v1/completions; the offline clients are threads streaming
`LLM.submit` handles. One short request warms each path up first.

Reported per path: output tokens per second (all output tokens over the wall time from the first
request's start to the last one's end), requests per second, time to first token and time per output
token ((last token - first token) / (tokens - 1), per request) at p50 and p99, errors; and the HTTP
throughput over the offline one. Greedy decoding is batch-invariant, so both paths must produce the same
tokens per request: `mismatched` counts those that differ. Files: serve_http.json (with the run's
provenance) and serve_http.md (the table, also printed).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

if str(Path(__file__).resolve().parent.parent) not in sys.path:   # run as a script from anywhere, with or without mdsl installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STARTUP_S = 600           # loading a large checkpoint


class ServerProcess:
    """`python -m mdsl serve --port 0 ...` with the mdsl this process imports, its output in a log file;
    `url` once it listens."""

    def __init__(self, folder: str, log_path: Path, *args: str, timeout: float = STARTUP_S):
        import mdsl

        self.log_path = log_path
        paths = [str(Path(mdsl.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p), "PYTHONUNBUFFERED": "1"}
        env.pop("MDSL_API_KEY", None)
        with open(log_path, "w") as log:
            self.process = subprocess.Popen([sys.executable, "-m", "mdsl", "serve", "--model", folder, "--port", "0",
                                             *args], stdout=log, stderr=subprocess.STDOUT, cwd=log_path.parent, env=env)
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(r"at (http://\S+)/v1 ", log_path.read_text())
            if found:
                self.url = found.group(1)
                return
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop(signal.SIGKILL)
                raise RuntimeError(f"mdsl serve did not start:\n{self.log()}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGINT, timeout: float = 60.0) -> int:
        """Signal the server and wait for its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise RuntimeError(f"mdsl serve did not exit within {timeout} s of {sig!r}:\n{self.log()}") from None


def make_requests(vocab: int, count: int, lengths: tuple, seed: int) -> list:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=int(rng.integers(lengths[0], lengths[1] + 1)))]
            for _ in range(count)]


@contextlib.contextmanager
def scratch_folder(prefix: str):
    """A temporary folder, removed however the run ends: on an exception, and on SIGTERM (`timeout`'s
    signal, which would otherwise end the process with a model's random weights, gigabytes, left on disk)."""
    main = threading.current_thread() is threading.main_thread()   # (only the main thread sets handlers)
    previous = signal.getsignal(signal.SIGTERM) if main else None
    if main:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        with tempfile.TemporaryDirectory(prefix=prefix) as folder:
            yield folder
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)


def model_dict(name: str, layers: Optional[int] = None) -> dict:
    """The config.json of a model of mdsl.megakernel.runtime.models, cut to its first `layers` layers where
    given."""
    from mdsl.megakernel.runtime.models import MODELS

    return MODELS[name] if layers is None else {**MODELS[name], "num_hidden_layers": layers}


def random_checkpoint(name: str, folder: str, seed: int = 0, layers: Optional[int] = None) -> None:
    """Random weights at the shapes of a model of mdsl.megakernel.runtime.models, saved in its dtype (its
    first `layers` layers where given). Made as bit patterns (a matrix entry: random sign and mantissa,
    magnitude in [2^-8, 2^-4); a norm weight near 1), which takes seconds where normal samples of Qwen3-8B's
    8 G weights take minutes."""
    import numpy as np

    from mdsl.ir.dtypes import bf16, round_to_dtype
    from mdsl.megakernel.modelgraph.architectures import step_function
    from mdsl.megakernel.modelgraph.checkpoint import save_checkpoint
    from mdsl.megakernel.modelgraph.model_config import config_from_dict

    raw = model_dict(name, layers)
    config = config_from_dict(raw)
    rng = np.random.default_rng(seed)
    weights = {}
    for w in step_function(config).trace(config).weights:
        if w.type.rank == 1:
            weights[w.name] = round_to_dtype((1.0 + 0.1 * rng.standard_normal(w.shape)).astype(np.float32), w.dtype)
            continue
        bits = rng.integers(0, 1 << 16, w.shape, dtype=np.uint16)
        # sign and 7 mantissa bits as drawn, biased exponent 119 + (0..3)
        bits = (bits & np.uint16(0x807F)) | ((np.uint16(119) + ((bits >> np.uint16(7)) & np.uint16(3))) << np.uint16(7))
        weights[w.name] = bits if w.dtype is bf16 else np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)
    save_checkpoint(folder, raw, weights)


# ---- one request's record

def _record(prompt_len: int, start: float, times: list, tokens: list, error: Optional[str]) -> dict:
    return {"prompt_len": prompt_len, "start": start, "end": times[-1] if times else time.perf_counter(),
            "first": times[0] if times else None, "last": times[-1] if times else None, "tokens": tokens,
            "error": error}


async def _http_request(http, url: str, headers: dict, model: str, prompt: list, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start, times, tokens = time.perf_counter(), [], []
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status_code != 200:
                return _record(len(prompt), start, times, tokens,
                               f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return _record(len(prompt), start, times, tokens, event["error"].get("message", "error event"))
                new = event["choices"][0]["token_ids"]
                if new:
                    now = time.perf_counter()
                    times.extend([now] * len(new))
                    tokens.extend(new)
    except Exception as e:    # a broken connection counts as an error, not a crash of the load test
        return _record(len(prompt), start, times, tokens, f"{type(e).__name__}: {e}")
    error = None if len(tokens) == max_tokens else f"{len(tokens)} tokens, expected {max_tokens}"
    return _record(len(prompt), start, times, tokens, error)


async def _http_run(url: str, api_key: Optional[str], prompts: list, max_tokens: int, clients: int) -> list:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600.0)) as http:
        models = await http.get(f"{url}/v1/models", headers=headers)
        models.raise_for_status()
        model = models.json()["data"][0]["id"]
        warm = await _http_request(http, url, headers, model, prompts[0][:4], 2)
        if warm["error"]:
            raise RuntimeError(f"the warm-up request failed: {warm['error']}")
        pending = iter(enumerate(prompts))
        records: list = [None] * len(prompts)

        async def one_client():
            for i, prompt in pending:
                records[i] = await _http_request(http, url, headers, model, prompt, max_tokens)

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return records


def _offline_run(llm, prompts: list, max_tokens: int, clients: int) -> list:
    from mdsl import SamplingParams

    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    llm.submit(prompts[0][:4], SamplingParams(max_new_tokens=2, ignore_eos=True)).result()
    work: queue.Queue = queue.Queue()
    for item in enumerate(prompts):
        work.put(item)
    records: list = [None] * len(prompts)

    def one_client():
        while True:
            try:
                i, prompt = work.get_nowait()
            except queue.Empty:
                return
            start, times, tokens = time.perf_counter(), [], []
            try:
                for token in llm.submit(prompt, params):
                    times.append(time.perf_counter())
                    tokens.append(token)
                error = None if len(tokens) == max_tokens else f"{len(tokens)} tokens, expected {max_tokens}"
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
            records[i] = _record(len(prompt), start, times, tokens, error)

    threads = [threading.Thread(target=one_client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


# ---- summaries

def _percentile(values: list, q: float) -> Optional[float]:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def summarize(mode: str, records: list, clients: int) -> dict:
    ok = [r for r in records if r["error"] is None]
    wall = max(r["end"] for r in records) - min(r["start"] for r in records)
    tokens = sum(len(r["tokens"]) for r in records)
    ttft = [r["first"] - r["start"] for r in ok if r["first"] is not None]
    tpot = [(r["last"] - r["first"]) / (len(r["tokens"]) - 1) for r in ok if len(r["tokens"]) > 1]
    errors = [r["error"] for r in records if r["error"] is not None]
    return {"mode": mode, "clients": clients, "requests": len(records), "output_tokens": tokens,
            "wall_s": wall, "output_tokens_per_s": tokens / wall if wall > 0 else None,
            "requests_per_s": len(ok) / wall if wall > 0 else None,
            "ttft_p50_s": _percentile(ttft, 50), "ttft_p99_s": _percentile(ttft, 99),
            "tpot_p50_s": _percentile(tpot, 50), "tpot_p99_s": _percentile(tpot, 99),
            "errors": len(errors), "error_examples": sorted(set(errors))[:5]}


def table(runs: list) -> str:
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f} ms"

    lines = ["| path | clients | requests | output tokens | wall | tokens/s | requests/s | TTFT p50 | TTFT p99 "
             "| TPOT p50 | TPOT p99 | errors |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        rate = "-" if r["output_tokens_per_s"] is None else f"{r['output_tokens_per_s']:.1f}"
        per_s = "-" if r["requests_per_s"] is None else f"{r['requests_per_s']:.2f}"
        lines.append(f"| {r['mode']} | {r['clients']} | {r['requests']} | {r['output_tokens']} | {r['wall_s']:.2f} s | "
                     f"{rate} | {per_s} | {ms(r['ttft_p50_s'])} | {ms(r['ttft_p99_s'])} | {ms(r['tpot_p50_s'])} | "
                     f"{ms(r['tpot_p99_s'])} | {r['errors']} |")
    return "\n".join(lines)


# ---- the command

def _lengths(text: str) -> tuple:
    low, sep, high = text.partition(":")
    try:
        lengths = (int(low), int(high if sep else low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI token counts, got {text!r}") from None
    if not 1 <= lengths[0] <= lengths[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lengths


def parse_args(argv=None) -> argparse.Namespace:
    from mdsl.megakernel.runtime.models import MODELS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True,
                    help=f"a checkpoint folder, or one of {', '.join(MODELS)} (random weights, written to a temporary "
                         "folder)")
    ap.add_argument("--url", help="a server already running (default: start mdsl serve on a free port)")
    ap.add_argument("--api-key", help="the running server's API key")
    ap.add_argument("--device", choices=("cpu", "gpu", "megakernel"), default="cpu",
                    help="the started server's device (default cpu)")
    ap.add_argument("--clients", type=int, default=64, help="concurrent streaming clients (default 64)")
    ap.add_argument("--requests", type=int, help="requests in all (default 4 per client)")
    ap.add_argument("--prompt-len", type=_lengths, default=(16, 256), metavar="LO:HI",
                    help="prompt lengths in tokens, uniform (default 16:256)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens generated per request (default 128)")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' seed (default 0)")
    ap.add_argument("--offline", action="store_true",
                    help="also run the same requests through the engine in this process (after the server stopped)")
    ap.add_argument("--out", default=".", help="the folder for serve_http.json and serve_http.md (default .)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.max_tokens < 1 or (args.requests is not None and args.requests < 1):
        ap.error("--clients, --requests and --max-tokens must be positive")
    if args.url and args.offline and args.model in MODELS:
        ap.error("--offline compares with the running server's checkpoint: give its folder as --model")
    args.requests = args.requests or 4 * args.clients
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from benchmarks.provenance import provenance
    from mdsl.megakernel.modelgraph.model_config import load_config
    from mdsl.megakernel.runtime.models import MODELS

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with scratch_folder("serve_http-") as scratch_name:
        scratch = Path(scratch_name)
        folder = args.model
        if args.model in MODELS and not os.path.isdir(args.model):
            vocab = MODELS[args.model]["vocab_size"]
            if args.url is None:       # the server to start needs the weights
                folder = str(scratch / args.model)
                print(f"writing random weights at {args.model}'s shapes to {folder}", flush=True)
                random_checkpoint(args.model, folder)
        else:
            vocab = load_config(folder).vocab_size
        prompts = make_requests(vocab, args.requests, args.prompt_len, args.seed)
        max_seq = args.prompt_len[1] + args.max_tokens
        engine = {"max_batch": args.clients, "max_seq": max_seq, "device": args.device}
        runs = []
        server = None
        if args.url is None:
            server = ServerProcess(folder, scratch / "serve.log", "--device", args.device, "--max-batch",
                                   str(args.clients), "--max-seq", str(max_seq))
        try:
            http = asyncio.run(_http_run(args.url or server.url, args.api_key, prompts, args.max_tokens, args.clients))
        finally:
            if server is not None:
                code = server.stop()
                shutil.copy(server.log_path, out / "serve_http.server.log")
                if code != 0:
                    print(f"mdsl serve exited with {code}", file=sys.stderr)
        runs.append(summarize("HTTP (mdsl serve)", http, args.clients))
        print(table(runs), flush=True)
        result = {"schema": 1, "engine": engine, "prompt_len": list(args.prompt_len), "max_tokens": args.max_tokens,
                  "runs": runs}
        if args.offline:
            from mdsl import LLM

            with LLM(folder, **engine) as llm:
                offline = _offline_run(llm, prompts, args.max_tokens, args.clients)
            runs.append(summarize("offline (LLM.submit)", offline, args.clients))
            result["mismatched"] = sum(h["tokens"] != o["tokens"] for h, o in zip(http, offline)
                                       if h["error"] is None and o["error"] is None)
            if runs[0]["output_tokens_per_s"] and runs[1]["output_tokens_per_s"]:
                result["http_over_offline"] = runs[0]["output_tokens_per_s"] / runs[1]["output_tokens_per_s"]
        meta = provenance("serve_http.py", sys.argv[1:] if argv is None else argv, gpu=args.device != "cpu")
        (out / "serve_http.json").write_text(json.dumps({**result, "meta": meta}, indent=2))
        text = table(runs)
        if "http_over_offline" in result:
            text += (f"\n\nHTTP throughput / offline: {result['http_over_offline']:.3f}; requests whose tokens differ: "
                     f"{result['mismatched']}")
        (out / "serve_http.md").write_text(text + "\n")
        print(text)
        failed = any(r["errors"] for r in runs) or result.get("mismatched", 0)
        return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
