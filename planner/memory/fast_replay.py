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
- a block is a slotted object made without an __init__ call, its allocation's requested size kept
  on it, one ``held`` flag for the reference's "allocated or waiting for its events";
- the pools are found by stream, then by the small flag;
- where a split's rest or a merged block's key keeps the sorted order in the place of the key it
  replaces, it takes that place (no second bisection, no list shift);
- the statistics are plain integers, peaks updated only where a count grows;
- a run of mallocs of one size ("mallocs", reserved.allocation_runs) is carved a run of blocks at
  a time: the pieces one found block (or new segment) gives in a row while each split leaves a
  rest to split (should_split), held as one block of ``count`` pieces; a run of frees ("frees")
  frees a run's consecutive pieces at once (the same merges and statistics as one by one: frees
  only lower the counts, and the blocks not held after them are the same whatever their order);
  a run is cut where a free or a record_stream takes part of it. A plan's stream of ~8,000 events
  is ~800 runs;
- malloc, free (with the merge) and record_stream are written out in one loop over the events
  (_DefaultAllocator.run), the per-event counts and the constants in its local variables;
  process_events is allocator.py's own.

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
    """A block of a segment (the reference's _Block without the expandable segments' fields).
    ``held``: allocated, or freed with recorded events not yet completed (the reference's
    ``allocated or events``): a block merges with a neighbour that is not held (``stream_uses``
    is set only while allocated), so one flag answers try_merge_blocks. A held block is a run:
    ``count`` allocations of ``unit`` bytes each (``size`` = count x unit), one after another in
    the segment, tagged ``tag`` .. tag + count - 1 (a single allocation: count 1, its tag any
    hashable), each of ``requested`` bytes."""

    __slots__ = ("small", "stream", "pool", "size", "addr", "prev", "next", "held", "stream_uses", "events",
                 "requested", "tag", "count", "unit")


def _block(small: bool, stream: str, pool: list[int], size: int, addr: int, prev: _Block | None,
           nxt: _Block | None) -> _Block:
    """A free block (the slots set one by one: cheaper than an __init__ call; run writes it out)."""
    b = _new(_Block)
    b.small, b.stream, b.pool, b.size, b.addr, b.prev, b.next = small, stream, pool, size, addr, prev, nxt
    b.held, b.stream_uses, b.events = False, None, 0  # requested, tag, count, unit: set when allocated
    return b


_new = object.__new__


