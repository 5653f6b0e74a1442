"""Speculative decoding through the decode scheduler's real loop (CPU, fp32) on a random target,
with the draft's proposals replaced by the plain run's own continuation, corrupted at random: every
accepted length from none to the whole block occurs (a random draft is almost never accepted), and
the output must equal plain greedy decoding token for token. DFLASH and DSPARK (whose confidence
cut keeps what the real draft chose); pages of 1 and 16 tokens; prompts longer than index_topk.

From a held-out sweep (thirty-eighth session: 335 runs of random targets with random drafts or MTP
layers, 180 of them with proposals replaced like this, every one equal to plain decoding); this
keeps two of its shapes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from glm53.models.draft_checkpoint import write_random_draft
from glm53.models.dspark import BlockChoice
from glm53.server.engine.decode import DecodeScheduler
from glm53.support.decode_loop import decode_run, scheduler
from glm53.support.oracle import make_checkpoint

VOCAB = 158  # prompt and corruption ids stay below the oracle's vocabulary
TARGET = dict(num_hidden_layers=4, hidden_size=48, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=24,
              q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=16, index_head_dim=32,
              index_n_heads=16, index_topk=8, index_topk_freq=2, index_skip_topk_offset=1, n_routed_experts=8,
              n_group=2, topk_group=2, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
              moe_intermediate_size=32)
# (the algorithm follows the draft: DSPARK for one with a Markov head; `threshold` is its cut)
CASES = {
    "dflash-page1": dict(page=1, block=6, markov_rank=0, confidence=False, threshold=0.0),
    "dspark-cut-page16": dict(page=16, block=5, markov_rank=4, confidence=True, threshold=0.3),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("partial") / "target"
    make_checkpoint(d, seed=773, **TARGET)
    return d


def _teach(sched: DecodeScheduler, prompts: list[list[int]], want: list[list[int]], corrupt: float,
           accepted: list[int]) -> None:
    """Replace the runner's proposals with `want`'s continuation (each token wrong with p =
    `corrupt`) and record every request's accepted length per step. A request is known by its
    first page (decode_run allocates in prompt order)."""
    room_of, alloc = {}, sched.allocator.alloc

    def record(n):
        pages = alloc(n)
        room_of[int(pages[0])] = len(room_of)
        return pages

    sched.allocator.alloc = record
    runner = sched.workers.rank.runner
    propose, step = runner.draft_block, runner.spec_step
    rng = random.Random(0)

    def draft_block(blocks):
        choice = propose(blocks)
        tokens = choice.tokens.clone()
        for j, b in enumerate(blocks):
            room = room_of[int(b.page_table[0])]
            seq = prompts[room] + want[room]
            for t in range(tokens.shape[1]):
                pos = b.start_pos + 1 + t
                x = seq[pos] if pos < len(seq) else rng.randrange(VOCAB)
                tokens[j, t] = (x + 1 + rng.randrange(VOCAB - 2)) % VOCAB if rng.random() < corrupt else x
        return BlockChoice(tokens, choice.keep, choice.probs)

    def spec_step(blocks):
        out = step(blocks)
        for d, g in zip(out.drafts, out.greedy):
            accepted.append(next((i for i, (a, b) in enumerate(zip(d, g)) if a != b), len(d)))
        return out

    runner.draft_block, runner.spec_step = draft_block, spec_step


@pytest.mark.parametrize("case", list(CASES))
def test_every_accepted_length_keeps_greedy_output(target, tmp_path, case):
    torch.set_num_threads(1)
    c = CASES[case]
    draft = write_random_draft(tmp_path / "draft", target, seed=774, dtype=torch.float32, n_layers=2,
                               block_size=c["block"], num_heads=2, num_kv_heads=1, head_dim=16, intermediate_size=32,
                               target_layer_ids=[0, 2, 3], markov_rank=c["markov_rank"],
                               confidence_head=c["confidence"])
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 29, 47)]
    new = 24
    plain = scheduler(target, None, "cpu", None, graphs=False, max_running=4, page_size=c["page"])
    try:
        _, _, _, want = decode_run(plain, prompts, new, running=2)
    finally:
        plain.close()
    accepted: list[int] = []
    sched = scheduler(target, draft, "cpu", None, graphs=False, max_running=4, threshold=c["threshold"],
                      page_size=c["page"])
    try:
        _teach(sched, prompts, want, 0.3, accepted)
        _, toks, verify, got = decode_run(sched, prompts, new, running=2)
    finally:
        sched.close()
    assert got == want
    # the test's point: rejections at the first draft and whole blocks accepted both happened
    assert 0 in accepted and max(accepted) >= c["block"] - 2, sorted(set(accepted))
    assert toks > verify  # more than one token a verify on average
