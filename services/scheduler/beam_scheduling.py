"""The scheduler's side of beam search: a beam group's admission, scheduling, forks,
restart by recompute and end (the search itself, torch-free and scheduler-free, is
``beam_search.py``).

``BeamScheduling`` is a mixin of ``Scheduler`` (``scheduler.py``): its methods are the
scheduler's own, kept here so that the scheduling rule reads alone. A request with
``beam_width`` k is the root of a group of up to k beam requests, ordinary requests to the
rule; ``running`` keeps a group's beams adjacent (one policy key), and they are scheduled,
preempted and aborted as one. See the module docstring of ``scheduler.py`` for how beams
travel to the workers.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from services.scheduler.beam_search import BeamGroup, num_candidates
from services.scheduler.block_manager import BlockManager
from services.scheduler.logprobs import TokenLogprobs
from services.scheduler.outputs import RequestUpdate
from services.scheduler.request import FinishReason, Request, RequestStatus

if TYPE_CHECKING:
    from services.scheduler.scheduler import SchedulerConfig


class BeamScheduling:
    """Beam-group methods of ``Scheduler`` (a mixin; the state is the scheduler's)."""

    if TYPE_CHECKING:  # the Scheduler's attributes and methods these use
        config: SchedulerConfig
        block_manager: BlockManager
        eos_token_ids: frozenset[int]
        vocab_size: int | None
        requests: dict[str, Request]
        running: list[Request]
        _key: Callable[[Request], Any]
        _num_epochs: int
        _beam_ids: set[str]
        _blocks_to_copy: list[tuple[int, int]]

        def _preempt(self, request: Request) -> None: ...
        def _preempt_tail(self) -> Request: ...
        def _finish(self, request: Request, reason: FinishReason) -> None: ...

    def _add_beam_group(self, request: Request) -> None:
        """Make ``request`` the root of a beam group (``beam_search.py``); its beams ask the
        workers for their top candidates as top logprobs.

        Raises:
            ValueError: more beams than ``max_num_seqs``, an id a beam would take is in use,
                or the beams' KV at full length (the prompt's blocks shared, every beam's own
                output blocks) would not fit in the whole cache (it could never finish).
        """
        config, bm = self.config, self.block_manager
        params = request.sampling_params
        k, rid, num_prompt = params.beam_width, request.request_id, request.num_prompt_tokens
        if k > config.max_num_seqs:
            raise ValueError(f"request {rid}: beam_width {k} is more than max_num_seqs="
                             f"{config.max_num_seqs} (every beam is a running sequence)")
        ids = {f"{rid}#beam{i}" for i in range(1, k)}
        if ids & (self.requests.keys() | self._beam_ids):
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

    def _schedule_beams(self, group: BeamGroup, i: int, budget: int,
                        num_scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                        first_new_block: dict[str, int]) -> tuple[int, int]:
        """Schedule the beams of ``group`` (``running[i:i + k]``: one key, so adjacent) as
        one: all that have a token to compute, or none (not enough budget). Blocks for all,
        copy-on-write included, come first, preempting the running tail until they fit (the
        group itself, when it is the tail: then it restarts). Returns (the next index into
        ``running``, the budget left)."""
        running, bm = self.running, self.block_manager
        members = running[i:i + len(group.beams)]
        assert all(r.beam_group is group for r in members), "a beam group is not adjacent"
        writers = [(r, n) for r in members
                   if (n := len(r.prompt_token_ids) + len(r.output_token_ids)
                       - r.num_computed_tokens) > 0]
        total = sum(n for _, n in writers)
        if not writers or total > budget:
            return i + len(members), budget  # (waiting for the step in flight, or next step)
        while not bm.can_allocate_all(writers):
            victim = self._preempt_tail()
            if victim.beam_group is group:
                return i, budget
        bs = self.config.block_size
        for request, n in writers:
            copies = bm.copy_on_write(request, n)
            appended = bm.allocate(request, n)
            rid = request.request_id
            if copies:
                self._blocks_to_copy += copies
                first = first_new_block[rid] = request.num_computed_tokens // bs
                new_blocks[rid] = [b for table in request.block_ids for b in table[first:]]
            else:
                new_blocks[rid] = appended
            num_scheduled[rid] = n
        return i + len(members), budget - total

    def _restart_beams(self, group: BeamGroup) -> None:
        """Preempt a beam group by recompute of its whole search: the beams but the root
        finish, the root goes back to its prompt and waits (preempted). The search is
        deterministic, so it finds the same hypotheses again (its prompt's blocks usually
        still cached). The caller has taken the beams out of ``running``."""
        root = group.root
        for beam in group.beams:
            if beam is not root:
                del self.requests[beam.request_id]
                self._finish(beam, FinishReason.ABORT)
        root.output_token_ids = []
        del root.block_hashes[len(root.prompt_token_ids) // self.config.block_size:]
        root.resend = False
        self._preempt(root)
        group.restart()

    def _drop_beams(self, group: BeamGroup) -> None:
        """End the group's beams but its root (which the caller ends): aborted or done."""
        root = group.root
        for beam in group.beams:
            if beam is not root:
                del self.requests[beam.request_id]
                if beam.status is RequestStatus.RUNNING:
                    self.running.remove(beam)
                self._finish(beam, FinishReason.ABORT)
        rid = root.request_id
        self._beam_ids -= {f"{rid}#beam{i}" for i in range(1, group.beam_width)}

    def _beam_proposed(self, beam: Request, top: TokenLogprobs | None) -> RequestUpdate | None:
        """A beam's step came back with its candidates (``top``); once the whole group has
        proposed, pick the next beams (fork, append) or end the search. Returns the group's
        final update when it ended."""
        group = beam.beam_group
        assert group is not None
        if top is None or not top.top_token_ids:
            # NOTE: the worker owed candidates and sent none (a worker bug): recompute the
            # search rather than leave the group waiting for ever.
            self.running[:] = [r for r in self.running if r.beam_group is not group]
            if len(group.beams) > 1:
                self._restart_beams(group)
            else:
                self._preempt(beam)
            return None
        if not group.propose(beam, top.top_token_ids, top.top_logprobs):
            return None
        picks = group.select()
        if picks is None:
            root = group.root
            self._drop_beams(group)
            del self.requests[root.request_id]
            best = group.finished[0]
            self._finish(root, best.finish_reason)
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

    def _new_beam(self, group: BeamGroup) -> Request:
        """A new running beam request of ``group`` (its id ``f"{root id}#beam{i}"``, the
        first free one of 1 .. k-1)."""
        root = group.root
        taken = {b.request_id for b in group.beams}
        rid = next(f"{root.request_id}#beam{i}" for i in range(1, group.beam_width)
                   if f"{root.request_id}#beam{i}" not in taken and
                   f"{root.request_id}#beam{i}" not in self.requests)
        beam = Request(rid, root.prompt_token_ids, root.sampling_params, root.arrival_time,
                       RequestStatus.RUNNING, priority=root.priority,
                       arrival_seq=root.arrival_seq, num_cached_tokens=root.num_cached_tokens,
                       extra_keys=root.extra_keys, beam_group=group)
        self.requests[rid] = beam
        bisect.insort(self.running, beam, key=self._key)
        return beam

    def _fork(self, child: Request, parent: Request, token_id: int) -> None:
        """``child`` becomes ``parent`` + ``token_id``: its tables a fork of the parent's,
        its tokens the parent's plus the one (sent whole to the workers next step)."""
        self.block_manager.fork(child, parent)
        child.output_token_ids = [*parent.output_token_ids, token_id]
        child.num_computed_tokens = parent.num_computed_tokens
        child.resend = True
        self._num_epochs += 1
        child.epoch = self._num_epochs
