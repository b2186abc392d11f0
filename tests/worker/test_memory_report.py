"""LiveTensorBytes, the CPU peak-activation meter: it counts the storages operators create
while they live, not their inputs, views or in-place results."""

from __future__ import annotations

import torch

from services.worker.memory_report import LiveTensorBytes


def test_peak_counts_live_new_storages_only():
    weight = torch.ones(256, 256)  # made before: not counted
    with LiveTensorBytes() as live:
        a = weight @ weight          # 256 KiB
        b = a.view(-1)               # a view: nothing new
        a.add_(1)                    # in place: nothing new
        c = torch.relu(b)            # 256 KiB more: 512 KiB live
        del a, b, c                  # all freed
        d = torch.zeros(64, 256)     # 64 KiB: below the peak
    assert live.peak == 2 * 256 * 256 * 4
    assert live.now == 64 * 256 * 4
    del d
    assert live.now == 0
