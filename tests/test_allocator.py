"""The caching-allocator simulator against sequences whose segments follow by hand from torch
2.13's c10/cuda/CUDACachingAllocator.cpp (the function named in each test) and the constants of
c10/core/AllocatorConfig.h (kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer 2 MiB,
kMinLargeAlloc 10 MiB, kLargeBuffer 20 MiB, kRoundLarge 2 MiB). Simulated, not measured."""

import pytest

from planner.memory.allocator import (AllocConf, OutOfMemory, allocation_size, parse_alloc_conf, replay, round_size,
                                      single_events)
from planner.errors import PlannerError

MIB = 2**20
EXPANDABLE = parse_alloc_conf("expandable_segments:True")


def test_round_size_512_and_power2_divisions():
    # round_size: below 512 -> 512; else a multiple of 512
    assert round_size(1, AllocConf()) == 512
    assert round_size(513, AllocConf()) == 1024
    # roundup_power2_next_division's own example: 1200 with 4 divisions -> 1280 (only when
    # size > 512 * divisions, so use a size in the 1-2 MiB interval: 1.2 MiB -> 1.25 MiB)
    conf = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200, conf) == 1536  # 1200 <= 512 * 4: plain 512 rounding
    assert round_size(int(1.2 * MIB), conf) == int(1.25 * MIB)
    assert round_size(2 * MIB, conf) == 2 * MIB  # a power of two stays


def test_allocation_size_rules():
    # get_allocation_size: <= 1 MiB -> 2 MiB; < 10 MiB -> 20 MiB; else round up to 2 MiB
    assert allocation_size(MIB) == 2 * MIB
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB) == 12 * MIB


def test_small_requests_pack_into_one_2mib_segment():
    # 4 x 1000 B -> 4 x 1024 B blocks split off one 2 MiB small segment (should_split: small pool, rest >= 512)
    s = replay([("malloc", i, 1000) for i in range(4)])
    assert (s.segments_peak, s.small_segments_peak, s.reserved_peak_bytes, s.allocated_peak_bytes) == (1, 1, 2 * MIB, 4096)


def test_small_pool_overflow_takes_a_second_segment():
    # 1 MiB requests: the first splits a 2 MiB segment into 1 MiB + 1 MiB, the second takes the
    # rest, the third needs a new segment
    s = replay([("malloc", i, MIB) for i in range(3)])
    assert (s.small_segments_peak, s.reserved_peak_bytes) == (2, 4 * MIB)


def test_medium_requests_share_a_20mib_segment():
    # 3 MiB (1 < size < 10 MiB): a 20 MiB segment; the 17 MiB rest (> kSmallSize) is split off and
    # serves the next five 3 MiB requests (rest 2 MiB > 1 MiB still splits); the 7th needs a new one
    s = replay([("malloc", i, 3 * MIB) for i in range(6)])
    assert (s.large_segments_peak, s.reserved_peak_bytes) == (1, 20 * MIB)
    s = replay([("malloc", i, 3 * MIB) for i in range(7)])
    assert (s.large_segments_peak, s.reserved_peak_bytes) == (2, 40 * MIB)


def test_large_remainder_of_1mib_or_less_is_not_split():
    # 19.5 MiB in a 20 MiB block: rest 0.5 MiB is not > kSmallSize, so the block is handed out
    # whole (allocated counts the block's size, 20 MiB)
    s = replay([("malloc", "a", 3 * MIB), ("free", "a"), ("malloc", "b", int(19.5 * MIB))])
    assert s.allocated_peak_bytes == 20 * MIB and s.segments_peak == 1


def test_freed_blocks_merge_and_are_reused_best_fit():
    # two 30 MiB segments; free the first; a 25 MiB request reuses it (best fit, split: rest 5 MiB)
    s = replay([("malloc", "a", 30 * MIB), ("malloc", "b", 30 * MIB), ("free", "a"), ("malloc", "c", 25 * MIB)])
    assert (s.segments_peak, s.reserved_peak_bytes) == (2, 60 * MIB)
    # a 40 MiB request fits no cached block: a third segment of 40 MiB
    s = replay([("malloc", "a", 30 * MIB), ("malloc", "b", 30 * MIB), ("free", "a"), ("malloc", "c", 40 * MIB)])
    assert (s.segments_peak, s.reserved_peak_bytes) == (3, 100 * MIB)


