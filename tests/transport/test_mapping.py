"""Exhaustive pure tests of the buffer table and TP/PP shard mapping (no I/O)."""

import itertools

import numpy as np
import pytest

from glm53.transport.buffers import (BufferSpec, BufferTable, Heads, MetadataRow,
                                     TableMismatch, check_tables)
from glm53.transport.mapping import (Segment, count_descriptors, page_runs, plan_transfers,
                                     segment_descs)

PAGE = 2
N_LAYERS = 7
LAT_BPT = 3
IDX_BPT = 2
DRAFT_LAYERS = (100, 101)
BPH = 2
FULL = (0, 1, 3, 5)  # indexer ("full") layers


def stage_layers(pp):
    return [tuple(int(x) for x in a) for a in np.array_split(np.arange(N_LAYERS), pp)]


def heads_spec(name, layers, total, tp):
    pr = max(1, total // tp)
    return BufferSpec(name, layers, pr * BPH, PAGE, "bfloat16", Heads(total, pr, BPH))


def prefill_tables(pp, tp, heads):
    out = []
    for s, ls in enumerate(stage_layers(pp)):
        specs = [BufferSpec("latent", ls, LAT_BPT, PAGE, "bfloat16"),
                 BufferSpec("index_k", tuple(l for l in ls if l in FULL), IDX_BPT, PAGE, "uint8")]
        if s == pp - 1:
            specs += [heads_spec("draft_k", DRAFT_LAYERS, heads, tp),
                      heads_spec("draft_v", DRAFT_LAYERS, heads, tp)]
        out.append(BufferTable.of(*specs))
    return out


def decode_table(tp, heads):
    return BufferTable.of(BufferSpec("latent", tuple(range(N_LAYERS)), LAT_BPT, PAGE, "bfloat16"),
                          BufferSpec("index_k", FULL, IDX_BPT, PAGE, "uint8"),
                          heads_spec("draft_k", DRAFT_LAYERS, heads, tp),
                          heads_spec("draft_v", DRAFT_LAYERS, heads, tp))


BUF_ID = {"latent": 1, "index_k": 2, "draft_k": 3, "draft_v": 4}


def item_labels(spec: BufferSpec, tp: int, rank: int) -> np.ndarray:
    """Label of every byte of one page item: (buffer, layer, global head, token, byte)."""
    if isinstance(spec.shard, Heads):
        h0, h1 = spec.shard.head_range(tp, rank)
        heads, unit = range(h0, h1), spec.shard.bytes_per_head
    else:
        heads, unit = range(1), spec.bytes_per_token
    lab = np.empty((len(heads), spec.n_layers, spec.page_size, unit), dtype=np.int64)
    for i, h in enumerate(heads):
        for j, l in enumerate(spec.layers):
            for t in range(spec.page_size):
                base = (((BUF_ID[spec.name] * 1000 + l) * 100 + h) * 10 + t) * 10
                lab[i, j, t] = base + np.arange(unit)
    return lab.reshape(-1)


CASES = list(itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8, 16, 64], [1, 2, 3, 4]))


@pytest.mark.parametrize("ptp,dtp,heads,pp", CASES)
def test_mapping_places_every_byte_once(ptp, dtp, heads, pp):
    pst = prefill_tables(pp, ptp, heads)
    dt = decode_table(dtp, heads)
    plan = plan_transfers(pst, ptp, dt, dtp)
    src = {(s, t, b.name): item_labels(b, ptp, t)
           for s in range(pp) for t in range(ptp) for b in pst[s].buffers}
    written = {(d, b.name): np.full(b.item_bytes, -1, dtype=np.int64)
               for d in range(dtp) for b in dt.buffers}
    count = {k: np.zeros(v.size, dtype=np.int64) for k, v in written.items()}
    load = {}  # (buffer, stage) -> {src: n dsts}
    for (s, t, d), segs in plan.routes.items():
        assert segs, "empty routes must not be listed"
        for seg in segs:
            assert seg.length > 0
            sl = src[(s, t, seg.buffer)]
            assert seg.src_item == sl.size and seg.src_off + seg.length <= sl.size
            w = written[(d, seg.buffer)]
            assert seg.dst_item == w.size and seg.dst_off + seg.length <= w.size
            w[seg.dst_off:seg.dst_off + seg.length] = sl[seg.src_off:seg.src_off + seg.length]
            count[(d, seg.buffer)][seg.dst_off:seg.dst_off + seg.length] += 1
        for name in {seg.buffer for seg in segs}:
            load.setdefault((name, s), {}).setdefault(t, set()).add(d)
    for d in range(dtp):
        for b in dt.buffers:
            np.testing.assert_array_equal(written[(d, b.name)], item_labels(b, dtp, d))
            assert (count[(d, b.name)] == 1).all(), "a destination byte is written twice"
    # Replicated buffers: each (stage, dst) served by one source; sources spread evenly.
    for name in ("latent", "index_k"):
        for s in range(pp):
            if not pst[s][name].layers:
                continue
            per_src = load[(name, s)]
            n = [len(v) for v in per_src.values()]
            assert sum(n) == dtp
            assert len(per_src) == min(ptp, dtp)
            assert max(n) - min(n) <= 1
    # Head-sharded: no source serves more destinations than the fair share (+1).
    for name in ("draft_k", "draft_v"):
        per_src = load[(name, pp - 1)]
        if ptp > 1 and dtp > 1:
            assert len(per_src) > 1, "all from one source"
    # Metadata writer is a last-stage rank; the receiver's expected senders include it.
    for d in range(dtp):
        w = plan.meta_writer[d]
        assert w[0] == pp - 1 and w in plan.senders_for(d)
        for (s, t) in plan.senders_for(d):
            assert d in plan.receivers_for(s, t)
    # Equal layouts collapse to whole-item segments (coalescable across page runs).
    if pp == 1 and ptp == 1 and dtp == 1:
        assert all(seg.whole for seg in plan.routes[(0, 0, 0)])


