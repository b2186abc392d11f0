"""Hypothesis: random add / step / abort / preempt sequences over a small KV cache, with prefix
caching on or off, the fcfs or priority policy, a long-prefill cap, load shedding and the KV
cache groups (one full group, or full and sliding-window groups) drawn too. Prompts often share
prefixes (a few "system prompts"), so prefix hits, shared blocks and evictions are common.

Steps run in one of three modes, drawn: one at a time; two in flight without async scheduling
(pipeline parallelism: a request awaiting its token is not scheduled); two in flight with async
scheduling (look-ahead: a request is scheduled again for the position of its token in flight).
Steps are sent (the fake worker runs them at once, in order) and their results applied by
separate rules, so aborts, preemptions and arrivals fall between a step and its result.

With prefix caching on, a KV tier on disk of a few blocks is drawn too (the fake worker stores
and loads blocks through files; some loads fail: a rule deletes files), so prefix hits are
extended by loads, requests wait for them, and aborts and preemptions fall between a load and
its report.

Properties: no block is leaked or freed twice and no ref count goes below zero (exact
accounting, ref count == number of block tables listing the block, after every operation); no
step exceeds max_num_batched_tokens or max_num_seqs; running stays in policy order (so the
preemption victim is the worst key); every block a request reads holds exactly its prefix (the
FakeWorker's check); and every request finishes with exactly the tokens the fake model gives it
without any scheduling, however often it was preempted or hit the cache.
"""

import os
import shutil
import tempfile
from collections import deque

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_tier import KVTier
from services.scheduler.kv_tier_index import KVTierIndex
from services.scheduler.request import FinishReason, RequestStatus
from services.scheduler.scheduler import QueueFullError
from tests.scheduler.factories import (
    TIER_BLOCK_BYTES,
    FakeWorker,
    expected_output,
    make_request,
    make_scheduler,
    run_to_completion,
    step_output,
)

