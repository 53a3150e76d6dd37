"""A simulator of torch 2.13's CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp), pure.

A job runs out of memory when the allocator cannot reserve another segment, not when the live
tensors reach the card. This module replays an ordered stream of allocations and frees (each on a
stream) through the allocator's rules and reports what it would reserve: allocated, active and
reserved peaks, and segment counts.

Sources read (torch 2.13.0, git cf30153c):
- constants: torch/include/c10/core/AllocatorConfig.h of the installed 2.13.0 wheel, lines 17-25
  (kSmallBuffer, kMinBlockSize, kSmallSize, kMinLargeAlloc, kRoundLarge) and 340-353 (the large
  segment size 20 MiB, max_split_size unlimited, max_non_split_rounding_size, the GC threshold 0,
  expandable segments off by default);
- behaviour: c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch as stored at 001074d2, the
  functions named below; the 2.13 header confirms the same names and defaults): malloc,
  round_size, roundup_power2_next_division, get_pool, get_allocation_size, get_free_block,
  should_split, alloc_found_block, free/free_block/try_merge_blocks, alloc_block,
  release_available_cached_blocks, release_cached_blocks/release_blocks, garbage_collect_cached_
  blocks, recordStream/insert_events/process_events, find_expandable_block/map_block/
  try_allocate_expandable_block/unmap_block;
- the option parser: c10/core/AllocatorConfig.cpp (parseArgs and its parse* functions).

What is not modelled, and why it does not matter here: CUDA graph private pools (no graphs in the
training steps modelled), IPC sharing, peer access, free-memory callbacks, cudaMallocAsync.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Callable

from planner.errors import PlannerError

# torch 2.13 c10/core/AllocatorConfig.h lines 17-25 and 340
MIN_BLOCK_BYTES = 512  # kMinBlockSize: every size rounds up to a multiple of it
SMALL_SIZE_BYTES = 1_048_576  # kSmallSize: the largest "small" request (1 MiB)
SMALL_BUFFER_BYTES = 2_097_152  # kSmallBuffer: small requests are packed in 2 MiB segments
MIN_LARGE_ALLOC_BYTES = 10_485_760  # kMinLargeAlloc: 1-10 MiB requests take a 20 MiB segment
ROUND_LARGE_BYTES = 2_097_152  # kRoundLarge: larger segments round up to 2 MiB
LARGE_BUFFER_BYTES = 20_971_520  # kLargeBuffer / large_segment_size_: the 20 MiB segment
# AllocatorConfig.cpp: kRoundUpPowerOfTwoIntervals = 16 intervals from 1 MiB (kRoundUpPowerOfTwoStart)
POWER2_INTERVALS = 16
MIB = 1_048_576
# ExpandableSegment: "we use 2MiB pages for our small pool and 20MiB pages for our large pool"
# (Note [Expandable Segments]; find_expandable_block: segment_size = is_small ? kSmallBuffer : kLargeBuffer)

KNOWN_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold", "roundup_power2_divisions")


@dataclass(frozen=True)
class AllocConf:
    """The PYTORCH_CUDA_ALLOC_CONF settings the simulator honours (torch's defaults when absent)."""

    expandable_segments: bool = False
    max_split_size_bytes: int | None = None  # None: unlimited (SIZE_MAX in torch)
    garbage_collection_threshold: float = 0.0
    # divisions per power-of-two interval from 1 MiB to 64 GiB (0: plain 512-byte rounding)
    roundup_power2_divisions: tuple[int, ...] = (0,) * POWER2_INTERVALS
    text: str = ""  # the string it was parsed from ("" for torch's defaults)

    @property
    def max_split(self) -> int:
        return self.max_split_size_bytes if self.max_split_size_bytes is not None else 2**64 - 1

    def divisions(self, size: int) -> int:
        """AllocatorConfig::roundup_power2_divisions(size): the interval of log2(size) from 1 MiB."""
        index = size.bit_length() - 1 - (MIB.bit_length() - 1)
        return self.roundup_power2_divisions[min(max(index, 0), POWER2_INTERVALS - 1)]

    def with_expandable(self, on: bool) -> "AllocConf":
        parts = [p for p in self.text.split(",") if p and not p.strip().startswith("expandable_segments")]
        text = ",".join(parts + ([f"expandable_segments:{on}"] if on else []))
        return AllocConf(on, self.max_split_size_bytes, self.garbage_collection_threshold,
                         self.roundup_power2_divisions, text)


def _tokens(text: str) -> list[str]:
    """AllocatorConfig::lexArgs: ',' ':' '[' ']' are tokens of their own, spaces are dropped."""
    out, buf = [], ""
    for ch in text:
        if ch in ",:[]":
            if buf:
                out.append(buf)
                buf = ""
            out.append(ch)
        elif ch != " ":
            buf += ch
    return out + ([buf] if buf else [])


def _refuse(text: str, why: str) -> PlannerError:
    return PlannerError(f"alloc_conf({text!r}): {why}", field="alloc_conf")


def _value(tokens: list[str], i: int, key: str, text: str) -> str:
    if i + 2 >= len(tokens) or tokens[i + 1] != ":":
        raise _refuse(text, f"expected '{key}:<value>'")
    return tokens[i + 2]


def _is_power2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _divisions(tokens: list[str], i: int, text: str) -> tuple[tuple[int, ...], int]:
    """parseRoundUpPower2Divisions: one power of two for every interval, or [MB:div, ..., >:div]."""
    values = [0] * POWER2_INTERVALS
    if tokens[i] != "[":
        n = _int(tokens[i], "roundup_power2_divisions", text)
        if not _is_power2(n):
            raise _refuse(text, f"roundup_power2_divisions({n}) must be a power of 2")
        return (n,) * POWER2_INTERVALS, i
    i += 1
    first, last = True, 0
    while i < len(tokens) and tokens[i] != "]":
        key = tokens[i]
        if i + 2 >= len(tokens) or tokens[i + 1] != ":":
            raise _refuse(text, "roundup_power2_divisions entries are 'MB:divisions'")
        div = _int(tokens[i + 2], "roundup_power2_divisions", text)
        if div != 0 and not _is_power2(div):
            raise _refuse(text, f"roundup_power2_divisions: divisions {div} must be a power of 2 or 0")
        if key == ">":
            values[last:] = [div] * (POWER2_INTERVALS - last)
        else:
            mb = _int(key, "roundup_power2_divisions", text)
            if not _is_power2(mb):
                raise _refuse(text, f"roundup_power2_divisions: interval {mb} MB must be a power of 2")
            index = min(mb.bit_length() - 1, POWER2_INTERVALS - 1)
            if first:
                values[:index] = [div] * index
                first = False
            values[index] = div
            last = index
        i += 3
        if i < len(tokens) and tokens[i] == ",":
            i += 1
    if i >= len(tokens):
        raise _refuse(text, "roundup_power2_divisions: missing ']'")
    return tuple(values), i


def _int(token: str, key: str, text: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise _refuse(text, f"{key} takes an integer, not {token!r}") from None


def parse_alloc_conf(text: str | None) -> AllocConf:
    """AllocatorConfig::parseArgs for the four options the simulator models; any other option
    (backend, pinned_*, release_lock_on_cudamalloc, max_non_split_rounding_mb, ...) is refused by
    name rather than silently ignored."""
    if not text:
        return AllocConf()
    tokens = _tokens(text)
    settings: dict = {}
    i = 0
    while i < len(tokens):
        key = tokens[i]
        if key not in KNOWN_KEYS:
            raise _refuse(text, f"option {key!r} is not modelled (the simulator knows {', '.join(KNOWN_KEYS)})")
        value = _value(tokens, i, key, text)
        i += 2
        if key == "expandable_segments":
            if value not in ("True", "False", "true", "false"):
                raise _refuse(text, f"expandable_segments takes True or False, not {value!r}")
            settings["expandable_segments"] = value in ("True", "true")
        elif key == "max_split_size_mb":
            mb = _int(value, key, text)
            if mb < LARGE_BUFFER_BYTES // MIB:  # parseMaxSplitSize: must be >= kLargeBuffer / kMB
                raise _refuse(text, f"max_split_size_mb({mb}) must be >= {LARGE_BUFFER_BYTES // MIB}")
            settings["max_split_size_bytes"] = mb * MIB
        elif key == "garbage_collection_threshold":
            try:
                threshold = float(value)
            except ValueError:
                raise _refuse(text, f"garbage_collection_threshold takes a number, not {value!r}") from None
            if not 0.0 < threshold < 1.0:  # parseGarbageCollectionThreshold: (0.0, 1.0)
                raise _refuse(text, f"garbage_collection_threshold({threshold}) must be in (0.0, 1.0)")
            settings["garbage_collection_threshold"] = threshold
        else:
            settings["roundup_power2_divisions"], i = _divisions(tokens, i, text)
        i += 1
        if i < len(tokens):
            if tokens[i] != ",":
                raise _refuse(text, f"expected ',' after {key}, found {tokens[i]!r}")
            i += 1
    return AllocConf(text=text, **settings)


# --- the allocator ---------------------------------------------------------------------------

def round_size(size: int, conf: AllocConf) -> int:
    """round_size: at least 512 bytes; a multiple of 512, or the next power-of-two division."""
    if size < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    divisions = conf.divisions(size)
    if divisions > 1 and size > MIN_BLOCK_BYTES * divisions:
        return _next_division(size, divisions)
    return MIN_BLOCK_BYTES * -(-size // MIN_BLOCK_BYTES)


def _next_division(size: int, divisions: int) -> int:
    """roundup_power2_next_division: e.g. 1200 with 4 divisions of [1024, 2048) is 1280."""
    if _is_power2(size):
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    below = size & ~(step - 1)
    return size if below == size else below + step


def allocation_size(size: int) -> int:
    """get_allocation_size: the segment cudaMalloc'd for a request no cached block serves."""
    if size <= SMALL_SIZE_BYTES:
        return SMALL_BUFFER_BYTES
    if size < MIN_LARGE_ALLOC_BYTES:
        return LARGE_BUFFER_BYTES
    return ROUND_LARGE_BYTES * -(-size // ROUND_LARGE_BYTES)


@dataclass(eq=False)
class _Block:
    small: bool
    stream: str
    size: int
    addr: int
    segment: "_Segment"
    prev: "_Block | None" = None
    next: "_Block | None" = None
    allocated: bool = False
    mapped: bool = True
    stream_uses: set = field(default_factory=set)
    events: int = 0
    gc_base: int = 0

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None


@dataclass(eq=False)
class _Segment:
    small: bool
    stream: str
    expandable: bool
    base: int
    page: int = 0  # expandable: the page mapped at a time (2 MiB small, 20 MiB large)


class OutOfMemory(Exception):
    """The simulated device cannot reserve what a request needs (torch's OutOfMemoryError)."""


@dataclass
class Stat:
    current: int = 0
    peak: int = 0

    def add(self, n: int) -> None:
        self.current += n
        self.peak = max(self.peak, self.current)


@dataclass(frozen=True)
class AllocatorStats:
    """What torch.cuda.memory_stats() would report, for the replayed stream."""

    allocated_peak_bytes: int
    active_peak_bytes: int
    reserved_peak_bytes: int
    requested_peak_bytes: int
    segments_peak: int  # cudaMalloc segments, or expandable segments (one address range each)
    small_segments_peak: int
    large_segments_peak: int
    segments: int  # at the end of the stream
    reserved_bytes: int  # at the end of the stream
    alloc_retries: int  # requests that emptied the cache to succeed (num_alloc_retries)
    gc_freed_bytes: int


class CachingAllocator:
    """One device's DeviceCachingAllocator. ``capacity_bytes``: what cudaMalloc/cuMemCreate can
    reserve in all (None: unbounded); ``memory_fraction``: torch.cuda.set_per_process_memory_fraction
    (garbage collection runs only when it is set: malloc and get_free_block test set_fraction)."""

    ADDRESS_SPACE = 1 << 48  # an expandable segment's reserved virtual range (never exhausted here)

    def __init__(self, conf: AllocConf = AllocConf(), capacity_bytes: int | None = None,
                 memory_fraction: float | None = None):
        self.conf = conf
        self.capacity = capacity_bytes
        self.allowed = int(memory_fraction * capacity_bytes) if memory_fraction and capacity_bytes else None
        self.gc_on = self.allowed is not None and conf.garbage_collection_threshold > 0.0
        self.free_sets: dict[tuple[bool, str], list] = {}  # (small, stream) -> sorted [(size, addr, id)]
        self.blocks_by_id: dict[int, _Block] = {}
        self.unmapped: dict[tuple[bool, str], list[_Block]] = {}
        self.gc_calls = {True: 0, False: 0}
        self.pending: list[tuple[str, _Block]] = []  # (stream, block): recorded events not yet completed
        self.completed: set[str] = set()
        self.next_addr = 1 << 20
        self.handles: dict[int, _Block] = {}
        self.next_handle = 0
        self.allocated, self.active, self.reserved, self.requested = Stat(), Stat(), Stat(), Stat()
        self.segments = {True: Stat(), False: Stat()}
        self.total_segments = Stat()
        self.retries = 0
        self.gc_freed = 0
        self.requested_of: dict[int, int] = {}

    # --- the free-block sets (BlockPool.blocks ordered by stream, size, address) --------------

    def _insert(self, b: _Block) -> None:
        b.gc_base = self.gc_calls[b.small]
        self.blocks_by_id[id(b)] = b
        bisect.insort(self.free_sets.setdefault((b.small, b.stream), []), (b.size, b.addr, id(b)))

    def _remove(self, b: _Block) -> None:
        entries = self.free_sets[(b.small, b.stream)]
        k = bisect.bisect_left(entries, (b.size, b.addr, id(b)))
        del entries[k]
        del self.blocks_by_id[id(b)]

    # --- public interface --------------------------------------------------------------------

    def malloc(self, size: int, stream: str = "default") -> int:
        """The allocator's malloc: returns a handle for free() and record_stream()."""
        self._process_events()
        rounded = round_size(size, self.conf)
        small = rounded <= SMALL_SIZE_BYTES  # get_pool
        block = self._get_free_block(rounded, small, stream)
        if block is None:
            if self.gc_on:
                self._garbage_collect()
            block = (self._alloc_block(rounded, small, stream)
                     or (self._release_available(rounded, small, stream) and self._alloc_block(rounded, small, stream))
                     or (self._release_cached() and self._retry(rounded, small, stream)))
            if block is None:
                raise OutOfMemory(f"tried to allocate {allocation_size(rounded):,} bytes with "
                                  f"{self.reserved.current:,} reserved of {self.capacity or self.allowed:,}")
        block = self._found(block, rounded)
        handle = self.next_handle
        self.next_handle += 1
        self.handles[handle] = block
        self.requested_of[handle] = size
        self.allocated.add(block.size)
        self.active.add(block.size)
        self.requested.add(size)
        return handle

    def record_stream(self, handle: int, stream: str) -> None:
        """recordStream: a use on another stream delays the block's reuse until that stream's
        work recorded at the free completes (uses on the allocation stream are ignored)."""
        block = self.handles[handle]
        if stream != block.stream:
            block.stream_uses.add(stream)

    def free(self, handle: int) -> None:
        block = self.handles.pop(handle)
        block.allocated = False
        self.allocated.add(-block.size)
        self.requested.add(-self.requested_of.pop(handle))
        if block.stream_uses:  # insert_events: one event per stream used on
            for s in block.stream_uses:
                self.pending.append((s, block))
            block.events = len(block.stream_uses)
            block.stream_uses = set()
        else:
            self._free_block(block)

    def complete(self, stream: str) -> None:
        """The stream's work recorded so far has finished: its events are done (they are
        processed at the next malloc, as process_events does)."""
        self.completed.add(stream)

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            allocated_peak_bytes=self.allocated.peak, active_peak_bytes=self.active.peak,
            reserved_peak_bytes=self.reserved.peak, requested_peak_bytes=self.requested.peak,
            segments_peak=self.total_segments.peak, small_segments_peak=self.segments[True].peak,
            large_segments_peak=self.segments[False].peak, segments=self.total_segments.current,
            reserved_bytes=self.reserved.current, alloc_retries=self.retries, gc_freed_bytes=self.gc_freed)

    # --- malloc's steps ----------------------------------------------------------------------

    def _process_events(self) -> None:
        if self.completed and self.pending:
            process_events(self.pending, self.completed, self._free_block)

    def _expandable_size(self, b: _Block) -> int:
        return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

    def _get_free_block(self, size: int, small: bool, stream: str) -> _Block | None:
        """get_free_block: the smallest cached block of the pool and stream that holds size."""
        if self.gc_on:
            self.gc_calls[small] += 1
        entries = self.free_sets.get((small, stream), [])
        k = bisect.bisect_left(entries, (size, -1, -1))
        if k == len(entries):
            return None
        block = self.blocks_by_id[entries[k][2]]
        if block.segment.expandable:
            # "for the purposes of best fit we consider its size to be the size it can expand to"
            while block.segment.expandable and k + 1 < len(entries):
                nxt = self.blocks_by_id[entries[k + 1][2]]
                if self._expandable_size(nxt) >= self._expandable_size(block):
                    break
                k, block = k + 1, nxt
        max_split = self.conf.max_split
        if size < max_split and block.size >= max_split:
            return None  # "Do not return an oversized block for a large request"
        if size >= max_split and block.size >= size + LARGE_BUFFER_BYTES:
            return None  # max_non_split_rounding_size, 20 MiB by default
        self._remove(block)
        return block

    def _should_split(self, block: _Block, size: int) -> bool:
        remaining = block.size - size
        if block.small or self.conf.expandable_segments:
            return remaining >= MIN_BLOCK_BYTES
        return size < self.conf.max_split and remaining > SMALL_SIZE_BYTES

    def _found(self, block: _Block, size: int) -> _Block:
        """alloc_found_block: split off the remainder when should_split says so."""
        if self._should_split(block, size):
            rest = _Block(block.small, block.stream, block.size - size, block.addr + size, block.segment,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._insert(rest)
        block.allocated = True
        return block

    def _room(self, size: int) -> bool:
        if self.allowed is not None and self.reserved.current + size > self.allowed:
            return False
        return self.capacity is None or self.reserved.current + size <= self.capacity

    def _alloc_block(self, size: int, small: bool, stream: str) -> _Block | None:
        """alloc_block: a new segment (cudaMalloc of get_allocation_size), or, with expandable
        segments, more pages mapped onto the stream's segment."""
        if self.conf.expandable_segments:
            return self._expand(size, small, stream)
        nbytes = allocation_size(size)
        if not self._room(nbytes):
            return None
        segment = _Segment(small, stream, False, self.next_addr)
        self.next_addr += nbytes + (1 << 30)
        self.reserved.add(nbytes)
        self.segments[small].add(1)
        self.total_segments.add(1)
        return _Block(small, stream, nbytes, segment.base, segment)

    def _retry(self, size: int, small: bool, stream: str) -> _Block | None:
        self.retries += 1
        return self._alloc_block(size, small, stream)

    def _free_block(self, block: _Block) -> None:
        """free_block: merge with free neighbours of the same segment, back into the pool."""
        self.active.add(-block.size)
        for other in (block.prev, block.next):
            self._merge(block, other)
        self._insert(block)

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """try_merge_blocks."""
        if src is None or src.allocated or src.events or src.stream_uses or src.mapped != dst.mapped:
            return
        if src.mapped:
            self._remove(src)
        else:
            self.unmapped[(src.small, src.stream)].remove(src)
        _absorb(dst, src)

    def _release(self, block: _Block) -> None:
        """release_block: cudaFree of a whole (unsplit) cached segment."""
        self._remove(block)
        self.reserved.add(-block.size)
        self.segments[block.small].add(-1)
        self.total_segments.add(-1)

    def _release_available(self, size: int, small: bool, stream: str) -> bool:
        """release_available_cached_blocks: with max_split_size set, free oversize cached blocks
        of the pool and stream until the request's size is released."""
        if self.conf.max_split_size_bytes is None or self.conf.expandable_segments:
            return False
        target = max(size, self.conf.max_split)
        entries = self.free_sets.get((small, stream), [])
        k = bisect.bisect_left(entries, (target, -1, -1))
        if k < len(entries):
            self._release_if_whole(self.blocks_by_id[entries[k][2]])
            return True
        released = 0
        for size_b, _, bid in reversed(list(entries)):
            if released >= target or size_b < self.conf.max_split:
                break
            released += size_b
            self._release_if_whole(self.blocks_by_id[bid])
        return released >= target

    def _release_if_whole(self, block: _Block) -> None:
        # torch releases the block found (an oversize block is never split: should_split)
        if not block.is_split:
            self._release(block)

    def _release_cached(self) -> bool:
        """release_cached_blocks: synchronize every stream, then free every unsplit cached
        segment and unmap the free pages of expandable segments."""
        self.completed.update(s for s, _ in self.pending)
        self._process_events()
        for key in list(self.free_sets):
            for _, _, bid in list(self.free_sets[key]):
                block = self.blocks_by_id.get(bid)
                if block is None:
                    continue
                if block.segment.expandable:
                    self._unmap(block)
                elif not block.is_split:
                    self._release(block)
        return True

    def _garbage_collect(self) -> None:
        """garbage_collect_cached_blocks: above threshold x the allowed memory, free unsplit
        large-pool blocks at or above the mean age (get_free_block calls since cached)."""
        threshold = int(self.conf.garbage_collection_threshold * self.allowed)
        if self.reserved.current <= threshold:
            return
        target = self.reserved.current - threshold
        candidates = [self.blocks_by_id[bid] for key, entries in self.free_sets.items() if not key[0]
                      for _, _, bid in entries if not self.blocks_by_id[bid].is_split
                      and not self.blocks_by_id[bid].segment.expandable]
        reclaimed = 0
        while reclaimed < target and candidates:
            ages = [self.gc_calls[False] - b.gc_base for b in candidates]
            mean = sum(ages) / len(ages)
            freed = [b for b, age in zip(candidates, ages) if age >= mean]
            if not freed:
                break
            for b in freed:
                reclaimed += b.size
                self.gc_freed += b.size
                self._release(b)
            candidates = [b for b in candidates if b not in freed]

    # --- expandable segments -----------------------------------------------------------------

    def _expand(self, size: int, small: bool, stream: str) -> _Block | None:
        """try_allocate_expandable_block: the lowest address of the stream's segment where a free
        block followed by unmapped pages (or unmapped pages alone) hold size; map what is missing
        in whole pages (2 MiB small pool, 20 MiB large pool)."""
        key = (small, stream)
        candidate = None
        for u in sorted(self.unmapped.get(key, []), key=lambda b: b.addr):
            c = u.prev if u.prev is not None and not u.prev.allocated and not u.prev.events and u.prev.mapped else u
            if self._span(c) >= size:
                candidate = c
                break
        if candidate is None:
            candidate = self._new_expandable(small, stream)
        grows = candidate.mapped  # a free block followed by unmapped pages
        if grows:
            need, tail = size - candidate.size, candidate.next
            if need <= 0:
                self._remove(candidate)
                return candidate
        else:
            need, tail = size, candidate
        page = tail.segment.page
        nbytes = -(-need // page) * page
        if not self._room(nbytes):
            return None
        mapped = self._map(tail, nbytes)
        if not grows:
            return mapped
        self._remove(candidate)  # map_block's try_merge_blocks: the free block and the new pages are one
        candidate.size += mapped.size
        candidate.next = mapped.next
        if mapped.next is not None:
            mapped.next.prev = candidate
        return candidate

    def _span(self, b: _Block) -> int:
        total = 0
        while b is not None and not b.allocated and not b.events and total < 1 << 62:
            total += b.size
            b = b.next
        return total

    def _new_expandable(self, small: bool, stream: str) -> _Block:
        page = SMALL_BUFFER_BYTES if small else LARGE_BUFFER_BYTES
        segment = _Segment(small, stream, True, self.next_addr, page=page)
        self.next_addr += self.ADDRESS_SPACE
        self.segments[small].add(1)
        self.total_segments.add(1)
        block = _Block(small, stream, self.ADDRESS_SPACE, segment.base, segment, mapped=False)
        self.unmapped.setdefault((small, stream), []).append(block)
        return block

    def _map(self, u: _Block, nbytes: int) -> _Block:
        """map_block: back the first nbytes of unmapped block u with pages; the rest stays unmapped."""
        key = (u.small, u.stream)
        self.unmapped[key].remove(u)
        if nbytes < u.size:
            rest = _Block(u.small, u.stream, u.size - nbytes, u.addr + nbytes, u.segment, prev=u, next=u.next,
                          mapped=False)
            if u.next is not None:
                u.next.prev = rest
            u.next = rest
            u.size = nbytes
            self.unmapped[key].append(rest)
        u.mapped = True
        self.reserved.add(nbytes)
        return u

    def _unmap(self, block: _Block) -> None:
        """unmap_block: the whole pages inside a free block go back to the driver."""
        page = block.segment.page
        base = block.segment.base
        first = -(-(block.addr - base) // page) * page + base
        last = ((block.addr + block.size - base) // page) * page + base
        if first >= last:
            return
        self._remove(block)
        key = (block.small, block.stream)
        before, after = first - block.addr, block.addr + block.size - last
        if before:
            head = _Block(block.small, block.stream, before, block.addr, block.segment, prev=block.prev, next=block)
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            self._insert(head)
        if after:
            tail = _Block(block.small, block.stream, after, last, block.segment, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            self._insert(tail)
        block.addr, block.size, block.mapped = first, last - first, False
        self.reserved.add(-(last - first))
        for other in (block.prev, block.next):
            if other is not None and not other.mapped:
                self.unmapped[key].remove(other)
                _absorb(block, other)
        self.unmapped.setdefault(key, []).append(block)


def process_events(pending: list[tuple[str, Any]], completed: set[str], free_block: Callable[[Any], None]) -> None:
    """process_events: each pending (stream, block) whose stream completed counts one event done;
    a block whose events are all done goes to ``free_block``. ``pending`` keeps the rest (in
    place) and ``completed`` is emptied. Shared by CachingAllocator and fast_replay's allocator."""
    keep = []
    for stream, block in pending:
        if stream in completed:
            block.events -= 1
            if block.events == 0:
                free_block(block)
        else:
            keep.append((stream, block))
    pending[:] = keep
    completed.clear()


def _absorb(dst: "_Block", src: "_Block") -> None:
    """Merge the neighbour ``src`` into ``dst`` (try_merge_blocks: the segment's list spliced, the
    sizes added); the caller has taken ``src`` out of its pool."""
    if dst.prev is src:
        dst.addr = src.addr
        dst.prev = src.prev
        if dst.prev is not None:
            dst.prev.next = dst
    else:
        dst.next = src.next
        if dst.next is not None:
            dst.next.prev = dst
    dst.size += src.size


def single_events(events: list[tuple]) -> list[tuple]:
    """The events with each run written out as the single events it stands for (replay's format)."""
    out: list[tuple] = []
    for event in events:
        if event[0] == "mallocs":
            _, first, count, size, stream = event
            out += [("malloc", tag, size, stream) for tag in range(first, first + count)]
        elif event[0] == "frees":
            out += [("free", tag) for tag in event[1]]
        else:
            out.append(event)
    return out


def replay(events: list[tuple], conf: AllocConf = AllocConf(), capacity_bytes: int | None = None,
           memory_fraction: float | None = None) -> AllocatorStats:
    """Replay ("malloc", tag, bytes, stream) / ("free", tag) / ("record", tag, stream) /
    ("complete", stream) events in order; raises OutOfMemory when the capacity cannot hold them.
    Runs: ("mallocs", first, count, bytes, stream) is the mallocs of tags first .. first + count - 1
    (integers) in that order, ("frees", tags) the frees of a strictly decreasing list of integer
    tags in its order."""
    sim = CachingAllocator(conf, capacity_bytes, memory_fraction)
    handles: dict = {}
    for event in events:
        op = event[0]
        if op == "malloc":
            handles[event[1]] = sim.malloc(event[2], event[3] if len(event) > 3 else "default")
        elif op == "free":
            sim.free(handles.pop(event[1]))
        elif op == "mallocs":
            for tag in range(event[1], event[1] + event[2]):
                handles[tag] = sim.malloc(event[3], event[4])
        elif op == "frees":
            for tag in event[1]:
                sim.free(handles.pop(tag))
        elif op == "record":
            sim.record_stream(handles[event[1]], event[2])
        elif op == "complete":
            sim.complete(event[1])
        else:
            raise ValueError(f"unknown allocator event {op!r}")
    return sim.stats()
