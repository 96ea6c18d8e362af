"""`mdsl generate`: run a Hugging Face checkpoint (Llama-3 or Qwen3) with the megakernel.

    mdsl generate --model DIR --prompt-ids 1,2,3 --max-new-tokens 32
    mdsl generate --model DIR --prompt "Once upon a time" --max-new-tokens 64 --temperature 0.7 --top-p 0.9
    mdsl generate --model DIR --prompt-ids 1,2,3 --max-new-tokens 8 --profile trace.json
    mdsl generate --model DIR --prompt-ids 1,2,3 --tp 2      # tensor parallel: one process per GPU

Text prompts need the folder's tokenizer.json and the `tokenizers` package. Prints the new token ids
(and their text when there is a tokenizer) and the device time per token. The arguments and the whole
checkpoint are checked (`check_request`) before a GPU is looked for: a mistake gets its own error on
any machine.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable

from mdsl.errors import CheckpointError, MdslError, ShapeError, UnsupportedError

EXIT_OK = 0


def _token_ids(text: str) -> list:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids such as 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("give at least one token id")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are not negative, got {min(ids)}")
    return ids


def _within(kind: type, accepts: Callable, expected: str):
    """An argparse type: `kind(text)`, accepted where `accepts(value)` holds, else "expected ..."."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


_COUNT = _within(int, lambda n: n >= 1, "a positive integer")
_TEMPERATURE = _within(float, lambda t: 0 <= t < math.inf, "a finite temperature >= 0 (0: greedy)")
_TOP_P = _within(float, lambda p: 0 < p <= 1, "a probability mass in (0, 1]")
_SEED = _within(int, lambda n: 0 <= n < 2**64, "an integer from 0 to 2**64 - 1")


def load_tokenizer(folder: str):
    """The folder's tokenizer.json through the `tokenizers` package, or None when either is missing."""
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:   # (the package raises its own exception types for a file it cannot read)
        raise CheckpointError(f"{path}: the `tokenizers` package cannot read it ({e})",
                              hint="download the model's tokenizer.json again, or remove it and pass --prompt-ids") \
            from None


def check_request(args: argparse.Namespace) -> tuple:
    """What `mdsl generate` is given, checked on the CPU before a GPU is looked for: the checkpoint
    (config.json's fields, the safetensors headers and index, every tensor's name, shape and dtype, no
    tensor unaccounted for; no tensor data is read), the prompt against the vocabulary, its length and
    the tokens to generate against the KV cache, the world size against the model, the profile's path.
    Returns (the opened checkpoint, the prompt's token ids, the tokenizer or None)."""
    from mdsl.megakernel.modelgraph.checkpoint import open_pretrained
    from mdsl.megakernel.modelgraph.model_config import DEFAULT_MAX_SEQ

    checkpoint = open_pretrained(args.model)
    config = checkpoint.config
    tokenizer = load_tokenizer(args.model)
    if args.prompt is not None:
        if tokenizer is None:
            raise UnsupportedError(f"a text prompt needs {os.path.join(args.model, 'tokenizer.json')} and the "
                                   "`tokenizers` package", hint="pip install tokenizers, or pass --prompt-ids")
        prompt_ids = tokenizer.encode(args.prompt).ids
        if not prompt_ids:
            raise ShapeError("the text prompt encodes to no tokens", hint="give a prompt that is not empty")
    else:
        prompt_ids = args.prompt_ids
    outside = [t for t in prompt_ids if not 0 <= t < config.vocab_size]
    if outside:
        raise ShapeError(f"prompt token ids {outside[:5]} are outside the vocabulary of {args.model} "
                         f"(0..{config.vocab_size - 1})", hint="take the ids from the model's tokenizer")
    if args.max_seq is not None and args.max_seq > config.max_positions:
        raise ShapeError(f"--max-seq {args.max_seq} is more positions than the model's max_position_embeddings "
                         f"({config.max_positions})", hint=f"give --max-seq {config.max_positions} at most")
    max_seq = args.max_seq or min(config.max_positions, DEFAULT_MAX_SEQ)
    if len(prompt_ids) + args.max_new_tokens > max_seq:
        raise ShapeError(f"{len(prompt_ids)} prompt tokens and {args.max_new_tokens} new ones need "
                         f"{len(prompt_ids) + args.max_new_tokens} positions; the KV cache has {max_seq}",
                         hint="generate fewer tokens (--max-new-tokens), or give a larger --max-seq (at most the "
                              f"model's {config.max_positions})")
    if args.tp > 1:
        from mdsl.megakernel.parallel.gpu_group import shard_config

        try:
            shard_config(config, args.tp)
        except ShapeError as e:   # (it names what does not split and the world sizes that do)
            raise ShapeError(f"--tp {args.tp}: {e.message}", hint=e.hint) from None
        if args.temperature > 0 and args.top_p < 1:
            raise UnsupportedError(f"nucleus sampling (--top-p {args.top_p}) is not implemented for tensor "
                                   "parallelism", hint="with --tp, sample at --top-p 1 or decode greedily")
    if args.profile is not None and (os.path.isdir(args.profile)
                                     or not os.path.isdir(os.path.dirname(os.path.abspath(args.profile)))):
        raise MdslError(f"--profile {args.profile}: not a file in an existing folder",
                        hint="name a .json file to write, in a folder that exists")
    return checkpoint, prompt_ids, tokenizer


def generate(args: argparse.Namespace) -> int:
    from mdsl.megakernel.runtime.megakernel_engine import MegakernelEngine, _require_gpu
    from mdsl.megakernel.runtime.profile import write_trace

    _, prompt_ids, tokenizer = check_request(args)
    _require_gpu()
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
    from mdsl.megakernel.parallel.gpu_group import TensorParallelGroup, engine_info, join_launched, launched_rank
    from mdsl.megakernel.runtime.profile import write_rank_traces, write_trace

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
        "generate", help="generate tokens from a Llama-3, Qwen3, Qwen2, Mistral or Phi-3 checkpoint with the megakernel "
                                "(needs a GPU)",
        description="Load a Hugging Face checkpoint folder (config.json, *.safetensors), prefill the prompt and "
                    "decode inside one launch of mdsl's persistent megakernel, and print the new token ids.")
    gen.add_argument("--model", required=True, metavar="DIR", help="the checkpoint folder")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="comma-separated token ids: 1,2,3")
    prompt.add_argument("--prompt", metavar="TEXT", help="a text prompt (needs tokenizer.json and `tokenizers`)")
    gen.add_argument("--max-new-tokens", type=_COUNT, default=32, metavar="N", help="tokens to generate (default 32)")
    gen.add_argument("--temperature", type=_TEMPERATURE, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-p", type=_TOP_P, default=1.0, help="nucleus sampling's probability mass (default 1)")
    gen.add_argument("--seed", type=_SEED, default=0, help="the sampling seed (default 0)")
    gen.add_argument("--max-seq", type=_COUNT, metavar="N", help="KV cache positions (default: the model's, at most 4096)")
    gen.add_argument("--profile", metavar="TRACE.json", help="write a Perfetto trace of every task of the run")
    gen.add_argument("--tp", type=_COUNT, default=1, metavar="N",
                     help="tensor parallelism over N GPUs of this host (one process each, NVSHMEM between them)")
    gen.set_defaults(run=generate)

