"""KV event batches for the router's cache_aware tests: a prompt's block hashes as the scheduler
keys them, and the batches a scheduler would publish for them."""

from __future__ import annotations

from services.common.block_hash import chain_hashes, external_block_hash
from services.common.pb.pagedserve.v1 import engine_pb2


def hashes(tokens: list[int], block_size: int, extra: bytes = b"") -> list[int]:
    """The external hashes of the full blocks of ``tokens``."""
    return [external_block_hash(k) for k in chain_hashes(tokens, block_size, extra)]


def stored(block_hashes: list[int], group: int = 0, medium: str = "GPU",
           block_size: int = 4) -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(block_stored=engine_pb2.KvBlockStored(
        block_hashes=block_hashes, block_size=block_size, medium=medium, group_idx=group))


def removed(block_hashes: list[int], group: int = 0, medium: str = "GPU") -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(block_removed=engine_pb2.KvBlockRemoved(
        block_hashes=block_hashes, medium=medium, group_idx=group))


def cleared() -> engine_pb2.KvEvent:
    return engine_pb2.KvEvent(all_blocks_cleared=engine_pb2.KvAllBlocksCleared())


def batch(seq: int, *events, publisher: str = "p1", snapshot: bool = False
          ) -> engine_pb2.KvEventBatch:
    """One batch; a snapshot starts with AllBlocksCleared, as the contract says."""
    if snapshot:
        events = (cleared(), *events)
    return engine_pb2.KvEventBatch(sequence_number=seq, events=list(events),
                                   snapshot=snapshot, publisher_id=publisher)
