"""The step types (``step.py``) on the wire: the one encoder and decoder of worker.proto's
StepRequest and StepResult (columns as worker.proto describes them).

The decoders check structure only (columns that agree in length), so a malformed message is
refused at the boundary with ValueError; what the worker's sampler can use is the worker's
own check (``services/worker/step_checks.py``).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from itertools import accumulate, chain

from services.common.lora import LoRARequest
from services.common.pb.pagedserve.v1 import engine_pb2, worker_pb2
from services.common.sampling_params import EngineSamplingParams
from services.common.step import (
    CachedRequest,
    KVTransfer,
    Logprobs,
    NewRequest,
    SampledLogprobs,
    StepInput,
    StepOutput,
)


def _cut(flat: list, counts) -> list[list]:
    """``flat`` cut into consecutive pieces of ``counts`` (which sum to its length)."""
    ends = list(accumulate(counts))
    return [flat[e - n:e] for e, n in zip(ends, counts, strict=True)]


# NOTE: CachedRequests holds one CachedRequest per entry as columns named after its fields:
# ``request_id`` is ``request_ids``, a list field f is the flat column f plus its counts num_f,
# any other field is its own column; a column whose every entry is the field's default (no
# tokens, appended blocks, no drafts, no beams ...) is sent empty.
_ZERO = {"int": 0, "bool": False}
# (name, a list field?, default) of every CachedRequest field after request_id (the types are
# strings: step.py's annotations are postponed)
_CACHED = [(f.name, str(f.type).startswith("list"),
            None if str(f.type).startswith("list") else
            f.default if f.default is not MISSING else _ZERO[str(f.type)])
           for f in fields(CachedRequest)[1:]]


def _cached_requests_to_pb(cached: list[CachedRequest]) -> worker_pb2.CachedRequests:
    """The cached requests as columns."""
    msg = worker_pb2.CachedRequests(request_ids=[c.request_id for c in cached])
    for name, is_list, default in _CACHED:
        values = [getattr(c, name) for c in cached]
        if is_list:
            if any(values):
                getattr(msg, name).extend(chain.from_iterable(values))
                getattr(msg, f"num_{name}").extend(map(len, values))
        elif any(v != default for v in values):
            getattr(msg, name).extend(values)
    return msg


def lora_to_pb(lora: LoRARequest | None) -> engine_pb2.LoRARequest | None:
    """The adapter as its message (None stays None: the field is left unset)."""
    if lora is None:
        return None
    return engine_pb2.LoRARequest(lora_id=lora.lora_id, name=lora.name, path=lora.path)


def lora_from_pb(msg, field: str = "lora") -> LoRARequest | None:
    """The adapter in ``msg``'s ``field`` (a LoRARequest message), or None when unset."""
    if not msg.HasField(field):
        return None
    lora = getattr(msg, field)
    return LoRARequest(lora.lora_id, lora.name, lora.path)


def step_to_pb(step: StepInput) -> worker_pb2.StepRequest:
    """Encode ``step`` as is (a rank's view of it: ``StepInput.for_rank``)."""
    return worker_pb2.StepRequest(
        step_id=step.step_id,
        new_requests=[
            worker_pb2.NewRequest(
                request_id=r.request_id, prompt_token_ids=r.prompt_token_ids,
                sampling_params=r.sampling_params.to_pb(), block_ids=r.block_ids,
                num_computed_tokens=r.num_computed_tokens,
                num_scheduled_tokens=r.num_scheduled_tokens, lora=lora_to_pb(r.lora))
            for r in step.new_requests],
        cached_requests=_cached_requests_to_pb(step.cached_requests),
        finished_request_ids=sorted(step.finished_request_ids),
        copy_src_block_ids=[src for src, _ in step.blocks_to_copy],
        copy_dst_block_ids=[dst for _, dst in step.blocks_to_copy],
        num_speculative_tokens=step.num_speculative_tokens,
        kv_store_block_ids=[t.block_id for t in step.kv_stores],
        kv_store_groups=[t.group for t in step.kv_stores],
        kv_store_keys=[t.key for t in step.kv_stores],
        kv_load_block_ids=[t.block_id for t in step.kv_loads],
        kv_load_groups=[t.group for t in step.kv_loads],
        kv_load_keys=[t.key for t in step.kv_loads],
        traced_request_ids=list(step.traceparents), traceparents=step.traceparents.values())


