"""A pooling scheduler (workers on --runner pooling): a request is its prompt's forward only,
finished with its vector by the step that computes its last prompt token."""

from services.common.step import StepOutput
from services.scheduler.outputs import ScheduledStep
from services.scheduler.request import FinishReason, RequestStatus
from tests.scheduler.factories import make_request, make_scheduler


def _pooled(out: ScheduledStep) -> StepOutput:
    """A fake pooling worker's answer: a vector for each request whose chunk ended its prompt
    (its id's index, its computed length)."""
    rids = [rid for rid in out.epochs if rid in out.sampled_req_ids]
    return StepOutput(out.step_id, rids, [],
                      embeddings=[[float(rid.split("-")[1]), 1.0] for rid in rids])


def _run(sched, max_steps: int = 50) -> tuple[list, list[ScheduledStep]]:
    updates, steps = [], []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        steps.append(out)
        updates += sched.update_from_output(out, _pooled(out))
    return updates, steps


def test_a_request_ends_with_its_vector_when_its_prompt_is_computed_and_frees_its_blocks():
    sched = make_scheduler(64, block_size=4, max_num_batched_tokens=8, max_model_len=32,
                           pooling=True, enable_prefix_caching=True)
    requests = [make_request(1, 3), make_request(2, 20), make_request(3, 32)]
    for r in requests:
        sched.add_request(r)  # (a pooling prompt may be max_model_len long: no output)
    updates, steps = _run(sched)
    assert [(u.request_id, u.finish_reason, u.new_token_ids, u.embedding) for u in updates] == [
        ("req-1", FinishReason.STOP, [], [1.0, 1.0]),
        ("req-2", FinishReason.STOP, [], [2.0, 1.0]),
        ("req-3", FinishReason.STOP, [], [3.0, 1.0])]
    assert all(r.status is RequestStatus.FINISHED and not r.output_token_ids for r in requests)
    assert max(s.total_num_scheduled_tokens for s in steps) == 8  # chunked in the budget
    assert sum(s.total_num_scheduled_tokens for s in steps) == 3 + 20 + 32  # nothing more
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    # the same prompt again: no prefix-cache hit (every token's state is needed)
    again = make_request(2, 20)
    sched.add_request(again)
    _run(sched)
    assert again.num_cached_tokens == 0


def test_a_step_without_the_vector_recomputes_the_request():
    sched = make_scheduler(64, pooling=True)
    r = make_request(1, 5)
    sched.add_request(r)
    out = sched.schedule()
    assert sched.update_from_output(out, StepOutput(out.step_id, [], [], embeddings=[])) == []
    assert r.status is RequestStatus.PREEMPTED and r.num_computed_tokens == 0
    updates, _ = _run(sched)
    assert [u.embedding for u in updates] == [[1.0, 1.0]]
