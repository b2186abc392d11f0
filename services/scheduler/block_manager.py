"""The paged KV cache's bookkeeping: which physical blocks are free, who holds the rest, and
which full blocks hold a known prefix (automatic prefix caching).

Pure Python, no torch (docs/architecture.md, "KV cache layout"): the worker owns the K/V
tensors, the scheduler owns the block ids. A block holds ``block_size`` consecutive tokens of one
request; a request's block table lists its blocks in logical order, so token ``i`` lives in slot
``table[i // block_size] * block_size + i % block_size``.

    num_computed_tokens + num_new_tokens = 21, block_size = 8  ->  ceil(21 / 8) = 3 blocks
    logical block:   0          1          2
    table:         [ 7 ]      [ 2 ]      [ 5 ]       (physical ids, any order)
    tokens:        0 .. 7     8 .. 15    16 .. 20 (+3 free slots for later tokens)

KV cache groups (vLLM V1's hybrid KV cache manager, "KV cache groups", simplified): the worker
groups the model's layers by attention type (full, or a sliding window of W tokens) into groups
of equally many layers (``GetWorkerInfoResponse.kv_cache_groups``); a block id names one block in
every layer of its group. Every group draws from ONE shared pool of blocks, and a request has
one table per group (``Request.block_ids[g]``), all of the same logical length: block j of every
group holds tokens j*bs .. (j+1)*bs - 1, and each step adds the same number of blocks to every
table. In a group of window W the query at position p reads keys p - W + 1 .. p only, so when a
request is scheduled from ``num_computed_tokens = c`` its block j with (j + 1) * bs <= c - W + 1
is never read again: it is released (ref_count - 1; on the free list it keeps its prefix key)
and the table entry becomes -1 ("no block"). That bounds a decoding request to
ceil(W / bs) + 1 blocks per sliding group (``blocks_for_one_request``):

    bs = 4, W = 6, c = 13 (decoding token 13; it reads keys 8 .. 13)
    full group:    [ 7 ] [ 2 ] [ 5 ] [ 9 ]
    sliding group: [-1 ] [-1 ] [ 4 ] [ 1 ]        blocks 0, 1 end before key 8: released

Prefix caching (vLLM V1's automatic prefix caching; Kwon et al., "Efficient Memory Management
for Large Language Model Serving with PagedAttention", SOSP 2023, §4.4 shared prefixes): the
K/V of a token depends only on the tokens up to it, so a FULL block is identified by its token
ids and everything before it: block ``j`` of a request gets a key chained from the keys before it
(``prefix_keys.py``) and, once its slots are scheduled to be written, is registered under that
key. A later request whose block ``j`` has the same key reuses the physical block (ref_count + 1)
instead of computing it. The cache key is (group, key): each group's blocks hold other layers'
K/V. A hit re-checks the stored token ids and parent key, so even a hash collision cannot hand
out wrong K/V. A hit of n blocks needs, in every full group, blocks 0 .. n-1 cached and, in every
sliding group, only the blocks its window reads from position n*bs on:
max(0, n*bs - W + 1) // bs .. n-1 (the entries before are -1); the hit is the largest such n.
Blocks that no request references go back to the free list with their key; the free list is in
LRU order (freed last = evicted last), so a cached block is reused until allocation has to evict
it.

    free list (LRU -> MRU):  [3] [9] [4*] [1*] [6*]        * = still holds a cached prefix
    allocate() takes from the left; a taken cached block loses its key (eviction).
    a hit on [4*] takes it out of the free list without evicting it.

With prefix caching off, only the n choices of one request (``Request.parent_request_id``) share
blocks: their keys also hash the parent id, so no other request can match them, and a block
loses its key the moment no request holds it (nothing is kept for later requests).

NOTE: blocks are registered when they are ALLOCATED for a step, before the worker has written
them. That is safe because (a) the worker writes every token's K/V of a layer before any
attention of that layer reads the cache, so a request that hits a block registered earlier in
the same step reads it after it is written; (b) the scheduler never preempts a request it
already scheduled in the same step, so a registered block is always computed, except by a
request the workers leave out (a LoRA adapter they cannot load), whose adapter id the engine
retires with its requests (``Engine._fail_requests``: only that id's requests could hit those
blocks); (c) after a worker failure every request is aborted and ``reset_prefix_cache`` forgets
all keys. Likewise a block a sliding window released while an earlier step that reads it is
still in flight may be handed to another request at once: the workers run steps in order, so
it is rewritten only after that step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.scheduler.kv_events import KVEventLog
from services.scheduler.kv_tier import TIER, KVTier, TierLoad
from services.scheduler.prefix_keys import BlockHash, CacheKey, block_hashes
from services.scheduler.request import Request

MISS = -1  # a prefix lookup's "not cached" (and a table's "no block": a window has left it)


@dataclass(slots=True)
class Block:
    """One physical KV block.

    Attributes:
        block_id: index into the worker's KV tensors.
        ref_count: number of block tables that list it.
        block_hash: its (group, prefix key) while it is in the prefix cache, else None.
        token_ids: the tokens it holds while cached (re-checked on every hit).
        parent_hash: the key of the block before it while cached (re-checked on every hit).
    """

    block_id: int
    ref_count: int = 0
    block_hash: CacheKey | None = None
    token_ids: tuple[int, ...] | None = None
    parent_hash: BlockHash | None = None


class BlockManager:
    """Allocates KV blocks to requests from an LRU free list, sharing cached prefixes, one block
    table per KV cache group.

    Invariant (``check_invariants``): every block is either on the free list with
    ``ref_count == 0`` or off it with ``ref_count > 0``, so
    ``num_free_blocks + #{blocks with ref_count > 0} == num_blocks`` at all times; and every
    key in the prefix cache maps to a block that carries that key.

    Args:
        num_blocks: physical blocks in the KV cache (the minimum over worker ranks), shared by
            all groups.
        block_size: tokens per block.
        enable_prefix_caching: share full blocks of identical prefixes (default on).
        sliding_windows: per KV cache group, its sliding window in tokens (0 = full attention);
            default one full-attention group.
        tier: the KV tier on disk, whose blocks extend prefix hits (``kv_tier.py``); None.
        events: the log every change of ``cached_blocks`` is reported to (``kv_events.py``);
            None: KV events off.

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` is < 1, no group, or a window < 0.
    """

    def __init__(self, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True,
                 sliding_windows: Sequence[int] = (0,), tier: KVTier | None = None,
                 events: KVEventLog | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not sliding_windows or min(sliding_windows) < 0:
            raise ValueError(f"need >= 1 KV cache group, windows >= 0; got {sliding_windows}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_windows = list(sliding_windows)
        self.num_groups = len(self.sliding_windows)
        self.blocks = [Block(block_id) for block_id in range(num_blocks)]
        # NOTE: an OrderedDict, not a deque: a prefix hit takes a block out of the MIDDLE of the
        # free list in O(1). Left = least recently freed = allocated (evicted) first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[CacheKey, Block] = {}  # (group, prefix key) -> block holding it
        self.tier = tier
        self.events = events

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by a request, counted from ref counts (O(num_blocks); for stats and
        leak checks, independent of the free list)."""
        return sum(1 for b in self.blocks if b.ref_count > 0)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a registered prefix, referenced or not."""
        return len(self.cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0.0 (empty) .. 1.0 (full). Cached blocks
        that nobody references count as free: allocation may evict them."""
        return 1.0 - len(self.free_block_ids) / self.num_blocks

    def num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens: ceil(num_tokens / block_size)."""
        return -(-num_tokens // self.block_size)

    def num_blocks_held(self, request: Request, group: int | None = None) -> int:
        """Blocks ``request``'s tables list (shared ones too): in ``group``, or in all groups."""
        tables = request.block_ids if group is None else request.block_ids[group:group + 1]
        return sum(1 for table in tables for block_id in table if block_id >= 0)

    def blocks_for_one_request(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of up to ``num_tokens`` tokens holds at once when a step
        computes at most ``max_chunk`` of its tokens: ceil(num_tokens / bs) per full group and
        min(that, ceil((max_chunk + W - 1) / bs) + 1) per sliding group of window W
        (ceil(W / bs) + 1 while decoding). A step from c computing k tokens needs its blocks
        from (c - W + 1) // bs to ceil((c + k) / bs) - 1."""
        n = self.num_blocks_needed(num_tokens)
        return sum(min(n, self.num_blocks_needed(max_chunk + w - 1) + 1) if w else n
                   for w in self.sliding_windows)

    # ---- prefix cache ---------------------------------------------------------------------
    def shares_blocks(self, request: Request) -> bool:
        """Whether ``request`` takes part in block sharing: always with prefix caching on;
        with it off, only the choices of an n > 1 request (``parent_request_id`` set)."""
        return self.enable_prefix_caching or bool(request.parent_request_id)

    def _first_needed_block(self, group: int, num_computed_tokens: int) -> int:
        """The first logical block a step from ``num_computed_tokens`` reads in ``group``: 0 for
        full attention, max(0, c - W + 1) // block_size for a window W (the blocks before it
        are skipped: released, -1 in the table)."""
        w = self.sliding_windows[group]
        return max(0, num_computed_tokens - w + 1) // self.block_size if w else 0

    def get_computed_blocks(self, request: Request) -> tuple[list[list[int]], int]:
        """The longest cached prefix of ``request``: one block table per group, and the number
        of tokens they hold.

        A hit of n blocks needs blocks 0 .. n-1 cached in every full group and, in a sliding
        group, only the blocks the window reads from position n * block_size on
        (``_first_needed_block``; the entries before are -1). At least one token is always left
        to compute (the step that computes it samples the next token), so
        n <= (num_tokens - 1) // block_size. Each hit re-checks the block's stored tokens and
        parent key. With a KV tier, a block the RAM cache lacks but the tier holds is a hit too:
        its entry is ``TIER`` (``allocate`` gives it a block and a load). Nothing is reserved:
        pass the tables to ``allocate`` in the same scheduling pass (the scheduler counts the
        lookup: ``prefix_cache_queries_total`` / ``prefix_cache_hits_total``).

        Cost: O(n) lookups per group (a sliding group's search goes right to left, as vLLM's).

        Returns:
            ([] and 0 for no hit, or the n-block tables in logical order, n * block_size).
        """
        if not self.shares_blocks(request):
            return [], 0
        bs = self.block_size
        n = (request.num_tokens - 1) // bs
        tier = self.tier
        if n <= 0 or not (self.cached_blocks or tier):
            return [], 0
        hashes = block_hashes(request, n, bs, self.enable_prefix_caching)
        found: dict[tuple[int, int], int] = {}  # (group, j) -> hit block id, or -1

        def hit(group: int, j: int) -> int:
            if (group, j) not in found:
                block = self.cached_blocks.get((group, hashes[j]))
                ok = block is not None and block.parent_hash == (hashes[j - 1] if j else b"") and (
                    block.token_ids == tuple(request.token_ids_slice(j * bs, (j + 1) * bs)))
                found[group, j] = (block.block_id if ok and block is not None else
                                   MISS if tier is None else self._tier_hit(group, j, hashes,
                                                                            request))
            return found[group, j]

        windows = self.sliding_windows
        for g in (g for g, w in enumerate(windows) if not w):  # a prefix of every full group
            n = next((j for j in range(n) if hit(g, j) == MISS), n)
        # NOTE: a sliding group missing block j < n rules out every hit in j+1 .. n (they all
        # need block j), so the next candidate is j; n only shrinks.
        sliding = [g for g, w in enumerate(windows) if w]
        while n > 0:
            for g in sliding:
                first = self._first_needed_block(g, n * bs)
                miss = next((j for j in range(n - 1, first - 1, -1) if hit(g, j) == MISS),
                            None)
                if miss is not None:
                    n = miss
                    break
            else:
                break
        if n == 0:
            return [], 0
        return [[hit(g, j) if j >= self._first_needed_block(g, n * bs) else -1 for j in range(n)]
                for g in range(self.num_groups)], n * bs

    def _tier_hit(self, group: int, j: int, hashes: list[BlockHash], request: Request) -> int:
        """Block ``j`` of ``request`` in ``group``, which the RAM cache lacks: the KV block a
        load of it is filling (the hit waits for that load), ``TIER`` when the tier holds it,
        else ``MISS``."""
        assert self.tier is not None
        bs = self.block_size
        loading = self.tier.loading_block(group, hashes[j], hashes[j - 1] if j else b"",
                                          tuple(request.token_ids_slice(j * bs, (j + 1) * bs)))
        if loading is not None:
            return loading
        return TIER if self.tier.holds(group, hashes[j]) else MISS

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every full block among the first ``num_tokens`` tokens not yet registered,
        in every group.

        A block whose key is already cached (another physical block got there first) stays
        private: the existing entry is kept, as in vLLM.
        """
        num_full = num_tokens // self.block_size
        start = request.num_cached_blocks
        if num_full <= start:
            return
        bs = self.block_size
        hashes = block_hashes(request, num_full, bs, self.enable_prefix_caching)
        tokens = request.token_ids_slice(start * bs, num_full * bs)
        for g, table in enumerate(request.block_ids):
            for j in range(start, num_full):
                key = (g, hashes[j])
                if table[j] >= 0 and key not in self.cached_blocks:
                    block = self.blocks[table[j]]
                    if block.block_hash is None:
                        block.block_hash = key
                        off = (j - start) * bs
                        block.token_ids = tuple(tokens[off:off + bs])
                        block.parent_hash = hashes[j - 1] if j else b""
                        self.cached_blocks[key] = block
                        if self.events is not None:
                            self.events.stored(key, block.parent_hash, block.token_ids,
                                               request.lora)
                        if self.tier is not None:
                            self.tier.registered(block.block_id, g, hashes[j])
        request.num_cached_blocks = num_full

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
                if self.events is not None:
                    self.events.removed(block.block_hash)
            block.block_hash = block.token_ids = block.parent_hash = None

    def forget(self, request: Request) -> None:
        """Take every block ``request``'s tables list out of the prefix cache (K/V the workers
        never wrote: a request they left out)."""
        for block_id in (b for table in request.block_ids for b in table if b >= 0):
            self._evict(self.blocks[block_id])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. the workers restarted with empty KV caches) and
        the KV tier's loads in flight (their references go). Blocks that requests still hold
        stay theirs."""
        if self.tier is not None:
            for block_id in self.tier.abandon():
                self._release(self.blocks[block_id])
        for block in self.cached_blocks.values():
            block.block_hash = block.token_ids = block.parent_hash = None
        self.cached_blocks.clear()
        if self.events is not None:
            self.events.cleared()

    # ---- allocation -----------------------------------------------------------------------
    def _skipped_blocks(self, request: Request) -> list[tuple[list[int], int]]:
        """The (table, j) entries a step from ``request.num_computed_tokens`` no longer reads
        and that still hold a block: sliding groups' blocks before ``_first_needed_block``.
        Newest first (as vLLM's ``remove_skipped_blocks``), stopping at the first entry already
        -1, so O(entries returned)."""
        skipped = []
        c = request.num_computed_tokens
        for g, table in enumerate(request.block_ids):
            j = min(len(table), self._first_needed_block(g, c)) - 1
            while j >= 0 and table[j] >= 0:
                skipped.append((table, j))
                j -= 1
        return skipped

    def _plan(self, request: Request, num_new_tokens: int,
              computed_block_ids: Sequence[Sequence[int]]
              ) -> tuple[int, int, list[tuple[list[int], int]]]:
        """What ``allocate`` would do: (new blocks per group, blocks it takes off the free list
        (new ones + hits nobody references), skipped entries it releases first)."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        blocks = self.blocks
        if not computed_block_ids:
            num_held = len(request.block_ids[0]) if request.block_ids else 0
            needed = self.num_blocks_needed(request.num_computed_tokens + num_new_tokens)
            num_new = max(0, needed - num_held)
            return num_new, num_new * self.num_groups, self._skipped_blocks(request)
        if request.block_ids:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_hit = len(computed_block_ids[0])
        if len(computed_block_ids) != self.num_groups or any(
                len(t) != num_hit for t in computed_block_ids):
            raise ValueError(f"a prefix hit needs {self.num_groups} tables of equal length")
        needed = self.num_blocks_needed(num_hit * self.block_size + num_new_tokens)
        num_new = max(0, needed - num_hit)
        num_free_hits = sum(1 for t in computed_block_ids for b in t
                            if b == TIER or (b >= 0 and blocks[b].ref_count == 0))
        return num_new, num_new * self.num_groups + num_free_hits, []

    def _room(self, skipped: list[tuple[list[int], int]]) -> int:
        """Free blocks once the ``skipped`` entries are released."""
        blocks = self.blocks
        return len(self.free_block_ids) + sum(
            1 for table, j in skipped if blocks[table[j]].ref_count == 1)

    def can_allocate(self, request: Request, num_new_tokens: int,
                     computed_block_ids: Sequence[Sequence[int]] = ()) -> bool:
        """Whether ``allocate`` with the same arguments would succeed (counting every group,
        and the blocks its sliding windows release first).

        Raises:
            ValueError: as ``allocate``.
        """
        _, num_take, skipped = self._plan(request, num_new_tokens, computed_block_ids)
        return num_take <= self._room(skipped)

    def allocate(self, request: Request, num_new_tokens: int,
                 computed_block_ids: Sequence[Sequence[int]] = ()) -> list[int]:
        """Grow every table of ``request`` to cover ``request.num_computed_tokens +
        num_new_tokens`` slots (the same number of new blocks in each), and register the full
        blocks among them in the prefix cache. First the blocks its sliding windows no longer
        read from ``num_computed_tokens`` on are released (-1 in the table).

        ``computed_block_ids`` is a prefix hit from ``get_computed_blocks`` (one table per
        group) for a request that holds no blocks yet: they become its tables (ref_count + 1),
        the slots count from their end, and the caller sets ``num_computed_tokens`` to their
        token count.

        Returns:
            The newly allocated block ids, group by group (empty if the tables already cover
            the slots).

        Raises:
            RuntimeError: not enough free blocks (call ``can_allocate`` first); nothing changes.
            ValueError: ``num_new_tokens`` < 0, or hit tables for a request that holds blocks
                (or not one per group, of equal lengths).
        """
        num_new, num_take, skipped = self._plan(request, num_new_tokens, computed_block_ids)
        room = self._room(skipped)
        if num_take > room:
            raise RuntimeError(
                f"request {request.request_id} needs {num_take} more KV blocks but only "
                f"{room} are free"
            )
        blocks = self.blocks
        for table, j in skipped:
            self._release(blocks[table[j]])
            table[j] = -1
        if computed_block_ids:
            num_computed = self._take_hit(request, computed_block_ids)
        else:
            if not request.block_ids:
                request.block_ids = [[] for _ in range(self.num_groups)]
            num_computed = request.num_computed_tokens
        new_block_ids = []
        for table in request.block_ids:
            for _ in range(num_new):
                block_id = self._take_free().block_id
                table.append(block_id)
                new_block_ids.append(block_id)
        num_tokens = min(num_computed + num_new_tokens, request.num_tokens)
        if self.shares_blocks(request):
            self._cache_full_blocks(request, num_tokens)
        else:  # NOTE: nothing to register, but the scheduler's fast path reads the count
            request.num_cached_blocks = num_tokens // self.block_size
        return new_block_ids

    def _take_hit(self, request: Request, hit: Sequence[Sequence[int]]) -> int:
        """Make the prefix hit ``hit`` (one table per group) ``request``'s tables, a reference
        more on each block (a block still loading: the request waits for it, ``KVTier.join``);
        a ``TIER`` entry gets a free block, held by the table and by its load
        (``KVTier.start_load``). Returns the tokens they hold."""
        tier = self.tier
        for block_id in (b for table in hit for b in table if b >= 0):
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            if tier is not None and block_id in tier.in_flight:
                tier.join(block_id, request)  # (a block still loading: it waits too)
        request.block_ids = tables = [list(t) for t in hit]
        for g, table in enumerate(tables):
            for j in (j for j, b in enumerate(table) if b == TIER):
                assert self.tier is not None, "a TIER entry without a tier"
                block = self._take_free()
                block.ref_count = 2  # (the table's and the load's)
                table[j] = block.block_id
                bs, hashes = self.block_size, request.block_hashes
                self.tier.start_load(block.block_id, g, hashes[j], request,
                                     tuple(request.token_ids_slice(j * bs, (j + 1) * bs)),
                                     hashes[j - 1] if j else b"")
        request.num_cached_blocks = len(hit[0])
        return request.num_cached_blocks * self.block_size

    def _take_free(self) -> Block:
        """The least recently freed block, evicted from the prefix cache, ref_count 1."""
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has refs"
        if block.block_hash is not None:
            self._evict(block)
        block.ref_count = 1
        return block

    def finish_load(self, block_id: int, ok: bool) -> TierLoad | None:
        """The KV tier's load into ``block_id`` is back from every rank (``ok``: it holds the
        file's K/V): the block joins the prefix cache under its key (unless another block got
        there first) and the load's reference goes. Returns the load (None: no load into that
        block, a stale report); its request's counters are the caller's."""
        load = self.tier.finished(block_id, ok) if self.tier is not None else None
        if load is None:
            return None
        block = self.blocks[block_id]
        key = (load.group, load.key)
        if ok and block.block_hash is None and key not in self.cached_blocks:
            block.block_hash, block.token_ids, block.parent_hash = (
                key, load.token_ids, load.parent_hash)
            self.cached_blocks[key] = block
            if self.events is not None:  # (every waiter runs the same adapter: it is in the key)
                self.events.stored(key, load.parent_hash, load.token_ids,
                                   load.waiters[0][0].lora if load.waiters else None)
        self._release(block)
        return load

    @property
    def num_shared_blocks(self) -> int:
        """Blocks listed by more than one block table (prefix hits, n > 1 choices, beams);
        O(num_blocks), for stats."""
        return sum(1 for b in self.blocks if b.ref_count > 1)

    def _release(self, block: Block) -> None:
        """One table stops listing ``block``; with no user left it goes to the MRU end of the
        free list, keeping its prefix key only with prefix caching on."""
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_block_ids[block.block_id] = None
            if not self.enable_prefix_caching and block.block_hash is not None:
                self._evict(block)  # NOTE: without prefix caching nothing outlives its users

    def free(self, request: Request) -> None:
        """Release every block of ``request`` and clear its block tables (to ``[]``). Cached
        blocks keep their prefix key on the free list until allocation evicts them (with prefix
        caching off, a block nobody holds any more loses its key at once).

        Calling it twice is harmless (no tables the second time).

        Raises:
            AssertionError: a block in a table was already free (a double free elsewhere).
        """
        # NOTE: free the tail first (block j of every group, then j - 1, ...), so the free list
        # gets the request's last blocks before its first: a shared prefix's first blocks are
        # evicted last.
        for column in reversed(list(zip(*request.block_ids, strict=True))):
            for block_id in column:
                if block_id >= 0:
                    self._release(self.blocks[block_id])
        # NOTE: a new list, not .clear(): messages already sent may hold the old list object.
        request.block_ids = []
        request.num_cached_blocks = request.kv_loads_pending = 0
        request.kv_load_failed = False  # (its loads' blocks stay held by the loads)
        request.kv_loaded_blocks = []

    def trim(self, request: Request, num_slots: int) -> int:
        """Release the trailing blocks of every table of ``request`` past the first
        ``ceil(num_slots / block_size)``: after speculative decoding rejected drafts, the blocks
        only rejected tokens used (their K/V is dead; nothing registered them, since only full
        blocks of real tokens are cached). Returns the number of blocks released per table.

        Raises:
            ValueError: ``num_slots`` would drop a block the prefix cache registered for it
                (``num_cached_blocks``), i.e. one holding real tokens.
        """
        keep = self.num_blocks_needed(num_slots)
        if not request.block_ids or len(request.block_ids[0]) <= keep:
            return 0
        if keep < request.num_cached_blocks:
            raise ValueError(f"request {request.request_id}: trim to {keep} blocks would drop "
                             f"{request.num_cached_blocks - keep} full blocks of its tokens")
        num_dropped = len(request.block_ids[0]) - keep
        for table in request.block_ids:
            for block_id in reversed(table[keep:]):
                if block_id >= 0:
                    self._release(self.blocks[block_id])
            del table[keep:]
        return num_dropped

    def check_invariants(self, requests: Iterable[Request] | None = None) -> None:
        """Assert the exact accounting (O(num_blocks); for tests and debugging).

        With ``requests`` (every request that holds blocks), also assert that each block's
        ``ref_count`` equals the number of block tables that list it, that a request has one
        table per group, all of one length, and that -1 appears only where a sliding window has
        left (block j of window W with (j + 1) * block_size <= num_computed_tokens - W + 1).

        Raises:
            AssertionError: with a message naming the inconsistency.
        """
        free = self.free_block_ids
        num_used = 0
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} ref_count {block.ref_count}"
            if block.block_id in free:
                assert block.ref_count == 0, f"free block {block.block_id} has refs"
            else:
                assert block.ref_count > 0, f"block {block.block_id} leaked (no refs, not free)"
                num_used += 1
            if block.block_hash is not None:
                assert self.cached_blocks.get(block.block_hash) is block, (
                    f"block {block.block_id} has a key that the cache maps elsewhere")
        assert self.num_free_blocks + num_used == self.num_blocks
        for key, block in self.cached_blocks.items():
            assert block.block_hash == key, f"cache key of block {block.block_id} is stale"
        if requests is not None:
            refs = [0] * self.num_blocks
            for request in requests:
                rid, tables = request.request_id, request.block_ids
                assert not tables or (len(tables) == self.num_groups and len(
                    {len(t) for t in tables}) == 1), f"request {rid} has tables of other shapes"
                ids = [b for t in tables for b in t if b >= 0]
                assert len(set(ids)) == len(ids), f"request {rid} lists a block twice"
                for g, table in enumerate(tables):
                    first = self._first_needed_block(g, request.num_computed_tokens)
                    assert all(b >= 0 for b in table[first:]), (
                        f"request {rid}: group {g} has no block where its window reads")
                for block_id in ids:
                    refs[block_id] += 1
            for block_id in self.tier.in_flight if self.tier is not None else ():
                refs[block_id] += 1  # (a load's reference)
            for block in self.blocks:
                assert refs[block.block_id] == block.ref_count, (
                    f"block {block.block_id}: ref_count {block.ref_count} but "
                    f"{refs[block.block_id]} block tables list it"
                )