def _kv_transfers(msg: worker_pb2.StepRequest, kind: str) -> list[KVTransfer]:
    """The aligned ``kv_{kind}_*`` columns of ``msg`` as KVTransfers.

    Raises:
        ValueError: columns of different lengths.
    """
    ids, groups, keys = (getattr(msg, f"kv_{kind}_{c}") for c in ("block_ids", "groups", "keys"))
    if not len(ids) == len(groups) == len(keys):
        raise ValueError(f"malformed StepRequest: {len(ids)} kv_{kind}_block_ids, "
                         f"{len(groups)} kv_{kind}_groups, {len(keys)} kv_{kind}_keys")
    return [KVTransfer(*t) for t in zip(ids, groups, keys, strict=True)]


def cached_requests_from_pb(c: worker_pb2.CachedRequests) -> list[CachedRequest]:
    """Cut the columnar CachedRequests back into one CachedRequest per request.

    Raises:
        ValueError: the columns disagree in length (a malformed message).
    """
    n = len(c.request_ids)
    columns: list[list] = [list(c.request_ids)]
    for name, is_list, default in _CACHED:
        values = list(getattr(c, name))
        if is_list:
            counts = list(getattr(c, f"num_{name}")) or ([] if values else [0] * n)
            if len(counts) != n or sum(counts) != len(values) or min(counts, default=0) < 0:
                raise ValueError(f"malformed CachedRequests: {n} request ids but "
                                 f"{len(counts)} num_{name} that count {sum(counts)} of "
                                 f"{len(values)} {name}")
            values = _cut(values, counts)
        elif not values:
            values = [default] * n
        elif len(values) != n:
            raise ValueError(f"malformed CachedRequests: {n} request ids but {len(values)} "
                             f"{name}")
        columns.append(values)
    return [CachedRequest(*row) for row in zip(*columns, strict=True)]


def step_from_pb(msg: worker_pb2.StepRequest) -> StepInput:
    """Decode a StepRequest.

    Raises:
        ValueError: CachedRequests columns that disagree, or copy, KV tier or tracing
            columns of different lengths.
    """
    src, dst = msg.copy_src_block_ids, msg.copy_dst_block_ids
    if len(src) != len(dst):
        raise ValueError(f"malformed StepRequest: {len(src)} copy_src_block_ids but "
                         f"{len(dst)} copy_dst_block_ids")
    if len(msg.traced_request_ids) != len(msg.traceparents):
        raise ValueError(f"malformed StepRequest: {len(msg.traced_request_ids)} "
                         f"traced_request_ids but {len(msg.traceparents)} traceparents")
    return StepInput(
        step_id=msg.step_id,
        new_requests=[NewRequest(
            r.request_id, list(r.prompt_token_ids),
            EngineSamplingParams.from_pb(r.sampling_params), list(r.block_ids),
            r.num_computed_tokens, r.num_scheduled_tokens, lora_from_pb(r))
            for r in msg.new_requests],
        cached_requests=cached_requests_from_pb(msg.cached_requests),
        finished_request_ids=list(msg.finished_request_ids),
        blocks_to_copy=list(zip(src, dst, strict=True)),
        num_speculative_tokens=msg.num_speculative_tokens,
        kv_stores=_kv_transfers(msg, "store"), kv_loads=_kv_transfers(msg, "load"),
        traceparents=dict(zip(msg.traced_request_ids, msg.traceparents, strict=True)))


def step_output_to_pb(out: StepOutput) -> worker_pb2.StepResult:
    """Encode a step's ``StepOutput`` as the StepResult message."""
    result = worker_pb2.StepResult(step_id=out.step_id, request_ids=out.request_ids,
                                   sampled_token_ids=out.sampled_token_ids)
    if out.num_sampled_token_ids is not None and any(n != 1 for n in out.num_sampled_token_ids):
        result.num_sampled_token_ids.extend(out.num_sampled_token_ids)
    if out.draft_token_ids is not None and any(out.draft_token_ids):
        result.num_draft_token_ids.extend(map(len, out.draft_token_ids))
        result.draft_token_ids.extend(chain.from_iterable(out.draft_token_ids))
    if out.logprobs is not None:
        lp = out.logprobs
        result.num_top_logprobs.extend(lp.num_top_logprobs)
        result.sampled_logprobs.extend(lp.sampled_logprobs)
        result.top_token_ids.extend(lp.top_token_ids)
        result.top_logprobs.extend(lp.top_logprobs)
    if out.embeddings is not None:
        result.embeddings.extend(chain.from_iterable(out.embeddings))
    result.failed_request_ids.extend(out.failed_request_ids)
    result.kv_loads_done.extend(out.kv_loads_done)
    result.kv_loads_failed.extend(out.kv_loads_failed)
    result.failed_messages.extend(out.failed_messages)
    result.broken_request_ids.extend(out.broken_request_ids)
    result.broken_messages.extend(out.broken_messages)
    for pl in out.prompt_logprobs:
        result.prompt_request_ids.append(pl.request_id)
        result.prompt_first_positions.append(pl.start)
        result.prompt_num_tokens.append(len(pl.logprobs))
        result.prompt_num_top.append(pl.k)
        result.prompt_logprobs.extend(pl.logprobs)
        result.prompt_top_token_ids.extend(pl.top_token_ids)
        result.prompt_top_logprobs.extend(pl.top_logprobs)
    return result


