import random

import pytest
import torch

from glm53.models.config import GlmConfig
from glm53.models.kv_cache import KVPools, OutOfPages, PageAllocator, kv_bytes_per_token, runs, target_pools


def test_allocator_prefers_one_contiguous_extent():
    a = PageAllocator(100)
    x = a.alloc(10)
    assert x == list(range(10))
    y = a.alloc(5)
    a.free(x)
    z = a.alloc(8)  # best fit: the freed 10-page hole, not the tail
    assert runs(z) == [(0, 8)]
    assert a.num_free == 100 - 13
    a.free(y)
    a.free(z)
    assert a.extents == [(0, 100)]


def test_allocator_splits_only_when_no_extent_fits_and_never_leaks():
    a = PageAllocator(64)
    held = [a.alloc(1) for _ in range(64)]
    for h in held[::2]:
        a.free(h)
    got = a.alloc(10)
    assert len(set(got)) == 10 and a.num_free == 22
    with pytest.raises(OutOfPages):
        a.alloc(23)
    with pytest.raises(ValueError):
        a.free([got[0], got[0]])
    a.free(got)
    for h in held[1::2]:
        a.free(h)
    assert a.extents == [(0, 64)] and a.num_free == 64


def test_allocator_random_churn_keeps_invariants():
    rng = random.Random(0)
    a = PageAllocator(500)
    live: list[list[int]] = []
    for _ in range(2000):
        if live and (rng.random() < 0.5 or a.num_free < 50):
            a.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(a.alloc(rng.randint(1, 40)))
        used = [p for pg in live for p in pg]
        assert len(used) == len(set(used)) and a.num_free == 500 - len(used)
    for pg in live:
        a.free(pg)
    assert a.extents == [(0, 500)]


def test_pool_is_page_major_and_views_are_strided():
    pools = KVPools(num_pages=6, page_size=4)
    pools.add("latent", (3, 4, 5), (8,), torch.float32)
    pools.add("index_k", (3, 5), (5,), torch.float32)
    latent, index_k = pools["latent"].tensor, pools["index_k"].tensor
    assert latent.shape == (6, 3, 4, 8) and index_k.shape == (6, 2, 4, 5)
    v = pools.view("latent", 4)
    slots = torch.tensor([1, 9, 22])
    vals = torch.randn(3, 8)
    v[slots // 4, slots % 4] = vals  # as the layers store a row (`kv_rows.store_rows`)
    assert torch.equal(latent[2, 1, 1], vals[1])  # slot 9 = page 2, offset 1, layer 4 -> index 1
    assert torch.equal(latent[5, 1, 2], vals[2])
    # One page of every layer is one contiguous block (what the transfer sends per page run).
    assert latent[2].is_contiguous() and latent[2:5].is_contiguous()


def test_pools_registry_names_order_views_and_bytes():
    pools = KVPools(num_pages=5, page_size=4)
    pools.add("latent", range(2, 6), (8,), torch.bfloat16)
    pools.add("index_k", (2, 3), (5,), torch.float32)
    pools.add("draft_kv", (0, 1), (2, 3), torch.float16)  # a per-token shape of (heads, head_dim)
    assert [n for n, _ in pools] == ["latent", "index_k", "draft_kv"] and len(pools) == 3
    assert pools["draft_kv"].tensor.shape == (5, 2, 4, 2, 3) and pools["latent"].layers == (2, 3, 4, 5)
    assert pools.bytes_per_page() == 4 * (4 * 8 * 2 + 2 * 5 * 4 + 2 * 6 * 2)
    vals = torch.randn(2, 2, 3)
    pools.view("draft_kv", 1)[torch.tensor([0, 1]), torch.tensor([3, 2])] = vals.half()  # slots 3 and 6
    assert torch.equal(pools["draft_kv"].tensor[1, 1, 2], vals[1].half())
    with pytest.raises(ValueError, match="already registered"):
        pools.add("latent", (0,), (8,), torch.bfloat16)
    with pytest.raises(KeyError, match="no pool 'nope'"):
        pools["nope"]
    with pytest.raises(KeyError, match="holds no layer 4"):
        pools.view("index_k", 4)


def test_target_pools_follow_the_indexer_schedule_and_register_by_name():
    from glm53.transport.buffers import BufferSpec, BufferTable

    cfg = GlmConfig.from_dict({
        "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "moe_intermediate_size": 8,
        "num_hidden_layers": 6, "num_attention_heads": 2, "q_lora_rank": 8, "kv_lora_rank": 12,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4, "index_head_dim": 6,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "index_topk_freq": 2, "index_skip_topk_offset": 2,
    })  # full layers 0, 1, 3, 5
    pools = target_pools(cfg, range(1, 4), num_pages=7, page_size=4, dtype=torch.bfloat16)
    assert [(n, p.layers, p.per_token) for n, p in pools] == [("latent", (1, 2, 3), (16,)), ("index_k", (1, 3), (6,))]
    # The caller's pattern: every pool goes to the transfer layer's buffer table by name.
    table = BufferTable(tuple(BufferSpec.for_tensor(n, p.tensor, p.layers) for n, p in pools))
    assert {b.name: b.layers for b in table.buffers} == {"latent": (1, 2, 3), "index_k": (1, 3)}
    # A stage of shared layers only owns no indexer keys.
    assert [n for n, _ in target_pools(cfg, range(2, 3), 7, 4, torch.bfloat16)] == ["latent"]
    assert kv_bytes_per_token(cfg, torch.bfloat16, range(1, 4)) == (3 * 16 + 2 * 6) * 2
    assert kv_bytes_per_token(cfg, torch.float32) == (6 * 16 + 4 * 6) * 4


def test_fp8_target_pools_are_bytes_and_the_buffer_table_sees_the_real_row():
    from glm53.models.kv_cache import FP8
    from glm53.transport.buffers import BufferSpec
    from tests.models.glm5_config import GLM5

    cfg = GlmConfig.from_dict({**GLM5, "num_hidden_layers": 4, "index_topk_freq": 4, "index_skip_topk_offset": 3})
    pools = target_pools(cfg, range(4), num_pages=3, page_size=64, dtype=torch.bfloat16, device="meta", kv_dtype=FP8)
    specs = {n: BufferSpec.for_tensor(n, p.tensor, p.layers) for n, p in pools}
    assert (specs["latent"].bytes_per_token, specs["latent"].dtype) == (656, "uint8")
    assert (specs["index_k"].bytes_per_token, specs["index_k"].item_bytes) == (132, 3 * 8448)  # layers 0-2 full
    assert kv_bytes_per_token(cfg, torch.bfloat16, kv_dtype=FP8) == 4 * 656 + 3 * 132
    with pytest.raises(ValueError, match="model dtype or FP8"):
        target_pools(cfg, range(4), 3, 64, torch.bfloat16, device="meta", kv_dtype=torch.float32)


def test_batch_splits_its_slots_once():
    # every layer's KV write takes the batch's (page, offset) split: computed once, on first use
    from glm53.models.model import ForwardBatch

    slots = torch.randint(0, 1000, (37,))
    b = ForwardBatch(input_ids=slots, positions=slots, out_slots=slots, page_table=slots[:, None].int(),
                     context_lens=slots.int(), max_context=1000)
    page, off = b.out_coords(16)
    assert torch.equal(page, slots // 16) and torch.equal(off, slots % 16)
    assert b.out_coords(16)[0] is page and b.out_coords(64)[0] is not page
