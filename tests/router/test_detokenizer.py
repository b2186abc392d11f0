"""IncrementalDetokenizer: deltas never split a character and join to the decode of the ids."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.router.detokenizer import IncrementalDetokenizer
from tests.router import (
    MULTIBYTE_TEXT,
    SMOLLM2_VOCAB_SIZE,
    smollm2_tokenizer,
    tiny_sentencepiece_tokenizer,
)


def stream(tokenizer, prompt, output, chunks=1, skip_special_tokens=True):
    """Feed ``output`` in groups of ``chunks`` ids; return the deltas (flush last)."""
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detok.step(output[i:i + chunks]) for i in range(0, len(output), chunks)]
    deltas.append(detok.flush())
    assert detok.text == "".join(deltas)
    return deltas


def check_deltas(deltas, expected):
    assert "".join(deltas) == expected
    for d in deltas:
        d.encode("utf-8")  # valid UTF-8: no lone surrogates
        assert "\ufffd" not in d or "\ufffd" in expected


def multibyte_ids():
    tok = smollm2_tokenizer()
    return sorted(set(tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip=st.booleans(), chunks=st.integers(1, 3))
def test_smollm2_random_ids_join_to_decode(data, skip, chunks):
    tok = smollm2_tokenizer()
    # byte-level pieces (ids 17..251 are single bytes), pieces of multi-byte characters,
    # special tokens (0..16), and anything else in the vocabulary
    ids = st.one_of(st.integers(0, 16), st.integers(17, 251), st.sampled_from(multibyte_ids()),
                    st.integers(0, SMOLLM2_VOCAB_SIZE - 1))
    prompt = tok.encode(data.draw(st.sampled_from(["Hello", "Say: ", "中文", "x 😀"])))
    output = data.draw(st.lists(ids, max_size=30))
    deltas = stream(tok, prompt, output, chunks, skip)
    check_deltas(deltas, tok.decode(output, skip_special_tokens=skip))


def test_smollm2_multibyte_text_comes_out_in_whole_characters():
    tok = smollm2_tokenizer()
    output = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                     add_generation_prompt=True)
    deltas = stream(tok, tok.encode(prompt), output + [tok.eos_token_id])
    check_deltas(deltas, MULTIBYTE_TEXT)
    assert deltas[-1] == ""
    # some tokens complete nothing (a character split across byte tokens)...
    assert "" in deltas[:-1]
    # ...and the emoji is never split: each delta holds whole characters only
    assert any("😀" in d for d in deltas)


def test_special_tokens_kept_when_not_skipped():
    tok = smollm2_tokenizer()
    output = tok.encode("Hi!<|im_end|>", add_special_tokens=False)
    assert "".join(stream(tok, [1], output, skip_special_tokens=False)) == "Hi!<|im_end|>"
    assert "".join(stream(tok, [1], output, skip_special_tokens=True)) == "Hi!"


def test_character_split_between_prompt_and_output_comes_out_whole():
    # NOTE: documented difference from decode(output): like vLLM, the stream is primed with the
    # prompt, so a character whose first bytes are in the prompt is emitted whole.
    tok = smollm2_tokenizer()
    emoji = tok.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1
    prompt = tok.encode("Hello ") + emoji[:1]
    deltas = stream(tok, prompt, emoji[1:] + tok.encode(" there"))
    assert "".join(deltas) == "😀 there"
    assert tok.decode(emoji[1:]).startswith("\ufffd")


def test_incomplete_character_at_the_end_is_flushed_as_decode_shows_it():
    tok = smollm2_tokenizer()
    emoji = tok.encode("😀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, tok.encode("Hi"))
    assert detok.step(tok.encode(" ok")) == " ok"
    assert detok.step(emoji[:-1]) == ""  # held: the character is incomplete
    assert detok.flush() == tok.decode(emoji[:-1]) == "\ufffd"
    assert detok.text == " ok\ufffd"


def test_empty_prompt_and_empty_steps():
    tok = smollm2_tokenizer()
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step([]) == "" and detok.flush() == ""
    assert detok.step(tok.encode("Hello world")) == "Hello world"


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_sentencepiece_byte_fallback_joins_to_decode_in_context(data):
    # Llama-2 style: the decoder strips the first leading space, so a stream primed with the
    # prompt gives the text that follows the prompt's text (vLLM's behaviour).
    tok = tiny_sentencepiece_tokenizer()
    prompt = tok.encode(data.draw(st.sampled_from(["the hello", "Hi, a", "é"])),
                        add_special_tokens=False)
    pool = tok.encode("the hello a café 中 😀 ñ!", add_special_tokens=False)
    output = data.draw(st.lists(st.sampled_from(pool) | st.integers(0, len(tok) - 1),
                                max_size=25))
    deltas = stream(tok, prompt, output)
    full = tok.decode(prompt + output, skip_special_tokens=True)
    if "\ufffd" in full:
        # ByteFallback turns every byte of an invalid run into U+FFFD, including bytes already
        # streamed as valid text: decode is not prefix-stable, so only check the deltas.
        check_deltas(deltas, "".join(deltas))
        assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full
        return
    head = tok.decode(prompt, skip_special_tokens=True)
    assert full.startswith(head)
    check_deltas(deltas, full[len(head):])


def test_sentencepiece_first_word_keeps_its_space():
    tok = tiny_sentencepiece_tokenizer()
    output = tok.encode("hello", add_special_tokens=False)  # "▁", "he", "llo"
    assert tok.decode(output) == "hello"  # decode alone strips the leading space
    assert "".join(stream(tok, tok.encode("the"), output)) == " hello"


def test_non_monotonic_decoder_recovers():
    # A decoder that rewrites earlier text makes DecodeStream raise "Invalid prefix"; like
    # vLLM (issue #17448) the stream restarts instead of failing, here without losing "b".
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2, "<unk>": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("ab", "X")])
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    detok = IncrementalDetokenizer(tok, [])
    assert detok.step([0]) == "a"
    assert detok.step([1]) == ""  # "ab" decodes to "X": not longer than "a", held
    assert detok.step([2]) == "bc"  # decode would say "Xc": documented
    assert detok.step([0, 1, 2]) == "abc" and detok.flush() == ""
