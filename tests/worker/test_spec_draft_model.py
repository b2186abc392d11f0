"""DraftModelProposer against transformers at float32: its drafts are the greedy continuation.

The draft is a tiny random-weight Llama and the reference is transformers' ``generate`` of the
same weights. Verification is played here: after each call the token list grows by the
accepted drafts and one other token (all accepted, none, some), and the next call's drafts
must again be the greedy continuation of the whole list; that checks which draft K/V the
proposer keeps and which it recomputes (also counted, through the tokens each forward feeds).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from services.worker.attention import select_backend
from services.worker.spec_decode.draft_model import DraftModelProposer
from tests.helpers import make_tiny_llama, make_tiny_mistral

BLOCK_SIZE = 4
NUM_BLOCKS = 96
VOCAB = 512
K = 4
BACKENDS = ["torch", "cpu"]


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Tiny forwards: one thread (two threads on a loaded machine are far slower)."""


@pytest.fixture(scope="module")
def draft_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # (no EOS: generate must not stop before k tokens)
    return make_tiny_llama(tmp_path_factory.mktemp("draft"), seed=3, eos_token_id=None)


@pytest.fixture(scope="module")
def reference(draft_path: Path) -> HFLlamaForCausalLM:
    return HFLlamaForCausalLM.from_pretrained(draft_path, dtype=torch.float32).eval()


def greedy(reference: HFLlamaForCausalLM, tokens: list[int], k: int) -> list[int]:
    """transformers' greedy continuation of ``tokens``, ``k`` tokens."""
    with torch.inference_mode():
        out = reference.generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=k,
                                 min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    continuation = out[0, len(tokens):].tolist()
    assert len(continuation) == k
    return continuation


def make_proposer(path: Path, backend: str = "torch", num_blocks: int = NUM_BLOCKS
                  ) -> DraftModelProposer:
    proposer = DraftModelProposer(str(path), torch.float32, torch.device("cpu"),
                                  select_backend(backend, "cpu"), BLOCK_SIZE, VOCAB)
    proposer.allocate_kv_cache(num_blocks)
    return proposer


def count_fed(proposer: DraftModelProposer) -> list[int]:
    """A list that gets, per draft forward from now on, how many tokens it fed."""
    fed: list[int] = []
    proposer.model.register_forward_pre_hook(lambda _, args: fed.append(int(args[0].shape[0])))
    return fed


def arr(tokens: list[int]) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def verify(rng: random.Random, tokens: list[int], drafts: list[int], accepted: int) -> list[int]:
    """The token list after a verification that accepted ``accepted`` of ``drafts`` and then
    sampled a token other than the next draft."""
    rejected = drafts[accepted] if accepted < len(drafts) else -1
    x = rng.choice([t for t in range(VOCAB) if t != rejected])
    return tokens + drafts[:accepted] + [x]