FAKE_TOKENS = st.integers(10, 59)  # the fake model's token range


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(2, 8),
        max_model_len=st.integers(2, 64),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 40),
        eos=st.lists(FAKE_TOKENS, max_size=1),
        prefix_caching=st.sampled_from([True, True, True, False]),
        policy=st.sampled_from(["fcfs", "priority"]),
        threshold=st.sampled_from([0, 0, 1, 3, 8]),
        max_waiting=st.sampled_from([0, 0, 2, 5]),
        mode=st.sampled_from(["serial", "pipelined", "async", "async"]),
        groups=st.sampled_from(["full", "full", "full+sliding", "sliding+full+sliding"]),
        data=st.data(),
    )
    def setup(self, block_size, max_model_len, max_num_seqs, max_num_batched_tokens, eos,
              prefix_caching, policy, threshold, max_waiting, mode, groups, data):
        window = data.draw(st.integers(1, 3 * block_size), "window")  # < = > a block
        windows = {"full": (0,), "full+sliding": (0, window),
                   "sliding+full+sliding": (window, 0, window)}[groups]
        event(f"groups: {groups}")
        # NOTE: as few blocks as one max_model_len request allows, plus a little: preemption
        # should be common, not a corner case.
        min_blocks = BlockManager(1, block_size, sliding_windows=windows).blocks_for_one_request(
            max_model_len, min(threshold or max_model_len, max_num_batched_tokens))
        num_blocks = data.draw(st.integers(max(8, min_blocks), max(8, min_blocks) + 8), "blocks")
        self.eos = tuple(eos)
        self.tier_dir = None
        tier = None
        if prefix_caching and data.draw(st.booleans(), "kv_tier"):
            self.tier_dir = tempfile.mkdtemp(prefix="kv-tier-")
            size = data.draw(st.integers(1, 24), "kv_tier_blocks") * TIER_BLOCK_BYTES
            tier = KVTier(KVTierIndex([self.tier_dir], TIER_BLOCK_BYTES, size))
            event("kv tier")
        self.scheduler = make_scheduler(
            num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=self.eos,
            enable_prefix_caching=prefix_caching,
            scheduling_policy=policy,
            long_prefill_token_threshold=threshold,
            max_num_waiting_requests=max_waiting,
            pipeline_parallel_size=2 if mode == "pipelined" else 1,  # (async: 2 in flight)
            async_scheduling=mode == "async",
            sliding_windows=windows,
            kv_tier=tier,
        )
        event(f"mode: {mode}")
        self.pending: deque = deque()  # (ScheduledStep, sampled) sent, oldest first
        self.worker = FakeWorker(self.scheduler, tier_dir=self.tier_dir)
        self.requests = []
        self.num_added = 0

    @rule(data=st.data())
    def add(self, data):
        s = self.scheduler
        max_len = s.config.max_model_len
        request = make_request(
            self.num_added,
            data.draw(st.integers(1, max_len - 1), "prompt_len"),
            max_tokens=data.draw(st.none() | st.integers(1, 24), "max_tokens"),
            stop_token_ids=data.draw(st.lists(FAKE_TOKENS, max_size=2), "stop"),
            ignore_eos=data.draw(st.booleans(), "ignore_eos"),
        )
        self.num_added += 1
        # NOTE: most prompts start with one of two "system prompts" (or a copy of an earlier
        # request's prompt), so the prefix cache gets hits on 0..n whole blocks.
        system = data.draw(st.sampled_from([None, 0, 0, 1, "copy", "copy"]), "system")
        if system == "copy" and self.requests:
            request.prompt_token_ids = list(data.draw(st.sampled_from(self.requests),
                                                      "copied").prompt_token_ids)
        elif system in (0, 1):
            shared = [9000 + 100 * system + j for j in range(request.num_prompt_tokens)]
            n = request.num_prompt_tokens
            cut = data.draw(st.sampled_from([n, n // 2, 1]), "shared_len")
            request.prompt_token_ids[:cut] = shared[:cut]
        if s.config.scheduling_policy == "priority":
            request.priority = data.draw(st.integers(-2, 2), "priority")
        # choices of one "parent" share blocks even with prefix caching off
        request.parent_request_id = data.draw(st.sampled_from(["", "", "p0", "p1"]), "parent")
        try:
            s.add_request(request)
        except QueueFullError:
            # NOTE: preempted requests re-enter the queue past the limit; only new ones are refused
            assert s.num_waiting >= s.config.max_num_waiting_requests > 0
            return
        self.requests.append(request)

    @rule()
    def send(self):
        """Schedule a step and run it on the fake worker (its result comes back later); with
        every slot in flight taken, apply the oldest result instead."""
        s, config = self.scheduler, self.scheduler.config
        if len(self.pending) >= config.max_steps_in_flight:
            return self.receive()
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs
        if not config.async_scheduling:  # a request awaiting its token is not scheduled
            owing = {rid for o, _ in self.pending for rid in o.sampled_req_ids
                     if getattr(s.get_request(rid), "epoch", None) == o.epochs[rid]}
            assert not owing & out.num_scheduled_tokens.keys()
        elif self.pending and out.cached_requests:
            event("look-ahead step")
        self.pending.append((out, self.worker.execute(out)))

    @rule()
    def receive(self):
        """Apply the oldest step in flight."""
        if self.pending:
            out, sampled = self.pending.popleft()
            self.scheduler.update_from_output(out, self.worker.output(out, sampled))

    @rule(data=st.data())
    def lose_a_tier_file(self, data):
        """A KV tier file disappears (another replica evicted it, a disk was cleaned): a load
        of it fails and the request computes the block instead."""
        if self.tier_dir is None:
            return
        files = sorted(os.path.join(d, f) for d, _, fs in os.walk(self.tier_dir) for f in fs)
        if files:
            os.unlink(data.draw(st.sampled_from(files), "lost"))

    @rule()
    def preempt(self):
        """Preempt the running tail between steps, as schedule() does when blocks run out."""
        s = self.scheduler
        if s.running:
            victim = s.running.pop()
            s.state.preempt(victim)  # the scheduler's own preemption path
            assert victim.status is RequestStatus.PREEMPTED and victim.block_ids == []

    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from([*self.requests, None]), "victim")
        if request is None:  # an id the scheduler never saw
            assert self.scheduler.abort_request("req-unknown") is None
            return
        was_finished = request.status is RequestStatus.FINISHED
        update = self.scheduler.abort_request(request.request_id)
        assert (update is None) == was_finished
        assert request.status is RequestStatus.FINISHED and request.block_ids == []

    @invariant()
    def accounting_is_exact(self):
        s = self.scheduler
        s.block_manager.check_invariants(s.requests.values())
        assert s.num_running <= s.config.max_num_seqs
        keys = [s.state.key(r) for r in s.running]
        assert keys == sorted(keys)  # the tail is the preemption victim: the worst key
        if s.config.scheduling_policy == "fcfs":
            order = [r.arrival_seq for r in [*s.running, *s.waiting]]
            assert order == sorted(order)
        assert s.waiting.num_tokens == sum(r.num_tokens for r in s.waiting)

    def teardown(self):
        s = getattr(self, "scheduler", None)
        if s is None:
            return
        run_to_completion(s, self.worker, pending=self.pending)
        if self.tier_dir is not None:
            tier = s.block_manager.tier
            assert not tier.in_flight
            event(f"kv tier loads: {'0' if not tier.num_loads_total else '1+'}, failed: "
                  f"{'0' if not tier.num_load_failures_total else '1+'}")
            shutil.rmtree(self.tier_dir)
        self.worker.execute(s.schedule())  # deliver the last finished ids
        assert self.worker.states == {}
        assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
        event(f"preemptions: {min(s.num_preemptions_total, 3)}+")
        hits = s.prefix_cache_hits_total
        event(f"prefix-cache hit tokens: {'0' if not hits else '1-9' if hits < 10 else '10+'}")
        for r in self.requests:
            assert r.status is RequestStatus.FINISHED
            event(f"finish: {r.finish_reason.value}")
            if r.finish_reason is not FinishReason.ABORT:
                expected = expected_output(r, s.config.max_model_len, self.eos)
                assert (r.output_token_ids, r.finish_reason) == expected


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
