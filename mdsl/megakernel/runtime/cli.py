"""`mdsl generate`: run a Hugging Face checkpoint (Llama-3 or Qwen3) with the megakernel.

    mdsl generate --model DIR --prompt-ids 1,2,3 --max-new-tokens 32
    mdsl generate --model DIR --prompt "Once upon a time" --max-new-tokens 64 --temperature 0.7 --top-p 0.9
    mdsl generate --model DIR --prompt-ids 1,2,3 --max-new-tokens 8 --profile trace.json
    mdsl generate --model DIR --prompt-ids 1,2,3 --tp 2      # tensor parallel: one process per GPU

Text prompts need the folder's tokenizer.json and the `tokenizers` package. Prints the new token ids
(and their text when there is a tokenizer) and the device time per token.
"""
from __future__ import annotations

import argparse
import os
import sys

from mdsl.errors import UnsupportedError

EXIT_OK = 0


def _token_ids(text: str) -> list:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("give at least one token id")
    return ids


def load_tokenizer(folder: str):
    """The folder's tokenizer.json through the `tokenizers` package, or None when either is missing."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_file(path)


def generate(args: argparse.Namespace) -> int:
    from mdsl.megakernel.runtime.engine import MegakernelEngine
    from mdsl.megakernel.runtime.profile import write_trace

    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise UnsupportedError(f"a text prompt needs {os.path.join(args.model, 'tokenizer.json')} and the "
                                   "`tokenizers` package", hint="pip install tokenizers, or pass --prompt-ids")
        prompt_ids = tokenizer.encode(args.prompt).ids
    else:
        prompt_ids = args.prompt_ids
    options = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed, profile=args.profile is not None)
    if args.tp > 1:
        return _generate_tensor_parallel(args, prompt_ids, tokenizer, options)
    engine = MegakernelEngine.from_pretrained(args.model, max_seq=args.max_seq)
    run = engine.run(prompt_ids, args.max_new_tokens, **options)
    print(",".join(map(str, run.tokens)))
    if tokenizer is not None:
        print(tokenizer.decode(list(run.tokens)))
    print(f"{len(run.tokens)} new token(s), {run.steps} step(s) in one launch: {run.seconds * 1e3:.3f} ms, "
          f"{run.seconds / max(1, run.steps) * 1e6:.1f} us per step", file=sys.stderr)
    if args.profile is not None:
        plan = engine.plan
        write_trace(args.profile, run.profile, [t.label() for t in plan.tasks], [t.kind.name.lower() for t in plan.tasks])
        print(f"profile of {len(run.profile)} tasks written to {args.profile} (open it at ui.perfetto.dev)",
              file=sys.stderr)
    return EXIT_OK


def _generate_tensor_parallel(args, prompt_ids, tokenizer, options) -> int:
    from mdsl.megakernel.runtime.profile import write_rank_traces, write_trace
    from mdsl.megakernel.runtime.tp import TensorParallelGroup, engine_info, join_launched, launched_rank

    if launched_rank() is not None:   # torchrun / mpirun started this process as one rank: run it, rank 0 prints
        group = TensorParallelGroup.spec_from_pretrained(args.model, args.tp, max_seq=args.max_seq)
        engine = join_launched(group)
        run = engine.run(prompt_ids, args.max_new_tokens, **options)
        info, rank = engine_info(engine), engine.ranks.rank
        if args.profile is not None:   # one trace per rank: NAME.rankR.json
            stem, dot, ext = args.profile.rpartition(".")
            write_trace(f"{stem}.rank{rank}.{ext}" if dot else f"{args.profile}.rank{rank}", run.profile,
                        info["labels"], info["kinds"])
        engine.close()
        engine.ranks.pe.close()
        if rank == 0:
            print(",".join(map(str, run.tokens)))
            if tokenizer is not None:
                print(tokenizer.decode(list(run.tokens)))
        return EXIT_OK
    with TensorParallelGroup.from_pretrained(args.model, args.tp, max_seq=args.max_seq) as group:
        runs = group.run(prompt_ids, args.max_new_tokens, **options)
        info = group.info[0]
    run = runs[0]
    print(",".join(map(str, run.tokens)))
    if tokenizer is not None:
        print(tokenizer.decode(list(run.tokens)))
    slowest = max(r.seconds for r in runs)
    print(f"{len(run.tokens)} new token(s), {run.steps} step(s) in one launch per GPU on {args.tp} GPUs: "
          f"{slowest * 1e3:.3f} ms, {slowest / max(1, run.steps) * 1e6:.1f} us per step", file=sys.stderr)
    if args.profile is not None:
        write_rank_traces(args.profile, [r.profile for r in runs], info["labels"], info["kinds"], info["peers"])
        print(f"profile of {args.tp} ranks written to {args.profile} (open it at ui.perfetto.dev)", file=sys.stderr)
    return EXIT_OK


def add_generate_command(commands) -> None:
    """The `generate` subcommand, added to mdsl's command line (mdsl/cli.py)."""
    gen = commands.add_parser(
        "generate", help="generate tokens from a Llama-3 / Qwen3 checkpoint with the megakernel (needs a GPU)",
        description="Load a Hugging Face checkpoint folder (config.json, *.safetensors), prefill the prompt and "
                    "decode inside one launch of mdsl's persistent megakernel, and print the new token ids.")
    gen.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="comma-separated token ids: 1,2,3")
    prompt.add_argument("--prompt", metavar="TEXT", help="a text prompt (needs tokenizer.json and `tokenizers`)")
    gen.add_argument("--max-new-tokens", type=int, default=32, metavar="N", help="tokens to generate (default 32)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default 1)")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    gen.add_argument("--max-seq", type=int, metavar="N", help="KV cache positions (default: the model's, at most 4096)")
    gen.add_argument("--profile", metavar="TRACE.json", help="write a Perfetto trace of every task of the run")
    gen.add_argument("--tp", type=int, default=1, metavar="N",
                     help="tensor parallelism over N GPUs of this host (one process each, NVSHMEM between them)")
    gen.set_defaults(run=generate)

