"""The scheduler's side of beam search: a beam group's admission, scheduling, forks,
restart by recompute and end (the search itself, torch-free and scheduler-free, is
``beam_search.py``).

``BeamScheduler`` is owned by the ``Scheduler`` (``scheduler.py``) and shares its requests
(``SchedulerState``). A request with ``beam_width`` k is the root of a group of up to k beam
requests, ordinary requests to the scheduling rule; ``running`` keeps a group's beams adjacent
(one policy key), and they are scheduled, preempted and aborted as one. docs/architecture.md,
"Beam search: shared blocks and copy-on-write", describes how beams travel to the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from services.common.step import Logprobs
from services.scheduler.beam_blocks import can_allocate_all, copy_on_write, fork
from services.scheduler.beam_search import BeamGroup, num_candidates
from services.scheduler.config import SchedulerConfig
from services.scheduler.outputs import RequestUpdate
from services.scheduler.request import FinishReason, Request, RequestStatus
from services.scheduler.state import SchedulerState
from services.scheduler.step_plan import StepPlan


class BeamScheduler:
    """The beam groups of one scheduler.

    Args:
        config: the scheduler's limits (``max_num_seqs``, ``max_model_len``, ``block_size``).
        state: the scheduler's requests, shared with it.
        eos_token_ids: the model's end-of-sequence ids (they end a hypothesis unless
            ignore_eos).
        vocab_size: the model's vocabulary (caps a beam's candidates), or None (no cap).
    """

    def __init__(self, config: SchedulerConfig, state: SchedulerState,
                 eos_token_ids: frozenset[int], vocab_size: int | None) -> None:
        self.config = config
        self.state = state
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self._beam_ids: set[str] = set()  # ids the groups' beams 1.. (may) take

    def reserves(self, request_id: str) -> bool:
        """Whether a beam group keeps ``request_id`` for one of its beams."""
        return request_id in self._beam_ids

    def add_group(self, request: Request) -> None:
        """Make ``request`` the root of a beam group (``beam_search.py``); its beams ask the
        workers for their top candidates as top logprobs.

        Raises:
            ValueError: more beams than ``max_num_seqs``, an id a beam would take is in use,
                or the beams' KV at full length (the prompt's blocks shared, every beam's own
                output blocks) would not fit in the whole cache (it could never finish).
        """
        config, bm = self.config, self.state.block_manager
        params = request.sampling_params
        k, rid, num_prompt = params.beam_width, request.request_id, request.num_prompt_tokens
        if k > config.max_num_seqs:
            raise ValueError(f"request {rid}: beam_width {k} is more than max_num_seqs="
                             f"{config.max_num_seqs} (every beam is a running sequence)")
        ids = {f"{rid}#beam{i}" for i in range(1, k)}
        if ids & (self.state.requests.keys() | self._beam_ids):
            raise ValueError(f"request {rid}: the ids of its beams ({rid}#beam1 ..) are in use")
        max_new = config.max_model_len - num_prompt
        if params.max_tokens is not None:
            max_new = min(max_new, params.max_tokens)
        needed = bm.num_groups * (bm.num_blocks_needed(num_prompt)
                                  + k * (bm.num_blocks_needed(max_new) + 1))
        if needed > bm.num_blocks:
            raise ValueError(
                f"request {rid}: beam_width {k} with {max_new} new tokens may need {needed} "
                f"KV blocks but the cache has {bm.num_blocks}; lower beam_width or max_tokens")
        stops = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids)
        candidates = num_candidates(k, len(stops))
        if self.vocab_size is not None:
            candidates = min(candidates, self.vocab_size)
        request.sampling_params = replace(params, logprobs=candidates, temperature=0.0)
        request.beam_group = BeamGroup(request, k, max_new, stops, candidates,
                                       params.length_penalty, params.early_stopping)
        self._beam_ids |= ids

    def schedule_group(self, group: BeamGroup[Request], i: int, plan: StepPlan,
                       preempt_tail: Callable[[], Request]) -> int:
        """Schedule the beams of ``group`` (``running[i:i + k]``: one key, so adjacent) as
        one into ``plan``: all that have a token to compute, or none (not enough budget).
        Blocks for all, copy-on-write included, come first, preempting the running tail with
        ``preempt_tail`` until they fit (the group itself, when it is the tail: then it
        restarts). Returns the next index into ``running`` (``i`` when the group was
        preempted)."""
        running, bm = self.state.running, self.state.block_manager
        members = running[i:i + len(group.beams)]
        assert all(r.beam_group is group for r in members), "a beam group is not adjacent"
        writers = [(r, n) for r in members
                   if (n := len(r.prompt_token_ids) + len(r.output_token_ids)
                       - r.num_computed_tokens) > 0]
        total = sum(n for _, n in writers)
        if not writers or total > plan.budget:
            return i + len(members)  # (waiting for the step in flight, or next step)
        while not can_allocate_all(bm, writers):
            victim = preempt_tail()
            if victim.beam_group is group:
                return i
        bs = self.config.block_size
        for request, n in writers:
            copies = copy_on_write(bm, request, n)
            appended = bm.allocate(request, n)
            rid = request.request_id
            if copies:
                plan.blocks_to_copy += copies
                first = plan.first_new_block[rid] = request.num_computed_tokens // bs
                plan.new_blocks[rid] = [b for table in request.block_ids for b in table[first:]]
            else:
                plan.new_blocks[rid] = appended
            plan.num_scheduled[rid] = n
        plan.budget -= total
        return i + len(members)

    def restart(self, group: BeamGroup[Request]) -> None:
        """Preempt a beam group by recompute of its whole search: the beams but the root
        finish, the root goes back to its prompt and waits (preempted). The search is
        deterministic, so it finds the same hypotheses again (its prompt's blocks usually
        still cached). The caller has taken the beams out of ``running``."""
        root, state = group.root, self.state
        for beam in group.beams:
            if beam is not root:
                del state.requests[beam.request_id]
                state.finish(beam, FinishReason.ABORT)
        root.output_token_ids = []
        del root.block_hashes[len(root.prompt_token_ids) // self.config.block_size:]
        root.resend = False
        state.preempt(root)
        group.restart()

    def drop_beams(self, group: BeamGroup[Request]) -> None:
        """End the group's beams but its root (which the caller ends): aborted or done."""
        root, state = group.root, self.state
        for beam in group.beams:
            if beam is not root:
                del state.requests[beam.request_id]
                if beam.status is RequestStatus.RUNNING:
                    state.running.remove(beam)
                state.finish(beam, FinishReason.ABORT)
        rid = root.request_id
        self._beam_ids -= {f"{rid}#beam{i}" for i in range(1, group.beam_width)}

    def proposed(self, beam: Request, top: Logprobs | None) -> RequestUpdate | None:
        """A beam's step came back with its candidates (``top``); once the whole group has
        proposed, pick the next beams (fork, append) or end the search. Returns the group's
        final update when it ended."""
        group, state = beam.beam_group, self.state
        assert group is not None
        if top is None or not top.top_token_ids:
            # NOTE: the worker owed candidates and sent none (a worker bug): recompute the
            # search rather than leave the group waiting for ever.
            state.running[:] = [r for r in state.running if r.beam_group is not group]
            if len(group.beams) > 1:
                self.restart(group)
            else:
                state.preempt(beam)
            return None
        if not group.propose(beam, top.top_token_ids, top.top_logprobs):
            return None
        picks = group.select()
        if picks is None:
            root = group.root
            self.drop_beams(group)
            del state.requests[root.request_id]
            best = group.finished[0]
            state.finish(root, best.finish_reason)
            return RequestUpdate(root.request_id, [], best.finish_reason,
                                 root.num_prompt_tokens, len(best.token_ids),
                                 max(root.num_cached_tokens, 0), beams=group.finished)
        parents = group.beams
        first_child: dict[int, int] = {}
        for j, pick in enumerate(picks):
            first_child.setdefault(pick.parent, j)
        spare = [b for p, b in enumerate(parents) if p not in first_child]
        beams: list[Request] = [parents[p] for p in (pick.parent for pick in picks)]
        for j, pick in enumerate(picks):  # forks first: from the parents' tokens as they are
            if first_child[pick.parent] != j:
                child = spare.pop() if spare else self._new_beam(group)
                self._fork(child, parents[pick.parent], pick.token_id)
                beams[j] = child
        for p, j in first_child.items():
            parents[p].output_token_ids.append(picks[j].token_id)
        assert not spare, "every dropped beam is reused"
        group.beams, group.scores = beams, [pick.score for pick in picks]
        return None

    def _new_beam(self, group: BeamGroup[Request]) -> Request:
        """A new running beam request of ``group`` (its id ``f"{root id}#beam{i}"``, the
        first free one of 1 .. k-1)."""
        root = group.root
        taken = {b.request_id for b in group.beams}
        rid = next(f"{root.request_id}#beam{i}" for i in range(1, group.beam_width)
                   if f"{root.request_id}#beam{i}" not in taken and
                   f"{root.request_id}#beam{i}" not in self.state.requests)
        beam = Request(rid, root.prompt_token_ids, root.sampling_params, root.arrival_time,
                       RequestStatus.RUNNING, priority=root.priority,
                       arrival_seq=root.arrival_seq, num_cached_tokens=root.num_cached_tokens,
                       extra_keys=root.extra_keys, beam_group=group, lora=root.lora)
        self.state.requests[rid] = beam
        self.state.add_running(beam)
        return beam

    def _fork(self, child: Request, parent: Request, token_id: int) -> None:
        """``child`` becomes ``parent`` + ``token_id``: its tables a fork of the parent's,
        its tokens the parent's plus the one (sent whole to the workers next step)."""
        fork(self.state.block_manager, child, parent)
        child.output_token_ids = [*parent.output_token_ids, token_id]
        child.num_computed_tokens = parent.num_computed_tokens
        child.resend = True
        child.epoch = self.state.new_epoch()