def test_descriptor_counts_page_major_vs_per_page():
    # GLM-5 shaped, pp=1, tp 1 -> 1: one descriptor per buffer per contiguous run.
    lat = BufferSpec("latent", tuple(range(78)), 1152, 64, "bfloat16")
    idx = BufferSpec("index_k", tuple(range(0, 78, 2)), 132, 64, "uint8")
    t = BufferTable.of(lat, idx)
    plan = plan_transfers([t], 1, t, 1)
    segs = plan.segments(0, 0, 0)
    src = np.arange(512)
    dst = np.concatenate([np.arange(1000, 1200), np.arange(50, 250), np.arange(3000, 3112)])
    assert page_runs(src, dst).shape[0] == 3
    assert count_descriptors(segs, src, dst) == 2 * 3
    assert count_descriptors(segs, src, dst, coalesce=False) == 2 * 512
    # Two stages into one decode pool: per-page descriptors (partial items), never per layer.
    st = [BufferTable.of(BufferSpec("latent", tuple(range(39)), 1152, 64, "bfloat16")),
          BufferTable.of(BufferSpec("latent", tuple(range(39, 78)), 1152, 64, "bfloat16"))]
    dt = BufferTable.of(lat)
    plan = plan_transfers(st, 1, dt, 1)
    for s in range(2):
        (seg,) = plan.segments(s, 0, 0)
        assert seg.length == 39 * 64 * 1152 and seg.dst_off == s * 39 * 64 * 1152
        assert count_descriptors([seg], src, dst) == 512
    # ...unless the decode splits its pool at the stage boundary: whole items again.
    dt2 = BufferTable.of(BufferSpec("latent_a", tuple(range(39)), 1152, 64, "bfloat16"),
                         BufferSpec("latent_b", tuple(range(39, 78)), 1152, 64, "bfloat16"))
    st2 = [BufferTable.of(BufferSpec("latent_a", tuple(range(39)), 1152, 64, "bfloat16")),
           BufferTable.of(BufferSpec("latent_b", tuple(range(39, 78)), 1152, 64, "bfloat16"))]
    plan = plan_transfers(st2, 1, dt2, 1)
    assert all(seg.whole for segs in plan.routes.values() for seg in segs)


def test_segment_descs_addresses():
    seg = Segment("x", 4, 8, 4, 16, 32)
    runs = page_runs([0, 1, 2, 7], [5, 6, 9, 10])
    assert runs.tolist() == [[0, 5, 2], [2, 9, 1], [7, 10, 1]]
    sa, da, ln = segment_descs(seg, runs, 1000, 5000)
    assert sa.tolist() == [1004, 1020, 1036, 1116]
    assert da.tolist() == [5000 + 5 * 32 + 8, 5000 + 6 * 32 + 8, 5000 + 9 * 32 + 8,
                           5000 + 10 * 32 + 8]
    assert ln.tolist() == [4] * 4
    whole = Segment("x", 0, 0, 16, 16, 16)
    sa, da, ln = segment_descs(whole, runs, 1000, 5000)
    assert sa.tolist() == [1000, 1032, 1112] and da.tolist() == [5080, 5144, 5160]
    assert ln.tolist() == [32, 16, 16]


def _ok():
    return [BufferTable.of(BufferSpec("latent", (0, 1), 4, 2, "bfloat16"),
                           heads_spec("draft_k", (100,), 4, 2))], \
        BufferTable.of(BufferSpec("latent", (0, 1), 4, 2, "bfloat16"),
                       heads_spec("draft_k", (100,), 4, 2))