class _DefaultAllocator:
    """CachingAllocator under torch's default settings (see the module's docstring); a
    ``memory_fraction`` without a garbage-collection threshold only caps what can be reserved."""

    def __init__(self, conf: AllocConf, capacity_bytes: int | None, memory_fraction: float | None = None):
        self.conf = conf
        self.rounds_power2 = any(conf.roundup_power2_divisions)
        self.capacity = capacity_bytes
        self.allowed = int(memory_fraction * capacity_bytes) if memory_fraction and capacity_bytes else None
        # stream -> (large pool, small pool), indexed by the small flag: each the sorted free-block keys
        self.pools: dict[str, tuple[list[int], list[int]]] = {}
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

    def run(self, events: list[tuple]) -> AllocatorStats:
        """The events in order (allocator.replay's format, runs included), then the statistics:
        one loop with the statistics in local variables and malloc (get_free_block,
        alloc_found_block with should_split), free (free_block with try_merge_blocks) and
        record_stream written out in it, a run of mallocs or frees taken a run of blocks at a
        time (see carving and freeing below); the steps that run once per segment or per
        completed stream (alloc_block, release_cached_blocks, process_events) and a run's split
        are methods."""
        pools, free_blocks, pending, completed = self.pools, self.free_blocks, self.pending, self.completed
        rounds_power2, conf = self.rounds_power2, self.conf
        bisect, insert, new = bisect_left, insort, _new
        shift, min_block, small_size = KEY_SHIFT, MIN_BLOCK_BYTES, SMALL_SIZE_BYTES
        blocks: dict = {}  # tag -> the run holding it (a freed tag's entry is left behind, never read again)
        allocated = allocated_peak = active = active_peak = requested = requested_peak = 0
        for event in events:
            op = event[0]
            if op == "mallocs" or op == "malloc":
                if op == "mallocs":
                    _, tag, count, size, stream = event
                else:
                    tag, count, size = event[1], 1, event[2]
                    stream = event[3] if len(event) > 3 else "default"
                if pending and completed:
                    self.released_active = 0
                    process_events(pending, completed, self._free_block)
                    active -= self.released_active
                if size < min_block:
                    rounded = min_block
                elif rounds_power2:
                    rounded = round_size(size, conf)
                else:
                    rounded = (size + min_block - 1) & -min_block  # up to a multiple (a power of 2)
                small = rounded <= small_size
                pair = pools.get(stream)
                if pair is None:
                    pair = pools[stream] = ([], [])
                pool = pair[small]
                while count:
                    # get_free_block: the smallest cached block of the pool and stream that holds the
                    # size (max_split_size unlimited: no block is refused as oversize)
                    k = bisect(pool, rounded << shift)
                    if k < len(pool):
                        block = free_blocks.pop(pool[k])  # its key leaves the pool below (split or not)
                    else:
                        k = -1
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
                    # remain, a large one when more than kSmallSize does. Carving: the run's next
                    # mallocs take the pieces after this one while each still splits (``pieces``:
                    # what remains shrinks piece by piece, so should_split holds up to the last that
                    # leaves enough). Each next malloc's smallest fitting block is the rest of the
                    # one before: the found block was the smallest of its pool holding ``rounded``
                    # (no other in [rounded, its size)), a new segment was made where none held it,
                    # the rest is smaller than the block it came from, and nothing else runs
                    # between the mallocs of a run (the events were processed at its first, no
                    # segment is made while a rest holds the size)
                    bsize = block.size
                    pieces = ((bsize - min_block) if small else (bsize - small_size - 1)) // rounded
                    if pieces > count:
                        pieces = count
                    if pieces:
                        bsize = pieces * rounded
                        remaining = block.size - bsize
                        addr = block.addr + bsize
                        nxt = block.next
                        rest = new(_Block)  # _block written out
                        rest.small, rest.stream, rest.pool, rest.size, rest.addr, rest.prev, rest.next = \
                            small, stream, pool, remaining, addr, block, nxt
                        rest.held, rest.stream_uses, rest.events = False, None, 0
                        if nxt is not None:
                            nxt.prev = rest
                        block.next = rest
                        block.size = bsize
                        block.unit = rounded
                        key = remaining << shift | addr
                        free_blocks[key] = rest
                        # the rest's key takes the found block's place where the order allows (smaller
                        # than the found key, so only the key before it can be out of order)
                        if k < 0:
                            insert(pool, key)
                        elif k == 0 or pool[k - 1] < key:
                            pool[k] = key
                        else:
                            del pool[k]
                            insert(pool, key)
                    else:  # the whole block, unsplit
                        if k >= 0:
                            del pool[k]
                        pieces = 1
                        block.unit = bsize
                    block.held = True
                    block.requested = size
                    block.tag = tag
                    block.count = pieces
                    if pieces == 1:
                        blocks[tag] = block
                    else:
                        for t in range(tag, tag + pieces):  # (quicker than an update from pairs)
                            blocks[t] = block
                    count -= pieces
                    if count:  # a run's tags are integers
                        tag += pieces
                    allocated += bsize
                    if allocated > allocated_peak:
                        allocated_peak = allocated
                    active += bsize
                    if active > active_peak:
                        active_peak = active
                    requested += pieces * size
                    if requested > requested_peak:
                        requested_peak = requested
            elif op == "frees" or op == "free":
                gone = event[1] if op == "frees" else event[1:]
                i, n = 0, len(gone)
                while i < n:
                    tag = gone[i]
                    block = blocks[tag]
                    count = block.count
                    if count == 1:
                        i += 1
                    else:
                        # freeing: the tags the list frees next, t, t - 1, ..., down to the run's
                        # first at most ("frees" lists decrease, so the last of a stretch tells)
                        top = tag - block.tag
                        c = min(top + 1, n - i)
                        if gone[i + c - 1] != tag - c + 1:
                            low, high = 1, c  # gone[i + low - 1] is tag - low + 1, gone[i + high - 1] is not
                            while low + 1 < high:
                                mid = (low + high) // 2
                                if gone[i + mid - 1] == tag - mid + 1:
                                    low = mid
                                else:
                                    high = mid
                            c = low
                        i += c
                        if c != count:
                            block = self._carve(block, top - c + 1, c, blocks)
                        count = c
                    bsize = block.size
                    allocated -= bsize
                    requested -= count * block.requested
                    uses = block.stream_uses
                    if uses:  # insert_events: one event per stream used on; held until they complete
                        for s in uses:
                            pending.append((s, block))
                        block.events = len(uses)
                        block.stream_uses = None
                        continue
                    active -= bsize
                    # free_block: merge with the neighbours that are not held (try_merge_blocks), back
                    # into the pool (_merge_free, written out)
                    block.held = False
                    pool = block.pool
                    prev, nxt = block.prev, block.next
                    if prev is not None and not prev.held:
                        addr = prev.addr
                        key = prev.size << shift | addr
                        del pool[bisect(pool, key)], free_blocks[key]
                        block.addr = addr
                        bsize += prev.size
                        prev = block.prev = prev.prev
                        if prev is not None:
                            prev.next = block
                    else:
                        addr = block.addr
                    if nxt is not None and not nxt.held:
                        key = nxt.size << shift | nxt.addr
                        del free_blocks[key]
                        k = bisect(pool, key)
                        bsize += nxt.size
                        nxt = block.next = nxt.next
                        if nxt is not None:
                            nxt.prev = block
                        block.size = bsize
                        key = bsize << shift | addr
                        free_blocks[key] = block
                        # the merged key takes the next block's place where the order allows (larger
                        # than the next's key, so only the key after it can be out of order)
                        if k + 1 == len(pool) or pool[k + 1] > key:
                            pool[k] = key
                        else:
                            del pool[k]
                            insert(pool, key)
                    else:
                        block.size = bsize
                        key = bsize << shift | addr
                        free_blocks[key] = block
                        insert(pool, key)
            elif op == "record":  # record_stream: a use on the allocation stream is ignored
                tag, stream = event[1], event[2]
                block = blocks[tag]
                if stream != block.stream:
                    if block.count > 1:  # the allocation's own block: its uses are its own
                        top = tag - block.tag
                        if top:
                            block = self._split(block, top, blocks)
                        if block.count > 1:
                            self._split(block, 1, blocks)
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

    @staticmethod
    def _split(block: _Block, first: int, blocks: dict | None) -> _Block:
        """A held run cut before its piece ``first``: ``block`` keeps the pieces before it, a new run
        the rest (returned; its tags point to it in ``blocks``, unless None: tags about to be freed).
        The same blocks, one per allocation, as the reference has: only their grouping changes."""
        unit = block.unit
        right = _new(_Block)
        right.small, right.stream, right.pool, right.addr, right.prev, right.next = \
            block.small, block.stream, block.pool, block.addr + first * unit, block, block.next
        right.held, right.stream_uses, right.events, right.requested = True, None, 0, block.requested
        right.tag, right.count, right.unit = block.tag + first, block.count - first, unit
        right.size = right.count * unit
        if block.next is not None:
            block.next.prev = right
        block.next = right
        block.count = first
        block.size = first * unit
        if blocks is not None:
            for t in range(right.tag, right.tag + right.count):
                blocks[t] = right
        return right

    def _carve(self, block: _Block, first: int, count: int, blocks: dict) -> _Block:
        """The pieces ``first`` .. first + count - 1 of a held run as a run of their own (returned),
        the pieces before and after it runs of theirs."""
        if first:
            block = self._split(block, first, None)  # its tags: the freed ones, then the after's below
        if count < block.count:
            self._split(block, count, blocks)
        return block

    def _alloc_block(self, size: int, small: bool, stream: str, pool: list[int]) -> _Block | None:
        """alloc_block: a new segment of get_allocation_size, when the device has room."""
        nbytes = allocation_size(size)
        if self.allowed is not None and self.reserved + nbytes > self.allowed:
            return None
        if self.capacity is not None and self.reserved + nbytes > self.capacity:
            return None
        block = _block(small, stream, pool, nbytes, self.next_addr, None, None)
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
        """free_block without the statistics: merge with the neighbours of the same segment that
        are not held, back into the pool (run writes the same out for a free without events)."""
        block.held = False
        pool, free_blocks = block.pool, self.free_blocks
        prev, nxt = block.prev, block.next
        if prev is not None and not prev.held:
            key = prev.size << KEY_SHIFT | prev.addr  # try_merge_blocks: the previous block's range joins
            del pool[bisect_left(pool, key)], free_blocks[key]
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if block.prev is not None:
                block.prev.next = block
        if nxt is not None and not nxt.held:
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
        free_blocks = self.free_blocks
        for pair in self.pools.values():
            for pool in pair:
                for key in list(pool):
                    block = free_blocks[key]
                    if block.prev is None and block.next is None:
                        del pool[bisect_left(pool, key)], free_blocks[key]
                        self.reserved -= block.size
                        self.segments[block.small] -= 1
                        self.total_segments -= 1
