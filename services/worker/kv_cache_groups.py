"""KV cache groups: which layers share one block table (vLLM's hybrid allocator, simplified).

Pure Python, no torch (the rule is the worker's; the scheduler gets its result through
``GetWorkerInfoResponse.kv_cache_groups``).

A layer's attention type is its sliding window (0 = full attention). ``G`` is the smallest
number of layers of any type; each type's layers, in layer order, are cut into chunks of ``G``
(the last may be shorter), and each chunk is a group, the groups ordered by their first layer.
A block id names one block in every layer of its group, so all groups of one model hold
(almost) equally many layers and one block pool serves them all. The layer at position ``j``
of its group keeps its K/V in the worker's ``j``-th ``(k, v)`` tensor pair: layers of
different groups share a pair, told apart by the block ids their groups were given.

Gemma 3 270M (18 layers, 5, 11 and 17 global, the others a 512-token window), G = 3::

    group  window  layers          pair 0  pair 1  pair 2
      0     512    0  1  2         0       1       2
      1     512    3  4  6         3       4       6
      2     full   5 11 17         5       11      17
      3     512    7  8  9         ...
      4     512    10 12 13
      5     512    14 15 16

A model of one attention type (Llama's full attention, Mistral's window everywhere) has one
group of all its layers, and one pair per layer, as without groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVGroup:
    """Layers that share one block table per request.

    Attributes:
        sliding_window: tokens each query attends back over, itself included (0 = full).
        layer_ids: the model's (global) layer indices, ascending.
    """

    sliding_window: int
    layer_ids: tuple[int, ...]


def kv_cache_groups(sliding_windows: list[int]) -> list[KVGroup]:
    """Group the layers of a model whose layer ``i`` has window ``sliding_windows[i]``
    (0 = full attention) by the rule of the module docstring.

    Raises:
        ValueError: no layers, or a negative window.
    """
    if not sliding_windows:
        raise ValueError("a model without layers has no KV cache groups")
    if min(sliding_windows) < 0:
        raise ValueError(f"sliding windows must be >= 0 (0 = full attention): {sliding_windows}")
    by_type: dict[int, list[int]] = {}
    for layer, window in enumerate(sliding_windows):
        by_type.setdefault(window, []).append(layer)
    size = min(map(len, by_type.values()))  # G
    groups = [KVGroup(window, tuple(layers[i:i + size]))
              for window, layers in by_type.items() for i in range(0, len(layers), size)]
    return sorted(groups, key=lambda g: g.layer_ids[0])


@dataclass(frozen=True, slots=True)
class LocalKVLayout:
    """Where one rank's layers keep their K/V.

    Attributes:
        layer_groups: per local layer (in order), the index of its group.
        layer_pairs: per local layer, the index of its ``(k, v)`` pair among the rank's pairs.
        num_pairs: the pairs the rank allocates: one per group position its layers use.
    """

    layer_groups: tuple[int, ...]
    layer_pairs: tuple[int, ...]
    num_pairs: int


def local_kv_layout(groups: list[KVGroup], local_layers: Sequence[int]) -> LocalKVLayout:
    """The layout of a rank holding the global layers ``local_layers`` (a pipeline stage's
    range; every layer on a single rank) of a model grouped as ``groups``: the layer at
    position ``j`` of its group uses the rank's pair for position ``j``.

    Raises:
        KeyError: a layer no group holds.
    """
    slot = {layer: (g, j) for g, group in enumerate(groups)
            for j, layer in enumerate(group.layer_ids)}
    positions = sorted({slot[layer][1] for layer in local_layers})
    index = {j: i for i, j in enumerate(positions)}
    return LocalKVLayout(tuple(slot[layer][0] for layer in local_layers),
                         tuple(index[slot[layer][1]] for layer in local_layers), len(positions))
