"""Router text tests, and the tokenizers they share.

``smollm2_tokenizer()`` is the default model's real tokenizer (byte-level BPE; converted from
the GGUF once, then loaded from pagedserve's cache). The tiny tokenizers are built in memory:
``tiny_bos_tokenizer()`` adds a BOS by default (Llama style) and has a chat template that writes
``{{ bos_token }}``; ``tiny_sentencepiece_tokenizer()`` is Llama-2 style (Metaspace, byte
fallback: characters outside its vocabulary become ``<0xXX>`` byte tokens).
"""

from __future__ import annotations

import functools

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from services.router.tokenizer import load_tokenizer

SMOLLM2_VOCAB_SIZE = 49152
# Text whose characters take 2, 3 and 4 UTF-8 bytes, split across byte-level tokens.
MULTIBYTE_TEXT = "café naïve Zürich ñandú € 中文字符 日本語 한국어 😀🎉👍🏽 ﬁ Ω ∑ — “quotes”"


@functools.cache
def smollm2_tokenizer() -> PreTrainedTokenizerFast:
    return load_tokenizer(None)


@functools.cache
def tiny_bos_tokenizer() -> PreTrainedTokenizerFast:
    words = ["<unk>", "<s>", "</s>", "hello", "world", "[user]", "[assistant]", "[system]", "hi"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template=("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} "
                       "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}"))


@functools.cache
def tiny_sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", *"abcdefghijklmnopqrstuvwxyzHT,.!?", "▁t", "▁the", "▁a", "he", "ll", "llo"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("l", "l"), ("ll", "o")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = None
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
