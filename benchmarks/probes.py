"""First-step logprob probes on SmolLM2: 16 one-message chats, and the distance of an engine's
top logprobs to transformers' float32 ones. Shared by the logprob benchmarks
(``logprob_distance``, ``kv_cache_dtype``, ``first_token``) and the tests that bound the same
distances (``tests/stack/test_same_answer.py``, ``tests/worker/test_model.py``).
"""

from __future__ import annotations

PROBE_CHATS = [
    "What is the capital of France?", "List three fruits.", "Write a haiku about autumn.",
    "Explain gravity to a child.", "What is 17 times 23?", "Name a famous painter.",
    "How do I boil an egg?", "Translate 'good morning' into Spanish.",
    "Why is the sky blue?", "Give me a synonym for happy.", "What does a CPU do?",
    "Suggest a name for a cat.", "Who wrote Hamlet?", "What is the boiling point of water?",
    "Describe the ocean in one sentence.", "What is machine learning?"]
TOP = 5  # top logprobs compared per prompt


def chat_prompts(chats: list[str]) -> list[list[int]]:
    """The prompt ids of one-message chats, by transformers' tokenizer and chat template."""
    from transformers import AutoTokenizer

    from services.common.model_files import resolve_model

    src = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    return [list(tok.apply_chat_template([{"role": "user", "content": c}],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=True)["input_ids"]) for c in chats]


def probe_prompts_and_reference():
    """The prompt token ids of the 16 probe chats (``PROBE_CHATS``) and transformers' float32
    SmolLM2, the reference every logprob table is measured against."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.model_files import resolve_model

    src = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file,
                                              dtype=torch.float32).eval()
    return chat_prompts(PROBE_CHATS), hf


def hf_first_logprobs(model, prompts: list[list[int]]) -> list:
    """transformers' log_softmax at the last prompt position, float32 ``[V]`` per prompt (the
    logits in the model's dtype, as transformers returns them, then widened)."""
    import torch
    with torch.inference_mode():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0, -1].float(), dim=-1)
                for p in prompts]


def our_first_logprobs(address: str, prompts: list[list[int]]) -> list[list[tuple[int, float]]]:
    """The stack at ``address``'s top ``TOP`` (token id, logprob) of each prompt's first
    greedy step."""
    from pagedserve_client import Client

    with Client(address) as c:
        return [[(t.token_id, t.logprob) for t in
                 c.generate(prompt_token_ids=p, temperature=0, max_tokens=1,
                            logprobs=TOP).logprobs[0].top] for p in prompts]


def mean_distance(tops: list[list[tuple[int, float]]], reference: list) -> float:
    """Mean |logprob - reference logprob| over each prompt's top tokens."""
    diffs = [abs(lp - ref[t].item()) for top, ref in zip(tops, reference, strict=True)
             for t, lp in top]
    return sum(diffs) / len(diffs)


def run_ours(model, token_ids: list[int], block_size: int = 16):
    """Logits ``[T, V]`` (a torch tensor) of one prompt through our ``model`` in one step, its
    blocks scattered over the cache."""
    import torch

    from services.worker.attention import AttentionMetadata

    cfg = model.config
    num_tokens = len(token_ids)
    num_blocks = -(-num_tokens // block_size)
    shape = (4 * num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    embed = model.embed_tokens  # (a GGUF's stored table has no float weight: its dtype)
    dtype = embed.dtype if hasattr(embed, "dtype") else embed.weight.dtype
    caches = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
              for _ in range(cfg.num_hidden_layers)]
    block_table = torch.randperm(4 * num_blocks)[:num_blocks].to(torch.int32)[None]  # [1, nb]
    positions = torch.arange(num_tokens)
    meta = AttentionMetadata(
        slot_mapping=block_table[0, positions // block_size].long() * block_size
        + positions % block_size,
        block_tables=block_table,
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        max_query_len=num_tokens, max_seq_len=num_tokens)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(token_ids), positions, caches,
                                          [meta] * len(caches)))