def test_fragmentation_split_blocks_cannot_serve_a_larger_request():
    # 100 MiB segment split into 60 MiB (a) + 40 MiB (b); free a; 70 MiB cannot use the 60 MiB free
    # block (and a split segment is never released): reserved 170 MiB for 110 MiB live
    s = replay([("malloc", "big", 100 * MIB), ("free", "big"), ("malloc", "a", 60 * MIB), ("malloc", "b", 40 * MIB),
                ("free", "a"), ("malloc", "c", 70 * MIB)])
    assert (s.reserved_peak_bytes, s.segments_peak) == (170 * MIB, 2)


def test_max_split_size_keeps_oversize_blocks_whole():
    # max_split_size_mb:64: the cached 100 MiB block is oversize; a 60 MiB request (< 64 MiB) may
    # not take it (get_free_block) and gets its own 60 MiB segment
    conf = parse_alloc_conf("max_split_size_mb:64")
    events = [("malloc", "big", 100 * MIB), ("free", "big"), ("malloc", "a", 60 * MIB)]
    assert replay(events, conf).reserved_peak_bytes == 160 * MIB
    assert replay(events).reserved_peak_bytes == 100 * MIB  # unlimited: split the 100 MiB block
    # an oversize request takes an oversize block only within max_non_split_rounding (20 MiB)
    events = [("malloc", "big", 100 * MIB), ("free", "big"), ("malloc", "a", 70 * MIB)]
    assert replay(events, conf).reserved_peak_bytes == 170 * MIB  # 100 >= 70 + 20: not reused
    events = [("malloc", "big", 100 * MIB), ("free", "big"), ("malloc", "a", 90 * MIB)]
    s = replay(events, conf)
    assert s.reserved_peak_bytes == 100 * MIB and s.allocated_peak_bytes == 100 * MIB  # whole, not split


def test_streams_have_separate_pools():
    # a block freed on the all-gather stream is not reused by the default stream (BlockComparatorSize
    # orders by stream first; get_free_block stops at another stream)
    events = [("malloc", "ag", 50 * MIB, "all_gather"), ("free", "ag"), ("malloc", "x", 50 * MIB, "default")]
    assert replay(events).reserved_peak_bytes == 100 * MIB
    events = [("malloc", "ag", 50 * MIB, "all_gather"), ("free", "ag"), ("malloc", "x", 50 * MIB, "all_gather")]
    assert replay(events).reserved_peak_bytes == 50 * MIB


def test_record_stream_delays_reuse_until_the_stream_completes():
    # recordStream on another stream: free() inserts an event; the block returns to the pool only
    # when process_events (the next malloc) finds the event complete
    base = [("malloc", "a", 50 * MIB), ("record", "a", "reduce_scatter"), ("free", "a")]
    s = replay(base + [("malloc", "b", 50 * MIB)])
    assert s.reserved_peak_bytes == 100 * MIB and s.active_peak_bytes == 100 * MIB
    s = replay(base + [("complete", "reduce_scatter"), ("malloc", "b", 50 * MIB)])
    assert s.reserved_peak_bytes == 50 * MIB


def test_expandable_segments_grow_one_segment_per_stream_in_pages():
    # large pool pages are 20 MiB: 30 MiB maps 2 pages (40 MiB); a second 30 MiB takes the free
    # 10 MiB and maps one more page; one segment, 60 MiB reserved (without: 2 segments, 60 MiB)
    s = replay([("malloc", "a", 30 * MIB), ("malloc", "b", 30 * MIB)], EXPANDABLE)
    assert (s.segments_peak, s.reserved_peak_bytes) == (1, 60 * MIB)
    # another stream gets its own segment (find_expandable_block searches the stream's unmapped
    # blocks): the freed 40 MiB on the default stream stay mapped, the other stream maps 2 pages
    s = replay([("malloc", "a", 30 * MIB), ("free", "a"), ("malloc", "b", 30 * MIB, "other")], EXPANDABLE)
    assert (s.segments_peak, s.reserved_peak_bytes) == (2, 80 * MIB)  # one segment per stream


