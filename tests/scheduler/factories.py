"""Factories and a fake worker for the scheduler tests.

``FakeWorker`` plays every worker rank: it rebuilds each request's token ids and block table
from the ScheduledStep diffs and its own samples alone (as a real worker must: the sampling
stage appends what it samples, the other pipeline stages append ``new_token_ids``, a resumed
request's token list is replaced), checks them against the scheduler's own Request objects,
writes a "KV cache" of (KV cache group, position, token ids up to and including that position)
per slot -- what a real K/V vector depends on -- and after each step's writes checks that every
slot the step reads holds exactly that, so a wrong block table, a wrongly shared block (a bad
prefix-cache hit), an evicted block still in use or a missed recompute fails loudly.

KV cache groups: the fake worker has a group layout (``sliding_windows``, one window per group,
0 = full; by default the scheduler's, as a real one reports it in GetWorkerInfo). It splits the
flat block ids of each message group by group (a count that does not divide fails), keeps one
table per group, and checks that a -1 entry ("no block") lies wholly before the window of the
step's first query (so never in a full group), that it reads a sliding group only within the
window (positions p - W + 1 .. p), and that its tables equal the scheduler's except where the
scheduler has released a block out of the window (the worker is not told; it never reads it).

The fake model: the token sampled for a request depends only on (its id's number, the position
it is sampled at), so a run's outputs can be predicted without any scheduling
(``expected_output``) and compared exactly.

For the engine loop: ``FakeRanks`` (a WorkerGroup stand-in over a ``FakeWorker``) and
``final_outputs`` (a request's RequestOutputs on a router sink, up to its final one).
"""

from __future__ import annotations

import asyncio
import os
from collections import deque
from dataclasses import dataclass, field

from services.common.pb.pagedserve.v1 import api_pb2, engine_pb2
from services.common.kv_tier_files import block_path
from services.common.step import StepOutput
from services.scheduler.config import SchedulerConfig
from services.scheduler.outputs import RequestUpdate, ScheduledStep
from services.scheduler.request import EngineSamplingParams, FinishReason, Request
from services.scheduler.scheduler import Scheduler

TIER_BLOCK_BYTES = 100  # the size of a fake KV tier block file
EOS = 0  # the fake model never samples it (fake tokens are 10..59) unless a test forces it


def fake_token(request_id: str, position: int) -> int:
    """The token the fake model samples at ``position`` (= tokens before it) for a request."""
    return (position * 7 + int(request_id.rsplit("-", 1)[1])) % 50 + 10


def make_scheduler(
    num_kv_blocks: int = 64,
    *,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 128,
    eos_token_ids: tuple[int, ...] = (EOS,),
    sliding_windows: tuple[int, ...] = (0,),
    vocab_size: int | None = None,
    pooling: bool = False,
    async_scheduling: bool = False,
    kv_tier=None,
    **config_kwargs,
) -> Scheduler:
    """A Scheduler over ``num_kv_blocks`` small blocks; async scheduling off unless asked
    (the tests drive in-flight steps themselves: ``pipeline_parallel_size``)."""
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=block_size,
        async_scheduling=async_scheduling,
        **config_kwargs,
    )
    return Scheduler(config, num_kv_blocks, list(eos_token_ids), sliding_windows, vocab_size,
                     pooling=pooling, kv_tier=kv_tier)


def make_request(
    index: int, prompt_len: int, arrival_time: float | None = None, **sampling
) -> Request:
    """Request ``req-<index>`` with prompt [1000*index + 0, 1000*index + 1, ...]."""
    prompt = [1000 * index + 100 + j for j in range(prompt_len)]
    params = EngineSamplingParams(**sampling)
    if arrival_time is None:
        return Request(f"req-{index}", prompt, params)
    return Request(f"req-{index}", prompt, params, arrival_time=arrival_time)


def make_requests(n: int, prompt_len: int, start: int = 0, **sampling) -> list[Request]:
    """``n`` requests req-<start> .. req-<start+n-1>, arrival times in that order."""
    return [make_request(start + i, prompt_len, arrival_time=float(start + i), **sampling)
            for i in range(n)]


