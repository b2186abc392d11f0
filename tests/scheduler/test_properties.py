"""Hypothesis: random add / step / abort sequences over a small KV cache.

Properties: no block is leaked or freed twice (exact accounting after every operation), no step
exceeds max_num_batched_tokens or max_num_seqs, running + waiting stay in arrival order (so the
preemption victim is the latest arrival), and every request finishes with exactly the tokens
the fake model gives it without any scheduling, however often it was preempted.
"""

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from services.scheduler.request import FinishReason
from tests.scheduler.factories import (
    FakeWorker,
    expected_output,
    make_request,
    make_scheduler,
    run_to_completion,
)

FAKE_TOKENS = st.integers(10, 59)  # the fake model's token range


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.integers(2, 8),
        max_model_len=st.integers(2, 64),
        max_num_seqs=st.integers(1, 6),
        max_num_batched_tokens=st.integers(1, 40),
        eos=st.lists(FAKE_TOKENS, max_size=1),
        data=st.data(),
    )
    def setup(self, block_size, max_model_len, max_num_seqs, max_num_batched_tokens, eos, data):
        # NOTE: as few blocks as one max_model_len request allows, plus a little: preemption
        # should be common, not a corner case.
        min_blocks = -(-max_model_len // block_size)
        num_blocks = data.draw(st.integers(max(8, min_blocks), max(8, min_blocks) + 8), "blocks")
        self.eos = tuple(eos)
        self.scheduler = make_scheduler(
            num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            eos_token_ids=self.eos,
        )
        self.worker = FakeWorker(self.scheduler)
        self.requests = []

    @rule(data=st.data())
    def add(self, data):
        max_len = self.scheduler.config.max_model_len
        request = make_request(
            len(self.requests),
            data.draw(st.integers(1, max_len - 1), "prompt_len"),
            max_tokens=data.draw(st.none() | st.integers(1, 24), "max_tokens"),
            stop_token_ids=data.draw(st.lists(FAKE_TOKENS, max_size=2), "stop"),
            ignore_eos=data.draw(st.booleans(), "ignore_eos"),
        )
        self.scheduler.add_request(request)
        self.requests.append(request)

    @rule()
    def step(self):
        s, config = self.scheduler, self.scheduler.config
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(out.num_scheduled_tokens) <= config.max_num_seqs
        s.update_from_output(out, self.worker.execute(out))

    @rule(data=st.data())
    def abort(self, data):
        request = data.draw(st.sampled_from([*self.requests, None]), "victim")
        if request is None:  # an id the scheduler never saw
            assert self.scheduler.abort_request("req-unknown") is None
            return
        was_finished = request.is_finished
        update = self.scheduler.abort_request(request.request_id)
        assert (update is None) == was_finished
        assert request.is_finished and request.block_ids == []

    @invariant()
    def accounting_is_exact(self):
        s = self.scheduler
        s.block_manager.check_invariants(s.requests.values())
        assert s.num_running <= s.config.max_num_seqs
        order = [int(r.request_id[4:]) for r in [*s.running, *s.waiting]]
        assert order == sorted(order)

    def teardown(self):
        s = getattr(self, "scheduler", None)
        if s is None:
            return
        run_to_completion(s, self.worker)
        self.worker.execute(s.schedule())  # deliver the last finished ids
        assert self.worker.states == {}
        assert s.block_manager.num_free_blocks == s.block_manager.num_blocks
        event(f"preemptions: {min(s.num_preemptions_total, 3)}+")
        for r in self.requests:
            assert r.is_finished
            event(f"finish: {r.finish_reason.value}")
            if r.finish_reason is not FinishReason.ABORT:
                expected = expected_output(r, s.config.max_model_len, self.eos)
                assert (r.output_token_ids, r.finish_reason) == expected


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