def step_output_from_pb(r: worker_pb2.StepResult) -> StepOutput:
    """Decode a StepResult.

    Raises:
        ValueError: columns that disagree in length (sampled tokens and their counts, drafts,
            logprobs, prompt logprobs, embeddings, failed or broken requests), naming which.
    """
    if len(r.broken_request_ids) != len(r.broken_messages):
        raise ValueError(f"step {r.step_id}: malformed broken request columns: "
                         f"{len(r.broken_request_ids)} ids, {len(r.broken_messages)} messages")
    out = _step_output_from_pb(r)
    out.kv_loads_done, out.kv_loads_failed = list(r.kv_loads_done), list(r.kv_loads_failed)
    out.broken_request_ids, out.broken_messages = (list(r.broken_request_ids),
                                                   list(r.broken_messages))
    return out


def _step_output_from_pb(r: worker_pb2.StepResult) -> StepOutput:
    """``step_output_from_pb`` but the KV tier's columns."""
    n = len(r.request_ids)
    if len(r.failed_request_ids) != len(r.failed_messages):
        raise ValueError(f"step {r.step_id}: malformed failed request columns: "
                         f"{len(r.failed_request_ids)} ids, {len(r.failed_messages)} messages")
    failed_ids, failed_messages = list(r.failed_request_ids), list(r.failed_messages)
    if r.embeddings:  # a pooling runner's step: vectors, no tokens
        size = len(r.embeddings) // max(n, 1)
        if r.sampled_token_ids or size * n != len(r.embeddings):
            raise ValueError(f"step {r.step_id}: malformed embeddings columns: {n} request ids, "
                             f"{len(r.embeddings)} floats, {len(r.sampled_token_ids)} tokens")
        return StepOutput(r.step_id, list(r.request_ids), [],
                          embeddings=_cut(list(r.embeddings), [size] * n),
                          failed_request_ids=failed_ids, failed_messages=failed_messages)
    counts = list(r.num_sampled_token_ids)
    if (len(counts) != n or sum(counts) != len(r.sampled_token_ids) or min(counts) < 1
            if counts else n != len(r.sampled_token_ids)):
        raise ValueError(f"step {r.step_id}: malformed sampled token columns: {n} request ids, "
                         f"{len(r.sampled_token_ids)} tokens, {len(counts)} counts")
    num_drafts = list(r.num_draft_token_ids)
    if num_drafts and (len(num_drafts) != n or sum(num_drafts) != len(r.draft_token_ids)
                       or min(num_drafts) < 0):
        raise ValueError(f"step {r.step_id}: malformed draft token columns")
    logprobs = None
    if len(r.num_top_logprobs):
        asking = [k for k in r.num_top_logprobs if k >= 0]
        if (len(r.num_top_logprobs) != len(r.sampled_token_ids)
                or len(asking) != len(r.sampled_logprobs)
                or not sum(asking) == len(r.top_token_ids) == len(r.top_logprobs)):
            raise ValueError(f"step {r.step_id}: malformed logprobs columns")
        logprobs = SampledLogprobs(list(r.num_top_logprobs), list(r.sampled_logprobs),
                                   list(r.top_token_ids), list(r.top_logprobs))
    counts_p, ks = list(r.prompt_num_tokens), list(r.prompt_num_top)
    pairs = [c * k for c, k in zip(counts_p, ks, strict=False)]
    if (not len(r.prompt_first_positions) == len(counts_p) == len(ks)
            == len(r.prompt_request_ids) or sum(counts_p) != len(r.prompt_logprobs)
            or not sum(pairs) == len(r.prompt_top_token_ids) == len(r.prompt_top_logprobs)):
        raise ValueError(f"step {r.step_id}: malformed prompt logprobs columns")
    prompt = [Logprobs(*fields) for fields in zip(
        r.prompt_request_ids, r.prompt_first_positions, _cut(list(r.prompt_logprobs), counts_p),
        _cut(list(r.prompt_top_token_ids), pairs), _cut(list(r.prompt_top_logprobs), pairs),
        strict=True)]
    return StepOutput(r.step_id, list(r.request_ids), list(r.sampled_token_ids), logprobs,
                      prompt, counts or None,
                      _cut(list(r.draft_token_ids), num_drafts) if num_drafts else None,
                      failed_request_ids=failed_ids, failed_messages=failed_messages)