def expected_output(
    request: Request, max_model_len: int, eos_token_ids=(EOS,)
) -> tuple[list[int], FinishReason]:
    """The outputs and finish reason the fake model gives ``request``, scheduling aside."""
    params = request.sampling_params
    num_prompt = request.num_prompt_tokens
    out: list[int] = []
    while True:
        token = fake_token(request.request_id, num_prompt + len(out))
        out.append(token)
        if ((not params.ignore_eos and token in eos_token_ids)
                or token in params.stop_token_ids) and len(out) > params.min_tokens:
            return out, FinishReason.STOP
        if params.max_tokens is not None and len(out) >= params.max_tokens:
            return out, FinishReason.LENGTH
        if num_prompt + len(out) >= max_model_len:
            return out, FinishReason.LENGTH


def step_output(step, sampled: dict[str, int], **kwargs) -> StepOutput:
    """The StepOutput that gives each request of ``sampled`` its one token (``kwargs``: the
    StepOutput's other fields)."""
    return StepOutput(step.step_id, list(sampled), list(sampled.values()), **kwargs)


def prefix_keys(token_ids: list[int]) -> list[int]:
    """Key ``i`` identifies ``token_ids[:i + 1]`` (a chained hash; what the fake K/V holds)."""
    keys, key = [], 0
    for tok in token_ids:
        key = hash((key, tok))
        keys.append(key)
    return keys


def split_tables(flat: list[int], num_groups: int) -> list[list[int]]:
    """A message's block ids, concatenated group by group, as one table per group."""
    assert len(flat) % num_groups == 0, f"{len(flat)} block ids for {num_groups} groups"
    n = len(flat) // num_groups
    return [list(flat[g * n:(g + 1) * n]) for g in range(num_groups)]


@dataclass
class _WorkerState:
    token_ids: list[int]  # the sampling stage's: its own samples appended
    block_ids: list[list[int]]  # one table per KV cache group
    num_computed_tokens: int
    stage_token_ids: list[int]  # an earlier pipeline stage's: new_token_ids appended
    num_preemptions: int = 0  # the scheduler's count for the request at the last step (checks)