def test_sizes(draft_path):
    proposer = make_proposer(draft_path, num_blocks=7)
    # 3 layers x K and V x 4 tokens x 2 KV heads x head_dim 16 x 4 bytes
    assert proposer.bytes_per_block == 2 * 3 * BLOCK_SIZE * 2 * 16 * 4
    assert len(proposer.kv_caches) == 3
    for k_cache, v_cache in proposer.kv_caches:
        assert k_cache.shape == v_cache.shape == (7, BLOCK_SIZE, 2, 16)
        assert k_cache.dtype == torch.float32 and not k_cache.any() and not v_cache.any()
    assert proposer.propose(["a"], [arr([1, 2, 3])], [arr([0, 1])], 0) == [[]]
    assert proposer.propose([], [], [], K) == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_drafts_are_greedy_across_verification_outcomes(backend, draft_path, reference):
    proposer = make_proposer(draft_path, backend)
    fed = count_fed(proposer)
    rng = random.Random(0)
    table = arr(rng.sample(range(NUM_BLOCKS), 30))  # 120 slots
    tokens = [rng.randrange(VOCAB) for _ in range(29)]
    outcomes = [K, 0, 2, K, 1, K - 1, 0, 3, K]  # accepted drafts per verification
    previous = None
    for accepted in [*outcomes, None]:
        fed.clear()
        drafts = proposer.propose(["r"], [arr(tokens)], [table], K)[0]
        assert drafts == greedy(reference, tokens, K)
        # round 0 feeds what the cache lacks; then d0 .. d(k-2), one each
        if previous is None:
            assert fed == [len(tokens)] + [1] * (K - 1)
        else:
            kept = min(previous, K - 1)  # fed drafts d0 .. d(k-2) that were accepted
            assert fed == [previous + 1 - kept] + [1] * (K - 1)
        if accepted is not None:
            tokens = verify(rng, tokens, drafts, accepted)
        previous = accepted


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_requests_match_one_at_a_time(backend, draft_path, reference):
    rng = random.Random(1)
    lens = [1, 5, 17, 33, 8]
    widths = [12, 3, 10, 9, 20]  # blocks: requests 1 and 3 run out of slots as they grow
    blocks = rng.sample(range(NUM_BLOCKS), sum(widths))
    tables = [arr(blocks[sum(widths[:i]):sum(widths[:i + 1])]) for i in range(len(lens))]
    ids = [f"r{i}" for i in range(len(lens))]
    tokens = [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]
    batched, single = make_proposer(draft_path, backend), make_proposer(draft_path, backend)
    fed = count_fed(batched)
    for _ in range(4):
        fed.clear()
        together = batched.propose(ids, [arr(t) for t in tokens], tables, K)
        assert len(fed) == max(map(len, together))  # one forward per round, all requests
        alone = [single.propose([i], [arr(t)], [table], K)[0]
                 for i, t, table in zip(ids, tokens, tables, strict=True)]
        assert together == alone
        for t, table, d in zip(tokens, tables, together, strict=True):
            m = max(0, min(K, len(table) * BLOCK_SIZE - len(t) + 1))
            assert d == greedy(reference, t, K)[:m]
        tokens = [verify(rng, t, d, rng.randint(0, len(d))) if d else t
                  for t, d in zip(tokens, together, strict=True)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_block_tables_give_fewer_drafts_and_write_nothing_outside(
        backend, draft_path, reference):
    proposer = make_proposer(draft_path, backend, num_blocks=16)
    for k_cache, v_cache in proposer.kv_caches:
        k_cache.fill_(7.0)
        v_cache.fill_(7.0)
    rng = random.Random(2)
    tokens = [rng.randrange(VOCAB) for _ in range(13)]
    cases = [  # (request, tokens, table, drafts expected, positions written)
        ("none", tokens, [3, 9, 4], 0, 0),  # 12 slots < 13 tokens: no drafts, no writes
        ("one", tokens[:12], [5, 0, 11], 1, 12),  # the last slot for t11: d0 only
        ("three", tokens[:10], [1, 14, 6], 3, 12),  # feeds d0, d1 at 10, 11
        ("k-bound", tokens[:6], [2, 8, 12, 15], 2, 7),  # k = 2: d0 fed at 6, 7.. untouched
    ]
    for rid, t, table, m, _ in cases:
        k = 2 if rid == "k-bound" else K
        drafts = proposer.propose([rid], [arr(t)], [arr(table)], k)[0]
        assert drafts == greedy(reference, t, K)[:m]
    written = torch.zeros(16 * BLOCK_SIZE, dtype=torch.bool)
    for _, _, table, _, n in cases:
        for p in range(n):
            written[table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE] = True
    for k_cache, v_cache in proposer.kv_caches:
        for cache in (k_cache, v_cache):
            flat = cache.reshape(16 * BLOCK_SIZE, -1)
            assert (flat[~written] == 7.0).all()  # never written
            assert (flat[written] != 7.0).all()  # every fed position's K/V is there


def test_vocab_mismatch_and_sliding_window_are_refused(draft_path, tmp_path):
    with pytest.raises(ValueError, match=r"512.*1000|1000.*512"):
        DraftModelProposer(str(draft_path), torch.float32, torch.device("cpu"),
                           select_backend("torch", "cpu"), BLOCK_SIZE, 1000)
    mistral = make_tiny_mistral(tmp_path / "mistral")
    with pytest.raises(ValueError, match="sliding-window"):
        DraftModelProposer(str(mistral), torch.float32, torch.device("cpu"),
                           select_backend("torch", "cpu"), BLOCK_SIZE, VOCAB)


def test_drop_and_changed_history_recompute(draft_path, reference):
    proposer = make_proposer(draft_path)
    fed = count_fed(proposer)
    rng = random.Random(3)
    table = arr(rng.sample(range(NUM_BLOCKS), 12))
    tokens = [rng.randrange(VOCAB) for _ in range(21)]
    first = proposer.propose(["r"], [arr(tokens)], [table], K)[0]
    tokens = verify(rng, tokens, first, 1)  # 23 tokens, 22 of them with draft K/V
    # dropped (finished, or resumed): everything again, from position 0
    proposer.drop("r")
    proposer.drop("never-seen")  # (a no-op)
    fed.clear()
    assert proposer.propose(["r"], [arr(tokens)], [table], K)[0] == greedy(reference, tokens, K)
    assert fed[0] == len(tokens)
    # a resumed request whose outputs differ from what the draft saw, without a drop:
    # recomputed from the first differing token
    tokens[15] = (tokens[15] + 1) % VOCAB
    fed.clear()
    assert proposer.propose(["r"], [arr(tokens)], [table], K)[0] == greedy(reference, tokens, K)
    assert fed[0] == len(tokens) - 15
    # two steps without drafts (disabled by batch size) between calls: the fed drafts are
    # checked against the tokens the target sampled there; the first one matches, then not
    for first_matches in (True, False):
        drafts = proposer.propose(["r"], [arr(tokens)], [table], K)[0]
        x = drafts[0] if first_matches else (drafts[0] + 1) % VOCAB
        tokens = [*tokens, x, (drafts[1] + 1) % VOCAB]
        fed.clear()
        assert proposer.propose(["r"], [arr(tokens)], [table], K)[0] == greedy(
            reference, tokens, K)
        assert fed[0] == (1 if first_matches else 2)
    # a block id changed under a position (its K/V is elsewhere): from that block on
    table = table.copy()
    table[2] = next(b for b in range(NUM_BLOCKS) if b not in table)
    fed.clear()
    assert proposer.propose(["r"], [arr(tokens)], [table], K)[0] == greedy(reference, tokens, K)
    assert fed[0] == len(tokens) - 2 * BLOCK_SIZE
    # another request of the same tokens in other blocks: its own state, from 0
    other = arr(rng.sample([b for b in range(NUM_BLOCKS) if b not in table], 12))
    fed.clear()
    assert proposer.propose(["s"], [arr(tokens)], [other], K)[0] == greedy(reference, tokens, K)
    assert fed[0] == len(tokens)