def test_expandable_small_pool_pages_are_2mib():
    s = replay([("malloc", i, 700 * 1024) for i in range(3)], EXPANDABLE)
    # 3 x 700 KiB = 2100 KiB: the first page (2 MiB) holds two, the third maps one more page
    assert (s.small_segments_peak, s.reserved_peak_bytes) == (1, 4 * MIB)


def test_capacity_empties_the_cache_before_giving_up():
    # 100 MiB device: a cached unsplit 60 MiB segment is released (release_cached_blocks) so that
    # an 80 MiB request fits; an 80 + 30 MiB live set does not
    events = [("malloc", "a", 60 * MIB), ("free", "a"), ("malloc", "b", 80 * MIB)]
    s = replay(events, capacity_bytes=100 * MIB)
    assert s.reserved_peak_bytes == 80 * MIB and s.alloc_retries == 1
    with pytest.raises(OutOfMemory):
        replay([("malloc", "a", 80 * MIB), ("malloc", "b", 30 * MIB)], capacity_bytes=100 * MIB)


def test_garbage_collection_needs_a_memory_fraction():
    # garbage_collect_cached_blocks runs only with set_per_process_memory_fraction (set_fraction):
    # allowed 100 MiB x 0.5 = 50 MiB threshold; with 60 MiB cached it frees the old block before
    # the 30 MiB segment is made
    conf = parse_alloc_conf("garbage_collection_threshold:0.5")
    events = [("malloc", "a", 60 * MIB), ("free", "a"), ("malloc", "b", 70 * MIB)]
    s = replay(events, conf, capacity_bytes=1000 * MIB)
    assert s.gc_freed_bytes == 0 and s.reserved_peak_bytes == 130 * MIB
    s = replay(events, conf, capacity_bytes=1000 * MIB, memory_fraction=0.1)
    assert s.gc_freed_bytes == 60 * MIB and s.reserved_peak_bytes == 70 * MIB


@pytest.mark.parametrize("text, message", [
    ("backend:cudaMallocAsync", "option 'backend' is not modelled"),
    ("max_split_size_mb:10", "max_split_size_mb(10) must be >= 20"),
    ("garbage_collection_threshold:1.5", "must be in (0.0, 1.0)"),
    ("roundup_power2_divisions:3", "must be a power of 2"),
    ("expandable_segments:yes", "takes True or False"),
    ("expandable_segments", "expected 'expandable_segments:<value>'"),
])
def test_alloc_conf_refusals_name_the_option(text, message):
    with pytest.raises(PlannerError) as err:
        parse_alloc_conf(text)
    assert message in str(err.value) and err.value.field == "alloc_conf"


def test_alloc_conf_parses_the_list_form():
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,1024:4,>:8], max_split_size_mb:512")
    # intervals from 1 MiB: index 8 = 256 MiB; entries before the first are filled with its value;
    # '>' fills from the last entry's own index on (std::fill from last_index), so 1024:4 is overwritten
    assert conf.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6
    assert conf.max_split_size_bytes == 512 * MIB and not conf.expandable_segments


# --- the default-settings fast path (planner/memory/fast_replay.py) against the reference ------------

def _hand_streams():
    """Every stream replayed above under settings the fast path takes, and a seeded random mix of
    small and large mallocs, frees, side streams, records and completes."""
    import random

    rng = random.Random(25)
    mixed, live, tag = [], [], 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            t = live.pop(rng.randrange(len(live)))
            if t % 7 == 0:
                mixed.append(("record", t, "default"))
            mixed.append(("free", t))
        elif rng.random() < 0.03:
            mixed.append(("complete", "default"))
        else:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MIB), rng.randrange(MIB, 200 * MIB)])
            mixed.append(("malloc", tag, size, "side" if tag % 7 == 0 else "default"))
            live.append(tag)
            tag += 1
    return [mixed,
            [("malloc", "a", 60 * MIB), ("free", "a"), ("malloc", "b", 80 * MIB)],
            [("malloc", "a", 50 * MIB), ("record", "a", "reduce_scatter"), ("free", "a"), ("malloc", "b", 50 * MIB)],
            # emptying the cache at 400 MiB completes the side stream's block still waiting for its
            # event: its segment is released and its bytes leave the active count
            [("malloc", "a", 50 * MIB, "side"), ("record", "a", "default"), ("free", "a"), ("malloc", "b", 60 * MIB),
             ("malloc", "c", 300 * MIB)],
            [("malloc", "big", 100 * MIB), ("free", "big"), ("malloc", "a", 60 * MIB), ("malloc", "b", 40 * MIB),
             ("free", "a"), ("malloc", "c", 70 * MIB)]]