@dataclass
class FakeWorker:
    """Applies ScheduledSteps the way a worker does and samples with ``fake_token``.

    Call ``execute`` with each step as it is sent (steps run in order on the workers); the
    results may be applied later (look-ahead steps: several in flight)."""

    scheduler: Scheduler
    sample: callable = fake_token
    states: dict[str, _WorkerState] = field(default_factory=dict)
    # slot -> (group, pos, prefix key)
    kv: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    outputs: list[ScheduledStep] = field(default_factory=list)
    sliding_windows: list[int] | None = None  # the group layout; None = the scheduler's
    # the KV tier on disk: the rank's folder (a store creates the block's file there, which is
    # what the scheduler's index looks at; a load fails when the file is gone) and the fake
    # disk, (group, key) -> the block's slot contents; None = no tier
    tier_dir: str | None = None
    disk: dict = field(default_factory=dict)
    loading: list = field(default_factory=list)  # loads received, applied at the next step
    kv_reports: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.sliding_windows is None:
            self.sliding_windows = list(self.scheduler.block_manager.sliding_windows)

    def execute(self, out: ScheduledStep) -> dict[str, int]:
        done, failed = self._apply_loads()
        self.loading = list(out.kv_loads)
        sampled = self._execute(out)
        self._store(out)
        self.kv_reports[out.step_id] = (done, failed)
        return sampled

    def output(self, out: ScheduledStep, sampled: dict[str, int]) -> StepOutput:
        """``step_output`` with the step's KV tier load reports."""
        done, failed = self.kv_reports.pop(out.step_id, ([], []))
        return step_output(out, sampled, kv_loads_done=done, kv_loads_failed=failed)

    def _apply_loads(self) -> tuple[list[int], list[int]]:
        """The loads received by the last step, read into their blocks before this step's
        forward (a real worker reads them on a thread meanwhile)."""
        done, failed, bs = [], [], self.scheduler.config.block_size
        for t in self.loading:
            if not os.path.exists(block_path(self.tier_dir, t.group, t.key)):
                failed.append(t.block_id)
                continue
            for i, content in enumerate(self.disk[(t.group, t.key)]):
                self.kv[t.block_id * bs + i] = content
            done.append(t.block_id)
        return done, failed

    def _store(self, out: ScheduledStep) -> None:
        """Write the step's stores after its forward."""
        bs = self.scheduler.config.block_size
        for t in out.kv_stores:
            self.disk[(t.group, t.key)] = [self.kv.get(t.block_id * bs + i) for i in range(bs)]
            path = block_path(self.tier_dir, t.group, t.key)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"x" * TIER_BLOCK_BYTES)

    def _execute(self, out: ScheduledStep) -> dict[str, int]:
        sched, bs = self.scheduler, self.scheduler.config.block_size
        windows = self.sliding_windows
        num_groups = len(windows)
        self.outputs.append(out)
        for rid in out.finished_request_ids:
            assert rid not in out.num_scheduled_tokens
            del self.states[rid]  # KeyError: told to drop a request it never saw
        resumed = {c.request_id for c in out.cached_requests if c.resumed_from_preemption}
        for rid, state in self.states.items():
            # NOTE: preempted since the last step this worker ran (the request's num_preemptions
            # grew). schedule() never preempts and resumes in one step; a preemption between
            # steps (the property test's preempt rule) can be followed by a resume. A real
            # worker is not told of preemptions (the engine may even drop a step that only
            # preempted): a resumed request's block table and token list are replaced.
            request = sched.get_request(rid)
            if request is not None and request.num_preemptions > state.num_preemptions:
                assert rid not in out.num_scheduled_tokens or rid in resumed
                state.num_preemptions = request.num_preemptions
        for new in out.new_requests:
            assert new.request_id not in self.states, "NewRequest for a known request"
            self.states[new.request_id] = _WorkerState(
                list(new.prompt_token_ids), split_tables(new.block_ids, num_groups),
                new.num_computed_tokens, list(new.prompt_token_ids),
                sched.get_request(new.request_id).num_preemptions)
        for rid, request in sched.requests.items():  # (preempted ones included)
            assert request.num_tokens_sent == 0 or rid in self.states, f"{rid}: sent, not held"
        look_ahead = sched.config.async_scheduling
        stages = sched.config.pipeline_parallel_size > 1  # (a stage that does not sample)
        for cached in out.cached_requests:
            state = self.states[cached.request_id]
            if cached.resumed_from_preemption:
                # NOTE: a resumed request restarts at its prefix-cache hit (whole blocks), with
                # its whole token list (this worker may hold a stale sample past it).
                assert cached.num_computed_tokens % bs == 0
                assert cached.new_token_ids[:len(state.token_ids)] == state.token_ids[
                    :len(cached.new_token_ids)]
                state.token_ids = list(cached.new_token_ids)
                state.stage_token_ids = list(cached.new_token_ids)
                state.block_ids = split_tables(cached.new_block_ids, num_groups)
                state.num_computed_tokens = cached.num_computed_tokens
                continue
            if look_ahead:
                assert cached.new_token_ids == []  # not known when scheduled
            elif not stages:  # a single stage appends its own samples: none are sent
                assert cached.new_token_ids == [] or cached.beam
            else:
                state.stage_token_ids += cached.new_token_ids
            assert cached.num_computed_tokens == state.num_computed_tokens
            for table, new_ids in zip(state.block_ids,
                                      split_tables(cached.new_block_ids, num_groups), strict=True):
                table += new_ids
        assert len(out.new_requests) + len(out.cached_requests) == len(
            out.num_scheduled_tokens
        )
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())

        sampled: dict[str, int] = {}
        reads = []  # (request id, first and end position computed, prefix keys)
        for rid, n in out.num_scheduled_tokens.items():
            state, request = self.states[rid], sched.get_request(rid)
            assert n >= 1
            # the scheduler's tokens, then those it has scheduled but not received
            num_known = request.num_tokens
            assert state.token_ids[:num_known] == request.all_token_ids
            assert len(state.token_ids) <= num_known + request.num_output_placeholders
            if stages:  # an earlier stage holds every token it computes
                assert state.stage_token_ids == state.token_ids
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            tables = state.block_ids
            assert len(tables) == len(request.block_ids) == num_groups, "other group layout"
            assert len({len(t) for t in tables}) == 1, "tables of different lengths"
            assert end <= len(state.token_ids) and end <= len(tables[0]) * bs
            firsts = [max(0, start - w + 1) // bs if w else 0 for w in windows]
            for table, theirs, first in zip(tables, request.block_ids, firsts, strict=True):
                # the scheduler's table, but where it released a block this step cannot read
                assert all(mine == b or (b == -1 and j < first)
                           for j, (mine, b) in enumerate(zip(table, theirs, strict=True))), (
                    f"{rid}: table differs from the scheduler's in the window")
                assert min(table[first:]) >= 0, f"{rid}: no block where its window reads"
            prefixes = prefix_keys(state.token_ids[:end])
            for g, table in enumerate(tables):
                for pos in range(start, end):
                    self.kv[table[pos // bs] * bs + pos % bs] = (g, pos, prefixes[pos])
            state.num_computed_tokens = end
            reads.append((rid, start, end, prefixes))
        for rid, start, end, prefixes in reads:  # after every write of the step
            state = self.states[rid]
            for g, (w, table) in enumerate(zip(windows, state.block_ids, strict=True)):
                for pos in range(max(0, start - w + 1) if w else 0, end):
                    slot = table[pos // bs] * bs + pos % bs
                    assert self.kv.get(slot) == (g, pos, prefixes[pos]), (
                        f"{rid} reads wrong K/V at {pos} in group {g}")
            if end == len(state.token_ids):
                sampled[rid] = token = self.sample(rid, len(state.token_ids))
                state.token_ids.append(token)
        return sampled

    def step(self) -> list[RequestUpdate]:
        out = self.scheduler.schedule()
        return self.scheduler.update_from_output(out, self.output(out, self.execute(out)))


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker | None = None, max_steps: int = 10_000,
    pending: deque | None = None,
) -> list[RequestUpdate]:
    """Step until nothing is unfinished; returns all updates. Fails after ``max_steps``.

    Keeps up to ``config.max_steps_in_flight`` steps sent (executed by ``worker``) before the
    oldest result is applied, as the engine loop does; ``pending`` holds the (output, sampled)
    pairs already in flight (drained too)."""
    worker = worker or FakeWorker(scheduler)
    pending = deque() if pending is None else pending
    limit = scheduler.config.max_steps_in_flight
    updates: list[RequestUpdate] = []
    for _ in range(max_steps):
        while len(pending) < limit and scheduler.has_work():
            out = scheduler.schedule()
            if not (out.total_num_scheduled_tokens or out.finished_request_ids
                    or out.kv_stores or out.kv_loads
                    or (not pending and scheduler.num_kv_loads_in_flight)):
                break  # (the engine's rule: KV tier loads in flight are polled)
            pending.append((out, worker.execute(out)))
        if not pending:
            if scheduler.has_work():
                continue  # a step that only preempted: the next one resumes (the engine's retry)
            return updates
        out, sampled = pending.popleft()
        updates += scheduler.update_from_output(out, worker.output(out, sampled))
        scheduler.block_manager.check_invariants(scheduler.requests.values())
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


class FakeRanks:
    """A WorkerGroup stand-in: each step is executed when sent (ranks run steps in order) and
    its result comes back ``delay`` seconds later, oldest first; ``connect`` opens new streams
    (results still queued on the old ones are gone)."""

    def __init__(self, scheduler, delay: float = 0.002):
        self.worker = FakeWorker(scheduler)
        self.delay = delay
        self.queue: deque = deque()
        self.broken = None
        self.connects = 0

    async def send(self, out) -> None:
        self.queue.append((out.step_id, self.worker.execute(out)))
        await asyncio.sleep(0)  # a stream write yields: submits and aborts interleave here too

    async def receive(self, out) -> StepOutput:
        await asyncio.sleep(self.delay)  # submits and aborts interleave here
        step_id, sampled = self.queue.popleft()
        assert step_id == out.step_id
        return step_output(out, sampled)

    async def connect(self, timeout: float) -> None:
        self.queue.clear()
        self.connects += 1


async def final_outputs(sink, rid: str, timeout: float = 10.0) -> list[engine_pb2.RequestOutput]:
    """Every RequestOutput for ``rid`` on ``sink`` up to its final one (other ids dropped)."""
    got = []
    async with asyncio.timeout(timeout):
        while not got or got[-1].finish_reason == api_pb2.FINISH_REASON_UNSPECIFIED:
            batch = await sink.queue.get()
            got += [o for o in batch.outputs if o.request_id == rid]
    return got
