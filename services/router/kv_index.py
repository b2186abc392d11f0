"""One scheduler replica's prefix cache as the router knows it from the replica's KV events
(``SubscribeKvEvents``, engine.proto): which full KV blocks it holds, by their 64-bit
external hash (``common/block_hash.external_block_hash``).

``KvIndex.apply`` takes the replica's ``KvEventBatch`` messages in order:

- a *snapshot* (``AllBlocksCleared`` then one ``BlockStored`` per cached block) replaces
  whatever the index held and makes it *synced*, at the snapshot's ``sequence_number`` and
  ``publisher_id``;
- a live batch applies its events (``BlockStored`` adds, ``BlockRemoved`` drops,
  ``AllBlocksCleared`` empties) when it is the next one (``sequence_number`` = last + 1, same
  ``publisher_id``), and makes an unsynced index synced again (a replay that follows on);
  an older one is a replayed duplicate and is skipped; a later one (a gap)
  or one from another publisher (the scheduler restarted) leaves the index *unsynced*: not to
  be trusted for routing until the subscriber resyncs (``kv_event_subscriber.py``: a replay
  from last + 1, else a snapshot).

A block counts as held while any medium (``GPU``, ``CPU``) holds it: the scheduler counts a
hit in its KV tier as cached tokens too. The index keeps one bit per (group, hash, medium), not
a count: the scheduler caches one block per (group, key) (``block_manager.cached_blocks``), so
a key is stored once and removed once.

NOTE (KV cache groups): a model with several groups (a sliding-window model) reports each
group's blocks. ``match`` counts a block as held only when every group the replica reported
holds it. The scheduler needs only a sliding group's window, so with such a model the prediction
can fall short of the real hit; it stays exact for one group (every model without sliding
window attention).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.common.pb.pagedserve.v1 import engine_pb2

log = logging.getLogger(__name__)

# (KV cache group, external block hash) -> the media holding it, one bit each
_Key = tuple[int, int]
_MEDIA = {"GPU": 1, "CPU": 2}
_OTHER_MEDIUM = 4  # any other name (all such media share this bit)


class KvIndex:
    """The blocks one replica holds, kept from its KV event batches.

    Attributes:
        publisher_id: the publisher of the batches applied ("" before the first snapshot).
        sequence_number: the last batch applied (-1 before the first snapshot).
        synced: whether the index follows the replica now (a snapshot, then every batch in
            order); ``match`` answers 0 while it does not.
        block_size: tokens per block, as the events say (0 before one said).
    """

    def __init__(self) -> None:
        self._blocks: dict[_Key, int] = {}
        self._groups: set[int] = set()
        self.publisher_id = ""
        self.sequence_number = -1
        self.synced = False
        self.block_size = 0

    def __len__(self) -> int:
        """Blocks held (per group and hash, any medium)."""
        return len(self._blocks)

    def desync(self) -> None:
        """Stop trusting the index (its stream broke): ``match`` answers 0 until the next
        snapshot or the replayed batches bring it back (the blocks and the sequence number are
        kept, for the replay)."""
        self.synced = False

    def reset(self) -> None:
        """Forget everything, publisher included: the next stream must start with a
        snapshot."""
        self._blocks.clear()
        self._groups.clear()
        self.publisher_id = ""
        self.sequence_number = -1
        self.synced = False

    def apply(self, batch: engine_pb2.KvEventBatch) -> bool:
        """Apply one batch of the replica's stream.

        Returns:
            True when the batch was applied or was an already applied one (a replay overlap);
            False when it does not follow on (a gap in the sequence numbers, another
            publisher, or a live batch before any snapshot): the index is then unsynced and the
            stream must be reopened (a replay from ``sequence_number + 1``, else a snapshot).
        """
        if batch.snapshot:
            self._blocks.clear()
            self._groups.clear()
            self._apply_events(batch.events)
            self.publisher_id = batch.publisher_id
            self.sequence_number = batch.sequence_number
            self.synced = True
            return True
        if not self.publisher_id or batch.publisher_id != self.publisher_id:
            if self.publisher_id:
                log.info("KV events: publisher %s replaced %s (the scheduler restarted)",
                         batch.publisher_id, self.publisher_id)
                self.reset()
            self.synced = False
            return False
        if batch.sequence_number <= self.sequence_number:
            return True  # replayed again: already applied
        if batch.sequence_number != self.sequence_number + 1:
            log.info("KV events: gap after batch %d (got %d); resyncing",
                     self.sequence_number, batch.sequence_number)
            self.synced = False
            return False
        self._apply_events(batch.events)
        self.sequence_number = batch.sequence_number
        self.synced = True
        return True

    def resume(self) -> None:
        """Trust the index again without a batch: its replica accepted a replay from
        ``sequence_number + 1`` under ``publisher_id`` and had nothing to replay (see
        ``kv_event_subscriber.RESUME_GRACE``). Nothing without a publisher."""
        if self.publisher_id:
            self.synced = True

    def _apply_events(self, events) -> None:
        blocks = self._blocks
        for event in events:
            kind = event.WhichOneof("event")
            if kind == "block_stored":
                e = event.block_stored
                if e.block_size:
                    self.block_size = e.block_size
                self._groups.add(e.group_idx)
                bit = _MEDIA.get(e.medium, _OTHER_MEDIUM)
                for h in e.block_hashes:
                    key = (e.group_idx, h)
                    blocks[key] = blocks.get(key, 0) | bit
            elif kind == "block_removed":
                r = event.block_removed
                bit = _MEDIA.get(r.medium, _OTHER_MEDIUM)
                for h in r.block_hashes:
                    key = (r.group_idx, h)
                    media = blocks.get(key, 0) & ~bit
                    if media:
                        blocks[key] = media
                    else:
                        blocks.pop(key, None)
            elif kind == "all_blocks_cleared":
                blocks.clear()
                self._groups.clear()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt the replica holds.

        Args:
            hashes: the prompt's full blocks' external hashes, first first
                (``external_block_hash`` of ``chain_hashes``).

        Returns:
            The number of blocks 0 .. n-1 held in every group the replica reported; 0 while the
            index is unsynced or empty.
        """
        if not self.synced or not self._blocks:
            return 0
        groups = self._groups or {0}
        blocks = self._blocks
        for j, h in enumerate(hashes):
            if any((g, h) not in blocks for g in groups):
                return j
        return len(hashes)
