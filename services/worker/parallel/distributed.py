"""Rank layout and torch.distributed set-up of a tensor- and pipeline-parallel worker group.

``world_size = tensor_parallel_size * pipeline_parallel_size`` ranks, laid out stage-major::

    rank = pp_rank * tp_size + tp_rank

              tp_rank 0   tp_rank 1  ...
    stage 0   rank 0      rank 1          layers [0, L0)          embeds the tokens
    stage 1   rank N      rank N+1        layers [L0, L1)
    ...
    stage M-1 rank (M-1)N ...             layers [.., L)          norm, LM head, sampling
              ^ the driver: the only rank whose StepResult carries tokens

Each stage's ranks form one tensor-parallel group (all-reduce of the row-parallel layers,
all-gather of the vocab-parallel logits). Hidden states ``[T, E]`` go from rank ``r`` to rank
``r + tp_size`` (same tp_rank, next stage) with point-to-point send/recv.

Backends: gloo on CPU, NCCL on CUDA. Rendezvous is at rank 0's TCPStore, ``--dist-init-addr
HOST:PORT`` (or the torch.distributed variables ``MASTER_ADDR`` / ``MASTER_PORT``), on this host
or another (``services/worker/parallel/rendezvous.py``). Every collective has a timeout, and a
heartbeat
through the store notices a silent peer, so a rank whose peer died fails (or ends) instead of
blocking forever; such a rank must then exit (its process group is unusable) and the group be
restarted (the process layer, ``services/cli/ranks.py``, does that on each host).

Teardown: a process that joined a group must not reach interpreter exit with the group alive.
ProcessGroupGloo owns C++ worker threads; if its destructor has not run by then, they are
destroyed still joinable during finalization and the process aborts (SIGABRT, "terminate
called without an active exception"; PyTorch issues #65231 and #190489). A process that ends
normally calls ``destroy_distributed`` first; a worker rank leaves with ``os._exit``, which
skips finalization altogether (its forward thread may be stuck in a collective on a dead peer).
"""

from __future__ import annotations

import logging
import os
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from services.worker.parallel.layer_partition import format_partition
from services.worker.parallel.rendezvous import Heartbeat, rendezvous, rendezvous_address