@pytest.mark.parametrize("field,mutate", [
    ("page_size", lambda d: BufferTable.of(BufferSpec("latent", (0, 1), 4, 4, "bfloat16"),
                                           d["draft_k"])),
    ("dtype", lambda d: BufferTable.of(BufferSpec("latent", (0, 1), 4, 2, "float8_e4m3fn"),
                                       d["draft_k"])),
    ("bytes_per_token", lambda d: BufferTable.of(BufferSpec("latent", (0, 1), 6, 2, "bfloat16"),
                                                 d["draft_k"])),
    ("layers", lambda d: BufferTable.of(BufferSpec("latent", (0, 1, 2), 4, 2, "bfloat16"),
                                        d["draft_k"])),
    ("heads.total", lambda d: BufferTable.of(d["latent"], heads_spec("draft_k", (100,), 8, 2))),
    ("heads.per_rank", lambda d: BufferTable.of(
        d["latent"], BufferSpec("draft_k", (100,), 4 * BPH, 2, "bfloat16", Heads(4, 4, BPH)))),
    ("shard", lambda d: BufferTable.of(d["latent"],
                                       BufferSpec("draft_k", (100,), 2 * BPH, 2, "bfloat16"))),
    ("name", lambda d: BufferTable.of(d["latent"])),
])
def test_mismatch_names_field(field, mutate):
    pst, dt = _ok()
    plan_transfers(pst, 2, dt, 2)
    with pytest.raises(TableMismatch) as e:
        check_tables(pst, 2, mutate(dt), 2)
    assert e.value.field == field and field in str(e.value)


def test_decode_may_hold_buffers_prefill_does_not_fill():
    """A prefill without the draft against a decode with draft KV: the draft pool gets no writes."""
    pst, dt = _ok()
    plain = [BufferTable.of(pst[0]["latent"])]
    check_tables(plain, 2, dt, 2)
    plan = plan_transfers(plain, 2, dt, 2)
    names = {seg.buffer for segs in plan.routes.values() for seg in segs}
    assert names == {"latent"}
    with pytest.raises(TableMismatch) as e:  # the other way round is still refused
        check_tables(pst, 2, BufferTable.of(dt["latent"]), 2)
    assert e.value.field == "name" and "draft_k" in str(e.value)


def test_overlapping_stages_rejected():
    a = BufferTable.of(BufferSpec("latent", (0, 1), 4, 2, "bfloat16"))
    b = BufferTable.of(BufferSpec("latent", (1, 2), 4, 2, "bfloat16"))
    d = BufferTable.of(BufferSpec("latent", (0, 1, 2), 4, 2, "bfloat16"))
    with pytest.raises(TableMismatch, match="layers"):
        check_tables([a, b], 1, d, 1)


def test_wire_roundtrip_and_for_tensor():
    pst, dt = _ok()
    assert BufferTable.from_wire(dt.to_wire()) == dt
    lat = np.zeros((10, 3, 64, 576), dtype=np.float16)
    s = BufferSpec.for_tensor("latent", lat, (0, 1, 2))
    assert s.bytes_per_token == 1152 and s.item_bytes == 3 * 64 * 1152 == lat[0].nbytes
    dk = np.zeros((10, 4, 2, 64, 128), dtype=np.float16)
    s = BufferSpec.for_tensor("draft_k", dk, (100, 101), total_heads=16)
    assert s.shard == Heads(16, 4, 256) and s.item_bytes == dk[0].nbytes


def test_metadata_row_roundtrip_and_checks():
    row = MetadataRow((7, 9), (123, 4), b"xyz")
    enc = row.encode(256, 0xFFFF_FFFF_FFFF_FFF0, 3)
    buf = enc + bytes(256 - len(enc))
    got = MetadataRow.decode(buf, 0xFFFF_FFFF_FFFF_FFF0, 3)
    assert got.first_token_ids == (7, 9) and got.counts[:2] == (123, 4) and got.payload == b"xyz"
    with pytest.raises(ValueError, match="gen"):
        MetadataRow.decode(buf, 0xFFFF_FFFF_FFFF_FFF0, 2)
    with pytest.raises(ValueError, match="magic"):
        MetadataRow.decode(bytes(256), 1, 0)
    bad = bytearray(buf)
    bad[100] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        MetadataRow.decode(bytes(bad), 0xFFFF_FFFF_FFFF_FFF0, 3)
    with pytest.raises(ValueError, match="exceeds"):
        MetadataRow(payload=bytes(300)).encode(256, 1, 1)
