"""``KvIndex``: one replica's prefix cache kept from its KV event batches — stores, removals,
clears, snapshots that replace, sequence numbers (replays skipped, gaps and a new publisher
unsync it), and the longest-prefix match over groups and media."""

from __future__ import annotations

from services.router.kv_index import KvIndex
from tests.router.kv_events_fakes import batch, cleared, hashes, removed, stored

BS = 4
A = list(range(100, 100 + 4 * BS))  # 4 full blocks
B = A[:2 * BS] + list(range(200, 200 + 2 * BS))  # shares A's first 2 blocks
HA, HB = hashes(A, BS), hashes(B, BS)


def synced_index(*events, seq: int = 0) -> KvIndex:
    index = KvIndex()
    assert index.apply(batch(seq, *events, snapshot=True))
    return index


def test_nothing_matches_before_the_first_snapshot():
    index = KvIndex()
    assert not index.synced and index.match(HA) == 0
    assert not index.apply(batch(0, stored(HA)))  # a live batch cannot start a stream
    assert not index.synced and index.match(HA) == 0


def test_stores_and_removals_change_the_longest_matched_prefix():
    index = synced_index()
    assert index.match(HA) == 0
    assert index.apply(batch(1, stored(HA[:3])))
    assert index.match(HA) == 3 and index.match(HB) == 2
    assert index.apply(batch(2, stored(HB[2:])))
    assert index.match(HB) == 4
    assert index.apply(batch(3, removed([HA[1]])))  # a hole: nothing after it matches
    assert index.match(HA) == 1 and index.match(HB) == 1
    assert index.apply(batch(4, cleared(), stored(HA[:1])))
    assert index.match(HA) == 1 and index.match(HB) == 1 and len(index) == 1
    assert index.block_size == BS


def test_a_snapshot_replaces_what_the_index_held():
    index = synced_index(stored(HA))
    assert index.match(HA) == 4
    assert index.apply(batch(9, stored(HB), snapshot=True))
    assert index.match(HA) == 2 and index.match(HB) == 4
    assert index.sequence_number == 9
    assert index.apply(batch(10, removed(HB[3:])))  # the next live batch follows the snapshot
    assert index.match(HB) == 3


def test_replayed_batches_are_skipped_and_a_gap_unsyncs():
    index = synced_index(seq=5)
    assert index.apply(batch(6, stored(HA[:2])))
    assert index.apply(batch(6, removed(HA[:2])))  # replayed again: not applied twice
    assert index.match(HA) == 2 and index.sequence_number == 6
    assert not index.apply(batch(8, stored(HA)))  # 7 is missing
    assert not index.synced and index.match(HA) == 0
    assert (index.publisher_id, index.sequence_number) == ("p1", 6)  # kept for the replay
    assert index.apply(batch(7, stored(HA[2:3])))  # the replay from 7 on brings it back
    assert index.synced and index.match(HA) == 3


def test_another_publisher_means_a_restart_and_forgets_everything():
    index = synced_index(stored(HA), seq=3)
    assert not index.apply(batch(4, stored(HB), publisher="p2"))
    assert not index.synced and index.publisher_id == "" and len(index) == 0
    assert index.apply(batch(0, stored(HB), publisher="p2", snapshot=True))
    assert index.publisher_id == "p2" and index.match(HB) == 4 and index.match(HA) == 2


def test_desync_stops_matching_and_a_snapshot_or_a_resume_restores():
    index = synced_index(stored(HA))
    index.desync()
    assert index.match(HA) == 0
    assert index.apply(batch(1, stored(HA), snapshot=True))
    assert index.match(HA) == 4
    index.desync()
    index.resume()  # a replay accepted with nothing to replay
    assert index.match(HA) == 4
    index.reset()
    index.resume()  # nothing held: only a snapshot can bring it back
    assert not index.synced


def test_a_block_stays_while_any_medium_holds_it():
    index = synced_index(stored(HA[:2]), stored(HA[:2], medium="CPU"))
    assert index.apply(batch(1, removed(HA[:2])))  # GPU copies gone
    assert index.match(HA) == 2
    assert index.apply(batch(2, removed(HA[:2], medium="CPU")))
    assert index.match(HA) == 0


def test_with_several_groups_a_block_matches_only_when_every_group_holds_it():
    index = synced_index(stored(HA, group=0), stored(HA[:2], group=1))
    assert index.match(HA) == 2
    assert index.apply(batch(1, stored(HA[2:3], group=1)))
    assert index.match(HA) == 3


def test_a_lora_prompt_matches_only_blocks_computed_with_it():
    lora = hashes(A, BS, b"\x00lora:x\x00/p")
    index = synced_index(stored(HA))
    assert index.match(lora) == 0
    assert index.apply(batch(1, stored(lora[:1])))
    assert index.match(lora) == 1 and index.match(HA) == 4