log = logging.getLogger(__name__)
_heartbeat: Heartbeat | None = None  # this process's, once it joined a group


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Which rank this process is. Raises ValueError (naming the flag) on bad sizes."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank: int = 0
    layer_partition: tuple[int, ...] | None = None  # layers per stage; None = even

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ValueError(
                f"--pipeline-parallel-size must be >= 1, got {self.pipeline_parallel_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"--rank {self.rank} is not in [0, {self.world_size}) (world size = "
                             "--tensor-parallel-size x --pipeline-parallel-size)")
        if self.layer_partition is not None and (
                len(self.layer_partition) != self.pipeline_parallel_size):
            raise ValueError(
                f"--pipeline-layer-partition {format_partition(self.layer_partition)} has "
                f"{len(self.layer_partition)} stages but --pipeline-parallel-size is "
                f"{self.pipeline_parallel_size}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pipeline_parallel_size - 1

    @property
    def is_driver(self) -> bool:
        """True on the rank that samples and answers tokens (tp rank 0 of the last stage)."""
        return self.is_last_stage and self.tp_rank == 0

    def layer_range(self, num_layers: int) -> range:
        """This stage's contiguous layers: ``layer_partition``'s count when given, else an even
        split where earlier stages take one extra when uneven.

        Raises:
            ValueError: fewer layers than stages, or a partition that does not sum to
                ``num_layers`` (naming both numbers).
        """
        m = self.pipeline_parallel_size
        if self.layer_partition is not None:
            total = sum(self.layer_partition)
            if total != num_layers:
                raise ValueError(
                    f"--pipeline-layer-partition {format_partition(self.layer_partition)} sums "
                    f"to {total} layers but the model has {num_layers}")
            start = sum(self.layer_partition[:self.pp_rank])
            return range(start, start + self.layer_partition[self.pp_rank])
        if num_layers < m:
            raise ValueError(f"--pipeline-parallel-size {m} exceeds the model's {num_layers} "
                             "layers")
        base, extra = divmod(num_layers, m)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (self.pp_rank < extra))


class ParallelState:
    """This rank's process groups once ``init_distributed`` ran.

    Attributes:
        config: the rank layout.
        tp_group: this stage's tensor-parallel group (None when tp_size is 1).
        group_id: random id of this start of the group, equal on every rank.
        device: where the communicated tensors live (CPU for gloo, the rank's GPU for NCCL).
    """

    def __init__(self, config: ParallelConfig, tp_group, group_id: str, device: torch.device):
        self.config, self.tp_group, self.group_id, self.device = config, tp_group, group_id, device

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the tensor-parallel group, in place; returns ``x``."""
        if self.config.tensor_parallel_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, P]`` on each tp rank -> ``[N, tp_size * P]`` (tp rank order)."""
        n = self.config.tensor_parallel_size
        if n == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def broadcast_from_driver(self, x: torch.Tensor) -> torch.Tensor:
        """Overwrite ``x`` on every rank of this stage's tensor-parallel group with tp rank 0's
        (e.g. the driver's sampled token ids ``[S]`` int64); returns ``x``."""
        if self.config.tensor_parallel_size > 1:
            n = self.config.tensor_parallel_size
            dist.broadcast(x, src=self.config.pp_rank * n, group=self.tp_group)
        return x

    def any_rank(self, flags: list[bool]) -> list[bool]:
        """Each flag OR-ed over every rank of the group, all stages (the default group): for a
        decision every rank must take alike, e.g. which adapters failed to load."""
        x = torch.tensor(flags, dtype=torch.int32, device=self.device)
        if self.config.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return [bool(v) for v in x.tolist()]

    def send_to_next_stage(self, hidden: torch.Tensor) -> None:
        """Send ``hidden [T, E]`` to the same tp rank of the next stage (blocking)."""
        dist.send(hidden.contiguous(), dst=self.config.rank + self.config.tensor_parallel_size)

    def recv_from_prev_stage(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive the previous stage's hidden states ``shape`` (``[T, E]``) in ``dtype``."""
        out = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(out, src=self.config.rank - self.config.tensor_parallel_size)
        return out


def stop_heartbeat() -> None:
    """Stop this process's heartbeat (a rank leaving on purpose: its peers are stopping too, and
    a peer that leaves first must not end this one as lost). A no-op when none runs."""
    if _heartbeat is not None:
        _heartbeat.stop()


def destroy_distributed(timeout_s: float = 30.0) -> None:
    """Leave the default group cleanly: wait for every rank (a barrier, so no peer is still in a
    collective with this one), then destroy all process groups. A no-op when none was joined.

    Call it on every rank of the group, at the end of a successful run; a rank that failed
    should exit without it (its peers would wait ``timeout_s`` seconds at the barrier).

    Raises:
        RuntimeError: a peer did not reach the barrier within ``timeout_s`` seconds.
    """
    stop_heartbeat()  # first: the peers leave once past the barrier
    if not dist.is_initialized():
        return
    # NOTE: monitored_barrier is gloo-only; barrier with the group's own timeout covers NCCL.
    if dist.get_backend() == "gloo":
        dist.monitored_barrier(timeout=timedelta(seconds=timeout_s))
    else:
        dist.barrier()
    dist.destroy_process_group()


def init_distributed(config: ParallelConfig, device: torch.device, timeout_s: float = 60.0,
                     init_addr: str | None = None, address: str = "") -> ParallelState:
    """Meet the group at rank 0's store (``init_addr`` HOST:PORT, else ``$MASTER_ADDR:
    $MASTER_PORT``; ``services/worker/parallel/rendezvous.py``), join it and build the tp groups,
    and
    start this rank's heartbeat.

    Blocks until all ``world_size`` ranks joined (waiting at most ``max(timeout_s,
    RENDEZVOUS_MIN_S)`` seconds). gloo on CPU, NCCL on CUDA; every later
    collective times out after ``timeout_s``, and a peer silent for ``timeout_s`` ends this
    process (the heartbeat). ``address``: where the scheduler reaches this rank (logged).

    Raises:
        ValueError: no rendezvous address.
        RuntimeError / DistStoreError: the rendezvous timed out.
    """
    if config.world_size == 1:
        return ParallelState(config, None, uuid.uuid4().hex, device)
    host, port = rendezvous_address(init_addr)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "GLOO_SOCKET_IFNAME" not in os.environ:  # several hosts: gloo on the advertised one
        interface = interface_of(address.rpartition(":")[0])
        if interface is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    timeout = timedelta(seconds=timeout_s)
    log.info("rank %d/%d joining %s group at %s:%d", config.rank, config.world_size, backend,
             host, port)
    store = rendezvous(host, port, config.rank, config.world_size, timeout_s, address)
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=config.rank,
                            world_size=config.world_size, timeout=timeout)
    n = config.tensor_parallel_size
    tp_group = None
    for stage in range(config.pipeline_parallel_size):  # every rank creates every group
        group = dist.new_group(list(range(stage * n, (stage + 1) * n)), timeout=timeout)
        if stage == config.pp_rank:
            tp_group = group
    ids = [uuid.uuid4().hex if config.rank == 0 else None]
    dist.broadcast_object_list(ids, src=0, device=device if device.type == "cuda" else None)
    group_id = ids[0]
    assert group_id is not None  # rank 0's, broadcast to every rank
    beat_store = dist.TCPStore(host, port, config.world_size, is_master=False, timeout=timeout)
    global _heartbeat
    _heartbeat = Heartbeat(beat_store, config.rank, config.world_size, group_id,
                           timeout_s).start()
    return ParallelState(config, tp_group if n > 1 else None, group_id, device)


def interface_of(host: str) -> str | None:
    """The name of this host's network interface whose IPv4 address is ``host`` (an IP or a
    name resolving to one), or None (not an interface's address: e.g. 127.0.0.2, which lo
    routes but does not hold; or IPv6, where GLOO_SOCKET_IFNAME is the way)."""
    import fcntl
    import socket
    import struct
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET)}
    except (socket.gaierror, UnicodeError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) in ips:
                return name
    return None
