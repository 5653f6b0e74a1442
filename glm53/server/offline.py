"""`glm53-serve generate`: offline greedy generation for token-id prompts, as one batch.

Prints one JSON line per prompt, in prompt order: {"index", "input_ids", "output_ids"} where
`output_ids` are the generated tokens only. Logs go to stderr; no tokenizer is needed. `--model`
takes what `up` takes: a model directory or an embedded name (`embedded:tiny-glm5`, installed on
first use); one that is neither is a one-line error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

import torch

from glm53.models import GlmConfig, ModelRunner, PageAllocator, SeqChunk
from glm53.models.config import ConfigError as ModelConfigError
from glm53.models.weights import WeightError
from glm53.server.embedded_model import resolve_model_path

log = logging.getLogger(__name__)


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--input-ids expects comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--input-ids must hold at least one token id")
    return ids


def add_generate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "--model-path", dest="model", required=True,
                   help="model directory (HF layout) or an embedded name (embedded:tiny-glm5)")
    p.add_argument("--input-ids", dest="input_ids", type=parse_ids, action="append", required=True,
                   help="comma-separated prompt token ids; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                   help="the KV cache: the model dtype (auto) or the FP8 layouts")


def greedy_generate(
    runner: ModelRunner,
    allocator: PageAllocator,
    prompts: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = False,
) -> list[list[int]]:
    """Batched greedy decoding through the paged cache (a single-stage runner); pages come from
    `allocator`, which hands out ids of `runner.pools`, and are freed at the end."""
    vocab = runner.cfg.vocab_size
    for p in prompts:
        if any(not 0 <= t < vocab for t in p):
            raise ValueError(f"token ids must be in [0, {vocab})")
    eos = set() if ignore_eos else set(runner.cfg.eos_token_ids)
    pages = [allocator.alloc(runner.pages_needed(len(p) + max_new_tokens)) for p in prompts]
    try:
        outputs: list[list[int]] = [[] for _ in prompts]
        if max_new_tokens <= 0:
            return outputs
        logits = runner.forward([SeqChunk(p, 0, pg) for p, pg in zip(prompts, pages)])
        live = []
        for i, lg in enumerate(logits):
            tok = int(torch.argmax(lg[-1]))
            outputs[i].append(tok)
            if tok not in eos and max_new_tokens > 1:
                live.append(i)
        while live:
            chunks = [SeqChunk([outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, pages[i]) for i in live]
            logits = runner.forward(chunks)
            still = []
            for i, lg in zip(live, logits):
                tok = int(torch.argmax(lg[-1]))
                outputs[i].append(tok)
                if tok not in eos and len(outputs[i]) < max_new_tokens:
                    still.append(i)
            live = still
        return outputs
    finally:
        for pg in pages:
            allocator.free(pg)


def run_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        print("error: --max-new-tokens must be >= 0", file=sys.stderr)
        return 2
    if args.page_size < 1:
        print("error: --page-size must be >= 1", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {args.device}: no CUDA device on this host", file=sys.stderr)
        return 2
    # Check lengths against config.json before loading any weights.
    try:
        model_dir = resolve_model_path(args.model)
        max_len = GlmConfig.from_dir(model_dir).max_position_embeddings
    except (FileNotFoundError, ModelConfigError) as e:
        print(f"error: --model {args.model}: {e}", file=sys.stderr)
        return 2
    longest = max(len(p) for p in args.input_ids) + args.max_new_tokens
    if longest > max_len:
        print(f"error: prompt + max_new_tokens ({longest}) exceeds max_position_embeddings", file=sys.stderr)
        return 2
    num_pages = sum(-(-(len(p) + args.max_new_tokens) // args.page_size) for p in args.input_ids)
    num_pages = max(1, num_pages)
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8_e4m3" else None
    try:
        runner = ModelRunner.from_dir(model_dir, page_size=args.page_size, num_pages=num_pages, device=args.device,
                                      kv_dtype=kv_dtype)
    except (FileNotFoundError, ModelConfigError, WeightError) as e:  # e.g. a directory without weights
        print(f"error: --model {args.model}: {e}", file=sys.stderr)
        return 2
    try:
        outs = greedy_generate(runner, PageAllocator(num_pages), args.input_ids, args.max_new_tokens, args.ignore_eos)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, (p, o) in enumerate(zip(args.input_ids, outs)):
        print(json.dumps({"index": i, "input_ids": p, "output_ids": o}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(prog="glm53-serve generate")
    add_generate_args(p)
    return run_generate(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