def _replayed(replayer, events, conf=AllocConf(), capacity=None):
    try:
        return replayer(events, conf, capacity)
    except OutOfMemory as oom:
        return str(oom)


@pytest.mark.parametrize("capacity", [None, 400 * MIB, 2000 * MIB])
@pytest.mark.parametrize("conf", ["", "roundup_power2_divisions:4"])
def test_the_fast_path_reports_every_byte_the_reference_does(conf, capacity):
    from planner.memory import fast_replay

    for events in _hand_streams():
        ref = _replayed(replay, events, parse_alloc_conf(conf), capacity)
        assert _replayed(fast_replay.replay, events, parse_alloc_conf(conf), capacity) == ref


def _plan_streams():
    """The streams of estimates the plan shows: a checkpointed 8B model under FSDP2 with its side
    streams, ZeRO-3, DDP."""
    from planner.memory import reserved
    from planner.memory.orchestrator import measure, resolve, _numels
    from planner.schema import EstimateRequest

    for strategy, ckpt in (("fsdp", "full"), ("zero3", "none"), ("ddp", "selective-attention")):
        setup = resolve(EstimateRequest(model="llama-3-8b", strategy=strategy, gpus=8, gpu="h100-80gb", seq_len=4096,
                                        micro_batch=2, checkpointing=ckpt, gradient_accumulation=2))
        m = measure(setup)
        yield reserved.allocation_events(m.setup, m.plan, len(_numels(m.setup)), reserved.loss_tensors(m.setup, m.acts))


