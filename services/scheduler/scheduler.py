"""The engine core's scheduler: which requests run each step, how many tokens each computes.

``schedule()`` applies the scheduling rule (vLLM V1's) and builds the step for the workers;
``update_from_output()`` applies a step's results and finishes requests. docs/architecture.md,
section "Scheduler" (and its "The scheduling rule", "The step protocol", "Beam search" and
"Speculative decoding"), describes what they do; ``request.py`` has the index diagram.

What the code relies on: accounting is at schedule time, so a step in flight needs no
bookkeeping of its own. A chunked prefill's next chunk may go into the next step while the
previous one is still in flight (workers run steps in order), and ``update_from_output()``
applies any step, in any order relative to aborts and preemptions: it ignores the requests that
are gone, finished, or preempted since they were scheduled (their ``epoch`` changed).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

from services.common.step import CachedRequest, NewRequest, StepOutput
from services.scheduler.beam_search_groups import BeamScheduler
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_tier import KVTier, tier_tokens
from services.scheduler.kv_tier_loads import finish_loads, look_up_again
from services.scheduler.lora_admission import LoRAAdmission
from services.scheduler.outputs import RequestUpdate, ScheduledStep, request_update
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.spec_decode import SpecDecodeStats, num_drafts_to_verify
from services.scheduler.state import SchedulerState
from services.scheduler.step_plan import StepPlan, cached_request
from services.scheduler.step_results import (
    RequestResult,
    first_tokens,
    new_prompt_logprobs,
    results_by_request,
)
from services.scheduler.stop_checks import append_run
from services.scheduler.waiting_queue import WaitingQueue


class QueueFullError(Exception):
    """The waiting queue is at ``max_num_waiting_requests`` or ``max_num_waiting_tokens``:
    the request is refused now (gRPC RESOURCE_EXHAUSTED) rather than queued without limit."""


class Scheduler:
    """Scheduler with chunked prefill, prefix caching and preemption by recompute.

    ``running`` is kept sorted by the policy key (``waiting_queue.policy_key``: arrival under
    fcfs, (priority, arrival) under priority), so each step serves running requests best-first
    and the preemption victim is always the tail: the lowest priority, and among equals the
    latest arrival. Admission takes the head of ``waiting`` (same key order). Beam groups are
    ``beams`` (``beam_scheduling.py``); both share ``state`` (``state.py``).

    Any number of ScheduledSteps may await ``update_from_output`` (the engine keeps up to
    ``max_steps_in_flight``, the pipeline depth); each is applied once, and a step that never
    comes back (a worker failure) blocks nothing. Outputs with nothing scheduled still carry
    ``finished_request_ids``: forward them.

    NOTE: with several steps in flight and no async scheduling (pipeline parallelism) a
    request waiting for its token is not scheduled again until the token arrives; with async
    scheduling it is, for that token's position (docs/architecture.md, "The step protocol").
    A preempted in-flight request drops out of its step: its result is ignored.

    Args:
        config: scheduling limits and policies.
        num_kv_blocks: KV blocks per worker rank (the minimum over ranks).
        eos_token_ids: the model's end-of-sequence ids (finish STOP unless ignore_eos).
        sliding_windows: per KV cache group, its sliding window (0 = full attention; the
            workers' ``kv_cache_groups``); default one full-attention group.
        vocab_size: the model's vocabulary (caps a beam's candidates), or None (no cap).
        pooling: the workers run the pooling runner (embeddings): a request is its prompt's
            forward only (up to ``max_model_len`` tokens, never a prefix-cache hit: MEAN and
            CLS pooling need every prompt token's hidden state), finished (STOP, with its
            vector) by the step that computes its last prompt token, which frees its blocks.
        kv_tier: the KV tier on disk (``kv_tier.py``): prefix hits extend into it (a request
            whose hit has tier blocks waits for their loads, ``kv_loads_pending``) and the
            blocks the steps compute are written to it; None.

    Raises:
        ValueError: if one request of ``max_model_len`` tokens cannot fit in the KV cache.
    """

    def __init__(self, config: SchedulerConfig, num_kv_blocks: int, eos_token_ids: list[int],
                 sliding_windows: Sequence[int] = (0,), vocab_size: int | None = None,
                 pooling: bool = False, kv_tier: KVTier | None = None):
        bs, max_len = config.block_size, config.max_model_len
        bm = BlockManager(num_kv_blocks, bs, config.enable_prefix_caching, sliding_windows,
                          kv_tier)
        max_chunk = min(config.long_prefill_token_threshold or max_len,
                        config.max_num_batched_tokens)
        needed = bm.blocks_for_one_request(max_len, max_chunk)
        if needed > num_kv_blocks:
            groups = f" in {bm.num_groups} KV cache groups" if bm.num_groups > 1 else ""
            raise ValueError(
                f"KV cache has {num_kv_blocks} blocks ({num_kv_blocks * bs} tokens) but "
                f"max_model_len={max_len} needs {needed} blocks{groups}; raise "
                f"--kv-cache-memory or lower --max-model-len"
            )
        self.config = config
        self.pooling = pooling
        self.block_manager = bm
        self.eos_token_ids = frozenset(eos_token_ids)
        self.state = SchedulerState(bm, config.scheduling_policy)
        self.beams = BeamScheduler(config, self.state, self.eos_token_ids, vocab_size)
        self.loras = LoRAAdmission(config.max_loras, config.max_lora_skips)
        self.num_rejected_total = 0  # requests refused by load shedding
        self.prefix_cache_queries_total = 0  # tokens looked up at admission
        self.prefix_cache_hits_total = 0  # of those, tokens found (in RAM or the KV tier)
        self.prefix_cache_tier_hits_total = 0  # of those, tokens found in the KV tier
        self._num_arrivals = 0
        self._step_id = 0
        self.num_blocks_copied_total = 0  # copy-on-write copies (beam search)
        self.spec_stats = SpecDecodeStats()  # speculative decoding's counters

    @property
    def requests(self) -> dict[str, Request]:
        """Unfinished requests (waiting + running) by id."""
        return self.state.requests

    @property
    def waiting(self) -> WaitingQueue:
        return self.state.waiting

    @property
    def running(self) -> list[Request]:
        """Running requests, sorted by policy key."""
        return self.state.running

    @property
    def num_preemptions_total(self) -> int:
        return self.state.num_preemptions_total

    @property
    def num_running(self) -> int:
        return len(self.state.running)

    @property
    def num_waiting(self) -> int:
        return len(self.state.waiting)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self.state.requests.get(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.state.requests)

    def has_work(self) -> bool:
        """Unfinished requests, or KV tier loads the workers still owe a report (an aborted
        request's: their blocks come back only then), so steps must go on."""
        return bool(self.state.requests) or self.num_kv_loads_in_flight > 0

    def add_request(self, request: Request) -> None:
        """Queue ``request``; it can run from the next step.

        Raises:
            ValueError: empty prompt, prompt of >= max_model_len tokens (no room for one output
                token), a duplicate unfinished request_id, a request that is not WAITING, a
                non-zero priority under the fcfs policy, or a beam search wider than
                ``max_num_seqs`` or whose beams could not all fit in the KV cache.
            QueueFullError: the waiting queue already holds ``max_num_waiting_requests``
                requests, or adding it would pass ``max_num_waiting_tokens`` (an empty queue
                always takes one request, however long).
        """
        config, state = self.config, self.state
        max_len = config.max_model_len
        if request.num_prompt_tokens == 0:
            raise ValueError(f"request {request.request_id}: empty prompt")
        if request.num_prompt_tokens >= max_len + self.pooling:  # (pooling: no output)
            raise ValueError(
                f"request {request.request_id}: prompt has {request.num_prompt_tokens} tokens, "
                f"max_model_len={max_len} leaves no room for output"
            )
        if request.request_id in state.requests or self.beams.reserves(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already running")
        if request.status is not RequestStatus.WAITING:
            raise ValueError(f"request {request.request_id} is {request.status.name}")
        if request.priority != 0 and config.scheduling_policy != "priority":
            raise ValueError(f"priority must be 0 unless the scheduler runs "
                             f"--scheduling-policy priority, got {request.priority}")
        waiting = state.waiting
        if config.max_num_waiting_requests and len(waiting) >= config.max_num_waiting_requests:
            self.num_rejected_total += 1
            raise QueueFullError(
                f"engine queue is full: {len(waiting)} requests waiting "
                f"(--max-num-waiting-requests {config.max_num_waiting_requests}); retry later")
        if (config.max_num_waiting_tokens and waiting
                and waiting.num_tokens + request.num_tokens > config.max_num_waiting_tokens):
            self.num_rejected_total += 1
            raise QueueFullError(
                f"engine queue is full: {waiting.num_tokens} tokens waiting, this request adds "
                f"{request.num_tokens} (--max-num-waiting-tokens "
                f"{config.max_num_waiting_tokens}); retry later")
        if request.sampling_params.beam_width > 0:
            self.beams.add_group(request)
        self._num_arrivals += 1
        request.arrival_seq = self._num_arrivals
        request.epoch = state.new_epoch()
        state.requests[request.request_id] = request
        waiting.add(request)

    def abort_request(self, request_id: str) -> RequestUpdate | None:
        """Finish a request now with reason ABORT and free its blocks (O(queue length)).

        Returns:
            Its final RequestUpdate, or None if the id is unknown or already finished.
        """
        state = self.state
        request = state.requests.get(request_id)
        if request is None:
            return None
        group = request.beam_group
        if group is not None:  # the whole group, whichever beam is named
            request = group.root
            self.beams.drop_beams(group)
        del state.requests[request.request_id]
        if request.status is RequestStatus.RUNNING:
            state.running.remove(request)
        else:
            state.waiting.remove(request)
        state.finish(request, FinishReason.ABORT)
        return request_update(request, [], FinishReason.ABORT)

    def schedule(self) -> ScheduledStep:
        """Pick this step's requests and token counts, allocating blocks for them.

        The rule: each request gets up to ``num_tokens - num_computed_tokens`` tokens (at most
        ``long_prefill_token_threshold`` when set), running requests first (best policy key
        first), then waiting ones from the head, within the token budget, ``max_num_seqs`` and
        the free blocks. A waiting request starts at its longest cached prefix. A running
        request that cannot get a block preempts the running tail (the worst key; possibly
        itself). A waiting request that cannot get its blocks stops admission; no admission in a
        step that preempted.

        Cost: O(running + admitted) plus the block operations (a prefix lookup is O(blocks of
        the prompt)).
        """
        # speculative decoding: this step verifies drafts and the next one gets proposals
        # unless the batch is large (``disable_by_batch_size``); a draft model writes its K/V
        # into ``lookahead`` slots past each request's tokens.
        spec = self.config.speculative
        speculating = spec is not None and len(self.state.running) < spec.disable_by_batch_size
        plan = StepPlan(self.config.max_num_batched_tokens, speculating,
                        spec.num_lookahead_slots if speculating and spec else 0)
        num_preempted = self.state.num_preemptions_total
        self._schedule_running(plan)
        # NOTE: after a preemption the cache is full; admitting would only thrash (the newcomer
        # would be the next victim).
        if self.state.num_preemptions_total == num_preempted:
            self._admit_waiting(plan)
        return self._step_output(plan)

    def _schedule_running(self, plan: StepPlan) -> None:
        """Running requests, best key first, each its tokens by the rule (a beam group's beams
        as one, ``BeamScheduler.schedule_group``); victims come off the tail, so a request that
        was already scheduled this step is never preempted (its blocks may be cached)."""
        running, config = self.state.running, self.config
        bs, max_len = config.block_size, config.max_model_len
        threshold = config.long_prefill_token_threshold
        num_scheduled, new_blocks = plan.num_scheduled, plan.new_blocks
        i = 0
        while i < len(running) and plan.budget > 0:
            request = running[i]
            group = request.beam_group
            if group is not None and len(group.beams) > 1:
                i = self.beams.schedule_group(group, i, plan, self._preempt_tail)
                if group.root.status is not RequestStatus.RUNNING:
                    break  # NOTE: it preempted itself: everything after it is gone too.
                continue
            i += 1
            if request.kv_loads_pending:
                continue  # its prefix is still being read from the KV tier
            num_computed = request.num_computed_tokens
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            num_new = num_tokens + request.num_output_placeholders - num_computed
            if num_new <= 0:
                continue  # its token is still to come (a step in flight)
            if request.num_output_placeholders and self._ends_in_flight(request):
                continue  # nothing more to compute
            if request.spec_token_ids:  # (drafts only ever follow a decode step's token)
                num_new += self._take_drafts(request, num_new, plan)
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > plan.budget:
                num_new = plan.budget
            slots = min(num_new + plan.lookahead, max_len - num_computed)
            # NOTE: the decode fast path (most requests, most steps): the last block has room
            # and no block fills up, so there is nothing to allocate or register (and a sliding
            # window's blocks are released only when a new block is needed: that is enough).
            if (num_computed + slots <= len(request.block_ids[0]) * bs
                    and min(num_computed + num_new, num_tokens) // bs
                    <= request.num_cached_blocks):
                new_blocks[request.request_id] = []
            elif not self._allocate_running(request, slots, plan):
                break  # NOTE: it preempted itself: everything after it is gone too.
            num_scheduled[request.request_id] = num_new
            plan.budget -= num_new

    def _ends_in_flight(self, request: Request) -> bool:
        """(async scheduling) ``request``'s next position's token is in flight: whether it
        ends with the tokens in flight (``max_model_len`` or ``max_tokens`` counting its
        placeholders), so it has nothing more to compute."""
        num_output = len(request.output_token_ids) + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return (len(request.prompt_token_ids) + num_output >= self.config.max_model_len
                or (max_tokens is not None and num_output >= max_tokens))

    def _take_drafts(self, request: Request, num_new: int, plan: StepPlan) -> int:
        """Cuts ``request``'s drafts to those this step verifies (none unless it is speculating
        and the request decodes: ``num_drafts_to_verify``) and returns how many; they go into
        its CachedRequest (``_step_output``)."""
        spec, request.spec_token_ids = request.spec_token_ids, []
        if not (plan.speculating and num_new == 1):
            return 0
        threshold = self.config.long_prefill_token_threshold
        d = num_drafts_to_verify(len(spec), min(plan.budget, threshold or plan.budget),
                                 len(request.output_token_ids),
                                 request.sampling_params.max_tokens, request.num_tokens,
                                 self.config.max_model_len)
        request.spec_token_ids = spec[:d]
        return d

    def _allocate_running(self, request: Request, slots: int, plan: StepPlan) -> bool:
        """Blocks for ``slots`` more slots of running ``request``, preempting the running tail
        until they fit. False if it preempted itself."""
        bm = self.block_manager
        while not bm.can_allocate(request, slots):
            if self._preempt_tail() is request:
                return False
        plan.new_blocks[request.request_id] = bm.allocate(request, slots)
        return request.status is RequestStatus.RUNNING

    def _admit_waiting(self, plan: StepPlan) -> None:
        """Waiting requests from the head, each from its longest cached prefix, while the
        budget, ``max_num_seqs``, the free blocks and the LoRA slots allow."""
        config, state, bm = self.config, self.state, self.block_manager
        waiting, running, loras = state.waiting, state.running, self.loras.begin(state.running)
        threshold = config.long_prefill_token_threshold
        while waiting and plan.budget > 0 and len(running) < config.max_num_seqs:
            request = loras.next_request(waiting)
            if request is None:
                break  # NOTE: the rest wait for a LoRA slot (lora_admission.py)
            if request.beam_group is not None and (
                    len(running) + request.beam_group.beam_width > config.max_num_seqs):
                break  # NOTE: its beams will be running sequences too
            # NOTE: prompt logprobs need every prompt position computed: no cache hit then.
            hit_blocks, num_hit = (([], 0) if request.needs_prompt_logprobs or self.pooling
                                   else bm.get_computed_blocks(request))
            num_tier = (tier_tokens(hit_blocks, config.block_size, bm.tier.in_flight)
                        if bm.tier is not None and hit_blocks else 0)
            num_new = request.num_tokens - num_hit
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > plan.budget:
                num_new = plan.budget
            slots = min(num_new + plan.lookahead, config.max_model_len - num_hit)
            if num_tier:  # NOTE: it computes nothing before its loads are back: blocks for its
                slots = 0  # chunk then (none registered before it is computed)
            if not bm.can_allocate(request, slots, hit_blocks):
                break  # NOTE: never let a later (smaller) request skip ahead of the head.
            waiting.pop()
            self.prefix_cache_queries_total += request.num_tokens
            if not num_tier:  # (with loads: counted when they are back, ``_finish_loads``)
                self.prefix_cache_hits_total += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            resumed = request.status is RequestStatus.PREEMPTED
            request.status = RequestStatus.RUNNING
            new_blocks = bm.allocate(request, slots, hit_blocks)
            request.spec_token_ids = []
            request.num_computed_tokens = num_hit
            state.add_running(request)
            loras.admitted(request)
            request.num_tier_hit_tokens = num_tier
            if request.kv_loads_pending:  # it runs once its KV tier loads are back
                # (``_schedule_running``; whole, as a resume, if the workers hold it)
                request.resend |= resumed and request.num_tokens_sent > 0
                continue
            if resumed:
                plan.resumed.add(request.request_id)
            plan.new_blocks[request.request_id] = new_blocks
            plan.num_scheduled[request.request_id] = num_new
            plan.budget -= num_new
        loras.end(waiting)

    def _step_output(self, plan: StepPlan) -> ScheduledStep:
        """The step for the workers: each request's diff (O(its new tokens + new blocks)),
        then the schedule-time accounting: the scheduled tokens count as computed from now on.
        """
        new_reqs: list[NewRequest] = []
        cached_reqs: list[CachedRequest] = []
        requests = self.state.requests
        epochs: dict[str, int] = {}
        sampled: set[str] = set()
        # NOTE: new tokens are sent only where a pipeline stage that does not sample needs
        # them (async scheduling is off then); a single stage appends its own samples, so its
        # step is every rank's as is (``StepInput.for_rank`` returns it unchanged)
        send_tokens = self.config.pipeline_parallel_size > 1
        look_ahead = self.config.async_scheduling  # (the new tokens are not known yet)
        for request_id, num_new in plan.num_scheduled.items():
            request = requests[request_id]
            num_prompt = len(request.prompt_token_ids)
            drafts, request.spec_token_ids = request.spec_token_ids, []  # (``_take_drafts``)
            if request.num_tokens_sent == 0:
                new_reqs.append(NewRequest(
                    request_id, request.all_token_ids, request.sampling_params,
                    list(chain.from_iterable(request.block_ids)), request.num_computed_tokens,
                    num_new, request.lora))
            else:
                cached_reqs.append(cached_request(request, num_new, plan, send_tokens,
                                                        drafts))
            request.num_tokens_sent = num_tokens = num_prompt + len(request.output_token_ids)
            request.num_computed_tokens += num_new
            epochs[request_id] = request.epoch
            if request.num_computed_tokens == (num_tokens + request.num_output_placeholders
                                               + len(drafts)):
                sampled.add(request_id)
                if look_ahead and request.beam_group is None and not self.pooling:
                    request.num_output_placeholders += 1  # NOTE: a beam waits for its pick

        self._step_id += 1
        finished, self.state.finished_req_ids = self.state.finished_req_ids, set()
        self.num_blocks_copied_total += len(plan.blocks_to_copy)
        spec = self.config.speculative
        k = spec.num_speculative_tokens if plan.speculating and spec else 0
        tier = self.block_manager.tier
        stores, loads = tier.take_transfers() if tier is not None else ([], [])
        return ScheduledStep(self._step_id, new_reqs, cached_reqs, finished,
                             plan.blocks_to_copy, k, stores, loads, epochs=epochs,
                             sampled_req_ids=sampled)

    def update_from_output(self, step: ScheduledStep, output: StepOutput
                           ) -> list[RequestUpdate]:
        """Apply a finished step's ``output``: append tokens, finish requests.

        Walks the step's requests in schedule order, each with its part of ``output``
        (``step_results.results_by_request``). A request's result is used only if its chunk
        reached the end when scheduled and it is still running in the same epoch; others
        (mid-prefill, aborted, finished or preempted since, a look-ahead step of a request that
        finished meanwhile) are ignored. A request whose chunk reached the end but got no token
        is recomputed (preempted). Logprobs go on the RequestUpdate as they came; the prompt
        tokens a chunk scored are passed on once (a recompute after preemption repeats none),
        on an update of their own for a mid-prefill chunk. Speculative decoding, pooling and
        beams: ``_apply_tokens``, ``_pooled``, ``BeamScheduler.proposed``.

        Returns:
            One RequestUpdate per request that got a token (and maybe finished), in schedule
            order.

        Raises:
            ValueError: ``step`` was applied before.
        """
        if step.applied:
            raise ValueError(f"update_from_output(): step {step.step_id} was applied before")
        step.applied = True
        if output.kv_loads_done or output.kv_loads_failed:
            self._finish_loads(output.kv_loads_done, output.kv_loads_failed)
        results = results_by_request(output)
        prompt = {p.request_id: p for p in output.prompt_logprobs}
        drafts = {c.request_id: c.spec_token_ids for c in step.cached_requests}
        updates: list[RequestUpdate] = []
        state = self.state
        for request_id, epoch in step.epochs.items():  # (in schedule order)
            request = state.requests.get(request_id)
            if request is None or request.epoch != epoch or (
                    request.status is not RequestStatus.RUNNING):
                continue  # aborted, finished or preempted since it was scheduled
            result = results.get(request_id)
            reached_end = request_id in step.sampled_req_ids
            if request.beam_group is not None:
                if reached_end:
                    update = self.beams.proposed(request, result.logprobs if result else None)
                    updates += [update] if update is not None else []
                continue
            prompt_chunk = new_prompt_logprobs(request, prompt.get(request_id))
            if prompt_chunk is not None and (not reached_end or not (result and
                                                                     result.token_ids)):
                updates.append(request_update(request, [], None, prompt_logprobs=prompt_chunk))
                prompt_chunk = None
            if not reached_end:
                continue  # NOTE: mid-prefill chunk: a sampled token (if any) is discarded.
            if self.pooling:
                updates += self._pooled(request, result.embedding if result else None)
                continue
            update = self._apply_tokens(request, result, drafts.get(request_id, []))
            if update is not None:
                update.prompt_logprobs = prompt_chunk
                updates.append(update)
        if any(u.finish_reason is not None for u in updates):
            state.running[:] = [r for r in state.running if r.status is RequestStatus.RUNNING]
        return updates

    def _finish_loads(self, done: list[int], failed: list[int]) -> None:
        """KV tier loads back from every rank (``kv_tier_loads.finish_loads``): a request whose
        last load is back runs from its whole hit, counted as prefix-cache hits now, or, when
        one failed, looks its prefix up again in place (``kv_tier_loads.look_up_again``)."""
        bm = self.block_manager
        for request in finish_loads(bm, done, failed):
            if request.kv_load_failed:
                look_up_again(bm, request)
            if not request.kv_loads_pending:
                self.prefix_cache_hits_total += request.num_computed_tokens
                self.prefix_cache_tier_hits_total += request.num_tier_hit_tokens

    @property
    def num_kv_loads_in_flight(self) -> int:
        """KV tier loads the workers have not answered yet (the engine polls while any)."""
        tier = self.block_manager.tier
        return len(tier.in_flight) if tier is not None else 0

    def _apply_tokens(self, request: Request, result: RequestResult | None,
                      drafts: list[int]) -> RequestUpdate | None:
        """Append a request's new tokens (its accepted ``drafts``, a prefix of those the step
        verified, and the token sampled after them) one by one, each checked for a stop as if
        it came alone: what follows the one that finishes the request is dropped. Rejected
        drafts: ``num_computed_tokens`` steps back over them and the blocks only they used are
        freed. The proposals in ``result`` become the request's drafts. None (the request is
        recomputed) when the worker sent no token or accepted tokens it was not asked to
        verify."""
        state = self.state
        if request.num_output_placeholders:
            request.num_output_placeholders -= 1
        accepted = result.token_ids[:-1] if result else []
        if not (result and result.token_ids) or accepted != drafts[:len(accepted)]:
            # NOTE: a worker bug. Its token list may now differ from ours: recompute the
            # request as after a preemption (the resume replaces the workers' list) rather
            # than leave it with nothing to do.
            state.running.remove(request)
            state.preempt(request)
            return None
        if drafts:
            self.spec_stats.observe(len(drafts), len(accepted))
            request.num_computed_tokens -= len(drafts) - len(accepted)
        start = request.num_tokens
        new_tokens, reason = append_run(request, result.token_ids, self.eos_token_ids,
                                        self.config.max_model_len)
        if reason is not None:
            del state.requests[request.request_id]
            state.finish(request, reason)
        else:
            if len(accepted) < len(drafts):
                self._free_rejected(request)
            request.spec_token_ids = result.draft_token_ids
        return request_update(request, new_tokens, reason,
                              first_tokens(result.logprobs, len(new_tokens), start))

    def _pooled(self, request: Request, embedding: list[float] | None) -> list[RequestUpdate]:
        """Finish a pooling ``request`` whose prompt is computed with its ``embedding`` (its
        final update), or, when the worker sent none (a worker bug), recompute it."""
        state = self.state
        if embedding is None:
            state.running.remove(request)
            state.preempt(request)
            return []
        del state.requests[request.request_id]
        state.finish(request, FinishReason.STOP)
        update = request_update(request, [], FinishReason.STOP)
        update.embedding = embedding
        return [update]

    def _free_rejected(self, request: Request) -> None:
        """Release the blocks only rejected drafts used (past the request's computed tokens
        and a draft model's lookahead slots, where its own K/V for the next drafts lives)."""
        spec_config = self.config.speculative
        lookahead = spec_config.num_lookahead_slots if spec_config else 0
        slots = min(request.num_computed_tokens + lookahead, self.config.max_model_len)
        if self.block_manager.trim(request, slots):
            # NOTE: the workers still list them: the next step cuts their tables here (as
            # copy-on-write does), before it appends any new block
            request.trimmed_to = len(request.block_ids[0])

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the workers' KV caches were lost, e.g. a restart)."""
        self.block_manager.reset_prefix_cache()

    def _preempt_tail(self) -> Request:
        """Preempt the running tail (recompute); a beam of a group of several beams takes its
        group with it (``BeamScheduler.restart``). Returns the tail request."""
        running = self.state.running
        victim = running.pop()
        group = victim.beam_group
        if group is not None and len(group.beams) > 1:
            running[:] = [r for r in running if r.beam_group is not group]
            self.beams.restart(group)
        else:
            self.state.preempt(victim)
        return victim
