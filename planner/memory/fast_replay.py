"""The allocator replay the estimate and the plan run: torch's default allocator settings replayed
by a lean copy of the simulator's rules, any other setting by the reference simulator.

planner/memory/allocator.py is the reference: every rule of torch 2.13's CUDACachingAllocator.cpp
the simulator models, one method per function of the C++. The plan replays a few dozen streams of
thousands of events each (its shown candidates and its inverse questions), and there the
reference's general machinery is most of the plan's time. Under torch's defaults
(expandable_segments off, max_split_size unlimited, no memory fraction: no garbage collection) most
of that machinery has nothing to do: no segment is ever expanded or unmapped, no oversize block is
refused or released early. ``replay`` then runs ``_DefaultAllocator``, the same rules with the
branches those settings cannot take removed and with integers for keys:

- a free block's place in its pool (BlockPool.blocks, ordered by size then address) is the single
  integer ``size << 64 | address`` in a sorted list, found by bisection (the reference sorts
  ``(size, address, id)`` tuples; addresses of free blocks are distinct, so the order is the same);
- a block is a slotted object, its allocation's requested size kept on it;
- the statistics are plain integers, peaks updated only where a count grows;
- malloc, free and record_stream are written out in one loop over the events (_DefaultAllocator.run),
  the per-event counts in its local variables; process_events is allocator.py's own.

Every byte it reports equals the reference's (tests/test_allocator.py replays the same streams
through both, including the plan's own); any other setting goes to the reference unchanged.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from planner.memory.allocator import (MIN_BLOCK_BYTES, SMALL_SIZE_BYTES, AllocConf, AllocatorStats, OutOfMemory,
                                      allocation_size, process_events, round_size)
from planner.memory.allocator import replay as reference_replay

KEY_SHIFT = 64  # a free block's key: size << 64 | address (addresses stay far below 2**64)
SEGMENT_GAP = 1 << 30  # CachingAllocator._alloc_block: the address gap after each segment


def replay(events: list[tuple], conf: AllocConf = AllocConf(), capacity_bytes: int | None = None,
           memory_fraction: float | None = None) -> AllocatorStats:
    """allocator.replay's answer, by ``_DefaultAllocator`` where the settings allow it."""
    if not _is_default(conf, memory_fraction):
        return reference_replay(events, conf, capacity_bytes, memory_fraction)
    return _DefaultAllocator(conf, capacity_bytes, memory_fraction).run(events)


def _is_default(conf: AllocConf, memory_fraction: float | None) -> bool:
    """The settings _DefaultAllocator covers: no expandable segments, max_split_size unlimited, no
    garbage collection (it runs only with a memory fraction and a threshold)."""
    return (not conf.expandable_segments and conf.max_split_size_bytes is None
            and not (memory_fraction and conf.garbage_collection_threshold > 0.0))


class _Block:
    """A block of a segment (the reference's _Block without the expandable segments' fields)."""

    __slots__ = ("small", "stream", "pool", "size", "addr", "prev", "next", "allocated", "stream_uses", "events",
                 "requested")

    def __init__(self, small: bool, stream: str, pool: list[int], size: int, addr: int, prev=None, nxt=None):
        self.small, self.stream, self.size, self.addr = small, stream, size, addr
        self.pool = pool  # the sorted keys of its pool's free blocks (the pool of its small flag and stream)
        self.prev, self.next = prev, nxt
        self.allocated = False
        self.stream_uses: set | None = None  # streams recorded on (record_stream), None: none
        self.events = 0  # recorded events not yet completed
        self.requested = 0  # the allocation's requested bytes (requested_bytes statistic)