def test_the_fast_path_replays_a_plans_streams_as_the_reference_does():
    """The plan's streams (_plan_streams), uncapped and at a capacity that makes the allocator
    empty its cache: the same AllocatorStats, or the same out-of-memory."""
    from planner.memory import fast_replay

    for events in _plan_streams():
        peak = replay(events).reserved_peak_bytes
        for capacity in (None, peak, peak * 9 // 10, peak // 2):
            assert _replayed(fast_replay.replay, events, capacity=capacity) == _replayed(replay, events,
                                                                                        capacity=capacity)
    # other settings go to the reference unchanged
    for conf in ("expandable_segments:True", "max_split_size_mb:64"):
        assert fast_replay.replay(events, parse_alloc_conf(conf)) == replay(events, parse_alloc_conf(conf))


@pytest.mark.parametrize("conf", ["", "roundup_power2_divisions:4", "expandable_segments:True", "max_split_size_mb:64"])
def test_a_replay_capped_below_its_requested_peak_runs_out_of_memory(conf):
    """reserved.simulate does not replay capped at the room a stream whose requested peak exceeds
    it (the capped replay cannot hold more live bytes than it reserves): over the plan's own
    streams and the hand streams, capped a byte below the requested peak (or at 99% or 90% of
    it), both allocators raise OutOfMemory under every setting."""
    from planner.memory import fast_replay

    for events in [*_plan_streams(), *_hand_streams()]:
        requested = replay(events, parse_alloc_conf(conf)).requested_peak_bytes
        for capacity in (requested - 1, requested * 99 // 100, requested * 9 // 10):
            for replayer in (replay, fast_replay.replay):
                with pytest.raises(OutOfMemory):
                    replayer(events, parse_alloc_conf(conf), capacity)


def test_simulate_skips_only_the_capped_replays_that_must_fail(monkeypatch):
    """Llama-3-8B under FSDP2 on 8 H100s, checkpointed, one sequence: at 32,768 tokens the
    uncapped reserve exceeds the room and the replay capped at it fits; at 34,816 the capped
    replay runs out of memory; at 35,840 the requested peak alone exceeds the room, so the capped
    replay is skipped (it would raise OutOfMemory) and the estimate does not fit all the same."""
    from planner.memory import fast_replay, reserved
    from planner.memory.orchestrator import estimate
    from planner.schema import EstimateRequest

    calls = []
    monkeypatch.setattr(reserved, "replay", lambda events, conf, capacity_bytes=None:
                        calls.append((events, capacity_bytes)) or fast_replay.replay(events, conf, capacity_bytes))

    def estimated(seq_len):
        calls.clear()
        return estimate(EstimateRequest(model="llama-3-8b", strategy="fsdp", gpus=8, gpu="h100-80gb",
                                        checkpointing="full", seq_len=seq_len))

    # the request's replay, the one with expandable_segments switched, then the capped one or none
    assert estimated(32768).fits and [c is not None for _, c in calls] == [False, False, True]
    assert not estimated(34816).fits and [c is not None for _, c in calls] == [False, False, True]
    e = estimated(35840)
    assert not e.fits and [c is not None for _, c in calls] == [False, False]
    events = calls[0][0]
    room = (e.device_capacity_bytes - e.per_device.cuda_context_bytes - e.per_device.nccl_bytes
            - e.allocator.replay_shortfall_bytes)
    assert 0 < room < replay(events).requested_peak_bytes
    with pytest.raises(OutOfMemory):
        fast_replay.replay(events, capacity_bytes=room)


def _run_streams(seed: int, length: int = 600):
    """Seeded random streams in runs ("mallocs" of up to 60 allocations of one size, on the
    default or a side stream; "frees" of any decreasing selection of the live tags: whole runs,
    their ends, their middles, pieces of several runs), mixed with single mallocs and frees,
    records on single allocations and on pieces of runs, completes: every path of fast_replay's
    carving and freeing (a piece split off a run, the rest a run of its own)."""
    import random

    rng = random.Random(seed)
    events, live, tag = [], [], 0
    for _ in range(length):
        roll = rng.random()
        if live and roll < 0.3:
            chosen = sorted(rng.sample(live, rng.randint(1, min(len(live), 80))), reverse=True)
            if rng.random() < 0.5:  # a stretch of the newest, as allocation_events frees a key's tail
                chosen = sorted(live, reverse=True)[:len(chosen)]
            for t in chosen:
                live.remove(t)
            events.append(("frees", chosen))
        elif live and roll < 0.38:
            t = rng.choice(live)
            live.remove(t)
            events.append(("free", t))
        elif live and roll < 0.45:
            events.append(("record", rng.choice(live), rng.choice(["default", "side", "other"])))
        elif roll < 0.48:
            events.append(("complete", rng.choice(["default", "side", "other"])))
        else:
            size = rng.choice([rng.randrange(1, 4096), rng.randrange(1, 2 * MIB), rng.randrange(MIB, 12 * MIB),
                               rng.randrange(MIB, 200 * MIB), 16_968_514, 335_544_320])
            count = rng.choice([1, 1, 2, 3, rng.randint(4, 60)])
            stream = "side" if rng.random() < 0.15 else "default"
            events.append(("mallocs", tag, count, size, stream) if count > 1 or rng.random() < 0.5
                          else ("malloc", tag, size, stream))
            live += range(tag, tag + count)
            tag += count
    return events


@pytest.mark.parametrize("seed", range(8))
def test_the_fast_path_replays_runs_as_the_reference_replays_their_single_events(seed):
    """Runs of mallocs and frees (_run_streams) through fast_replay, a run of blocks at a time,
    against the reference replaying every allocation alone (allocator.single_events): the same
    AllocatorStats or the same out-of-memory, uncapped and capped at fractions of the uncapped
    reserve that make the allocator empty its cache, under plain and power-of-two rounding (and
    the settings fast_replay hands to the reference, which takes runs as their single events)."""
    from planner.memory import fast_replay

    events = _run_streams(seed)
    single = single_events(events)
    for conf in ("", "roundup_power2_divisions:4", "expandable_segments:True", "max_split_size_mb:64"):
        c = parse_alloc_conf(conf)
        peak = replay(single, c).reserved_peak_bytes
        for capacity in (None, peak, peak * 9 // 10, peak * 7 // 10, peak // 2):
            ref = _replayed(replay, single, c, capacity)
            assert _replayed(fast_replay.replay, events, c, capacity) == ref
            assert _replayed(replay, events, c, capacity) == ref
