"""`mdsl serve`: the OpenAI-compatible HTTP server over a checkpoint (needs the `serve` extra).

    mdsl serve --model DIR                                   # http://127.0.0.1:8000/v1
    mdsl serve --model DIR --host 0.0.0.0 --port 8000 --max-batch 64 --api-key KEY
    mdsl serve --model DIR --port 0                          # a free port, printed on stdout
    mdsl serve --model DIR --device megakernel               # every step in one resident kernel on the GPU

The served model's name is the folder's name. Once the engine is loaded and the port is listening, one
line on stdout says where: `mdsl serve: MODEL at http://HOST:PORT/v1 (...)`.
"""
from __future__ import annotations

import argparse
import os
import signal
import socket

from mdsl.errors import UnsupportedError
from mdsl.serving.engine import DEVICES

EXIT_OK = 0
INSTALL_HINT = "pip install 'mdsl[serve]'"


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in [0, 65535], got {value}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number of seconds, got {text}")
    return value


def _listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one); connections wait in its backlog until the
    server accepts them."""
    from mdsl.serving import ServingError

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host, port), family=family)
    except OSError as e:
        raise ServingError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                           hint="choose another --port (0 picks a free one) or --host") from None
    return sock


def serve(args: argparse.Namespace) -> int:
    try:
        import jinja2  # noqa: F401
        import prometheus_client
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise UnsupportedError(f"mdsl serve needs the package {e.name}, which is not installed",
                               hint=INSTALL_HINT) from None
    from mdsl.server.api import ServedModel
    from mdsl.server.app import create_app
    from mdsl.server.chat import ChatTemplate
    from mdsl.serving import LLM, ServingError

    if args.gpu_memory_fraction is not None and args.device != "gpu":
        # (refused before the checkpoint is loaded: only the GPU device sizes its pool from the GPU's memory)
        raise ServingError(f"--gpu-memory-fraction sizes the GPU device's KV cache; --device {args.device} takes "
                           "its size from --kv-cache-bytes (default: room for every batch slot at --max-seq)",
                           hint="pass --device gpu, or --kv-cache-bytes BYTES instead")
    prometheus_client.disable_created_metrics()     # no *_created sample beside every counter and histogram
    template = ChatTemplate.load(args.model) if os.path.isdir(args.model) else None
    sock = _listen(args.host, args.port)
    try:
        llm = LLM(args.model, max_batch=args.max_batch, max_seq=args.max_seq, kv_cache_bytes=args.kv_cache_bytes,
                  device=args.device, gpu_memory_fraction=args.gpu_memory_fraction)
    except BaseException:
        sock.close()
        raise
    name = os.path.basename(os.path.normpath(os.path.abspath(args.model)))
    model = ServedModel(name, llm, template)
    app = create_app(model, api_key=args.api_key, shutdown_timeout=args.shutdown_timeout)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    print(f"mdsl serve: {name} at http://{shown}:{port}/v1 (device {args.device}, max_batch {llm.shape.max_batch}, "
          f"max_seq {llm.shape.max_seq}, {llm.shape.num_pages} KV pages of {llm.shape.page_size} tokens"
          f"{', chat template' if template else ''}{', API key' if args.api_key else ''})", flush=True)
    server = _uvicorn_server(uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=args.shutdown_timeout + 5))
    # Until uvicorn's own handlers are in place (and after it restores these and re-raises the signal it
    # caught, so that the previous handler sees it), a signal asks the server to exit; the command exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
    try:
        server.run(sockets=[sock])
    finally:
        llm.close()
        sock.close()
    return EXIT_OK


def _uvicorn_server(config):
    """uvicorn's server, whose signal handler also starts the app's drain (mdsl.server.app.Server.drain)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            state = self.config.app.state.server
            if state.loop is not None and not state.loop.is_closed():
                state.loop.call_soon_threadsafe(state.drain)

    return Server(config)


def add_serve_command(commands) -> None:
    """The `serve` subcommand, added to mdsl's command line (mdsl/cli.py)."""
    cmd = commands.add_parser(
        "serve", help="serve a Llama-3 / Qwen3 checkpoint over HTTP with the OpenAI API",
        description="Load a Hugging Face checkpoint folder into the serving engine (continuous batching, paged KV "
                    "cache) and serve it with the OpenAI API: /v1/completions, /v1/chat/completions (the "
                    "checkpoint's chat template), /v1/models, /health and /metrics (Prometheus). Needs "
                    f"the serve extra ({INSTALL_HINT}); text prompts need the folder's tokenizer.json.")
    cmd.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder; its name is the model's")
    cmd.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    cmd.add_argument("--port", type=_port, default=8000, help="the port (default 8000; 0: a free one, printed)")
    cmd.add_argument("--device", choices=DEVICES, default="cpu",
                     help="cpu (numpy, for small checkpoints; the default), gpu (the scheduler on the host, each "
                          "step's kernels on the GPU) or megakernel (the scheduler and every step in one resident "
                          "kernel on the GPU)")
    cmd.add_argument("--max-batch", type=_positive_int, default=64, metavar="N",
                     help="requests decoded together (default 64)")
    cmd.add_argument("--max-seq", type=_positive_int, metavar="N",
                     help="positions per request, prompt and completion (default: the model's, at most 4096)")
    cmd.add_argument("--kv-cache-bytes", type=_positive_int, metavar="BYTES",
                     help="the KV-cache page pool's size (default: room for every batch slot at max-seq)")
    cmd.add_argument("--gpu-memory-fraction", type=float, metavar="F",
                     help="with --device gpu only: the share of the GPU's memory the engine may take; the KV cache "
                          "gets what the weights and activations leave of it")
    cmd.add_argument("--api-key", default=os.environ.get("MDSL_API_KEY"), metavar="KEY",
                     help="the key /v1/ requests must send as 'Authorization: Bearer KEY' (default: "
                          "$MDSL_API_KEY; unset: no key)")
    cmd.add_argument("--shutdown-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                     help="on SIGTERM/SIGINT, how long running requests may finish before they are cancelled "
                          "(default 30)")
    cmd.set_defaults(run=serve)