class _DefaultAllocator:
    """CachingAllocator under torch's default settings (see the module's docstring); a
    ``memory_fraction`` without a garbage-collection threshold only caps what can be reserved."""

    def __init__(self, conf: AllocConf, capacity_bytes: int | None, memory_fraction: float | None = None):
        self.conf = conf
        self.rounds_power2 = any(conf.roundup_power2_divisions)
        self.capacity = capacity_bytes
        self.allowed = int(memory_fraction * capacity_bytes) if memory_fraction and capacity_bytes else None
        self.pools: dict[tuple[bool, str], list[int]] = {}  # (small, stream) -> sorted free-block keys
        self.free_blocks: dict[int, _Block] = {}  # key -> block
        self.pending: list[tuple[str, _Block]] = []  # (stream, block): recorded events not yet completed
        self.completed: set[str] = set()
        self.next_addr = 1 << 20
        self.reserved = self.reserved_peak = 0  # allocated, active and requested: run's local variables
        self.segments = {True: 0, False: 0}
        self.segments_peak = {True: 0, False: 0}
        self.total_segments = self.total_segments_peak = 0
        self.retries = 0
        self.released_active = 0  # the bytes _free_block returned to the pools since run last read it

    # --- the pools --------------------------------------------------------------------------

    def _insert(self, b: _Block) -> None:
        key = b.size << KEY_SHIFT | b.addr
        self.free_blocks[key] = b
        insort(b.pool, key)

    def _remove(self, b: _Block) -> None:
        key = b.size << KEY_SHIFT | b.addr
        pool = b.pool
        del pool[bisect_left(pool, key)]
        del self.free_blocks[key]

    def run(self, events: list[tuple]) -> AllocatorStats:
        """The events in order (allocator.replay's format), then the statistics: one loop with the
        statistics in local variables and malloc (get_free_block, alloc_found_block with
        should_split), free and record_stream written out in it; the merge (free_block) and the
        steps that run once per segment or per completed stream (alloc_block,
        release_cached_blocks, process_events) are methods."""
        pools, free_blocks, pending, completed = self.pools, self.free_blocks, self.pending, self.completed
        rounds_power2, conf, free_block = self.rounds_power2, self.conf, self._merge_free
        blocks: dict = {}  # tag -> its block
        allocated = allocated_peak = active = active_peak = requested = requested_peak = 0
        for event in events:
            op = event[0]
            if op == "malloc":
                size = event[2]
                stream = event[3] if len(event) > 3 else "default"
                if pending and completed:
                    self.released_active = 0
                    process_events(pending, completed, self._free_block)
                    active -= self.released_active
                if size < MIN_BLOCK_BYTES:
                    rounded = MIN_BLOCK_BYTES
                elif rounds_power2:
                    rounded = round_size(size, conf)
                else:
                    rounded = -(-size // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES
                small = rounded <= SMALL_SIZE_BYTES
                # get_free_block: the smallest cached block of the pool and stream that holds the size
                # (max_split_size unlimited: no block is refused as oversize)
                pool = pools.get((small, stream))
                if pool is None:
                    pool = pools[(small, stream)] = []
                k = bisect_left(pool, rounded << KEY_SHIFT)
                if k < len(pool):
                    block = free_blocks.pop(pool.pop(k))
                else:
                    block = self._alloc_block(rounded, small, stream, pool)
                    if block is None:
                        self.released_active = 0
                        self._release_cached()
                        active -= self.released_active
                        self.retries += 1
                        block = self._alloc_block(rounded, small, stream, pool)
                        if block is None:
                            raise OutOfMemory(f"tried to allocate {allocation_size(rounded):,} bytes with "
                                              f"{self.reserved:,} reserved of {self.capacity or self.allowed:,}")
                # alloc_found_block with should_split: a small block splits when 512 bytes or more
                # remain, a large one when more than kSmallSize does
                remaining = block.size - rounded
                if remaining >= MIN_BLOCK_BYTES if small else remaining > SMALL_SIZE_BYTES:
                    addr = block.addr + rounded
                    rest = _Block(small, stream, pool, remaining, addr, block, block.next)
                    if block.next is not None:
                        block.next.prev = rest
                    block.next = rest
                    block.size = rounded
                    key = remaining << KEY_SHIFT | addr
                    free_blocks[key] = rest
                    insort(pool, key)
                block.allocated = True
                block.requested = size
                blocks[event[1]] = block
                bsize = block.size
                allocated += bsize
                if allocated > allocated_peak:
                    allocated_peak = allocated
                active += bsize
                if active > active_peak:
                    active_peak = active
                requested += size
                if requested > requested_peak:
                    requested_peak = requested
            elif op == "free":
                block = blocks.pop(event[1])
                block.allocated = False
                allocated -= block.size
                requested -= block.requested
                if block.stream_uses:  # insert_events: one event per stream used on
                    for s in block.stream_uses:
                        pending.append((s, block))
                    block.events = len(block.stream_uses)
                    block.stream_uses = None
                    continue
                active -= block.size
                free_block(block)
            elif op == "record":  # record_stream: a use on the allocation stream is ignored
                block, stream = blocks[event[1]], event[2]
                if stream != block.stream:
                    if block.stream_uses is None:
                        block.stream_uses = set()
                    block.stream_uses.add(stream)
            elif op == "complete":
                completed.add(event[1])
            else:
                raise ValueError(f"unknown allocator event {op!r}")
        return AllocatorStats(
            allocated_peak_bytes=allocated_peak, active_peak_bytes=active_peak,
            reserved_peak_bytes=self.reserved_peak, requested_peak_bytes=requested_peak,
            segments_peak=self.total_segments_peak, small_segments_peak=self.segments_peak[True],
            large_segments_peak=self.segments_peak[False], segments=self.total_segments,
            reserved_bytes=self.reserved, alloc_retries=self.retries, gc_freed_bytes=0)

    def _alloc_block(self, size: int, small: bool, stream: str, pool: list[int]) -> _Block | None:
        """alloc_block: a new segment of get_allocation_size, when the device has room."""
        nbytes = allocation_size(size)
        if self.allowed is not None and self.reserved + nbytes > self.allowed:
            return None
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None
        block = _Block(small, stream, pool, nbytes, self.next_addr)
        self.next_addr += nbytes + SEGMENT_GAP
        self.reserved += nbytes
        self.reserved_peak = max(self.reserved_peak, self.reserved)
        self.segments[small] += 1
        self.segments_peak[small] = max(self.segments_peak[small], self.segments[small])
        self.total_segments += 1
        self.total_segments_peak = max(self.total_segments_peak, self.total_segments)
        return block

    def _free_block(self, block: _Block) -> None:
        """free_block for a block whose recorded events completed (process_events), its bytes
        counted in ``released_active`` (run counts the others' in its local ``active``)."""
        self.released_active += block.size
        self._merge_free(block)

    def _merge_free(self, block: _Block) -> None:
        """free_block without the statistics: merge with free neighbours of the same segment,
        back into the pool."""
        pool, free_blocks = block.pool, self.free_blocks
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.allocated and not prev.events and not prev.stream_uses:
            key = prev.size << KEY_SHIFT | prev.addr  # try_merge_blocks: the previous block's range joins
            del pool[bisect_left(pool, key)], free_blocks[key]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.allocated and not nxt.events and not nxt.stream_uses:
            key = nxt.size << KEY_SHIFT | nxt.addr
            del pool[bisect_left(pool, key)], free_blocks[key]
            block.size += nxt.size
            block.next = nxt.next
            if block.next is not None:
                block.next.prev = block
        key = block.size << KEY_SHIFT | block.addr
        free_blocks[key] = block
        insort(pool, key)

    def _release_cached(self) -> None:
        """release_cached_blocks: synchronize every stream, then cudaFree every cached segment
        that is whole (not split)."""
        self.completed.update(s for s, _ in self.pending)
        if self.pending:
            process_events(self.pending, self.completed, self._free_block)
        for pool in self.pools.values():
            for key in list(pool):
                block = self.free_blocks[key]
                if block.prev is None and block.next is None:
                    self._remove(block)
                    self.reserved -= block.size
                    self.segments[block.small] -= 1
                    self.total_segments -= 1
