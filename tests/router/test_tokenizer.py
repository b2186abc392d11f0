"""Tokenizer loading (GGUF conversion cache, transformers folders) and prompt encoding."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from services.common import tokenizer_loading as tokenizer_module
from services.common.model_files import resolve_model
from services.router.tokenizer import (
    encode_chat,
    encode_prompt,
    install_atomically,
    load_tokenizer,
)
from services.router.validation import RequestError
from tests.router import (
    SMOLLM2_VOCAB_SIZE,
    smollm2_tokenizer,
    tiny_bos_tokenizer,
    tiny_sentencepiece_tokenizer,
)

REPO = Path(__file__).resolve().parents[2]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def test_default_model_tokenizer_is_smollm2_and_cached():
    tok = smollm2_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    assert len(tok) == SMOLLM2_VOCAB_SIZE
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    cache = resolve_model(None).cache_dir("tokenizer")
    assert (cache / "tokenizer.json").is_file()
    assert not [p for p in cache.parent.iterdir() if ".tmp-" in p.name]


def test_loading_from_the_cache_is_fast_and_never_imports_torch():
    smollm2_tokenizer()  # the cache exists
    code = ("import sys, time\n"
            "from services.router.tokenizer import load_tokenizer\n"
            "t = time.perf_counter(); tok = load_tokenizer(None)\n"
            "print(time.perf_counter() - t, 'torch' in sys.modules, len(tok))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    seconds, torch_imported, vocab = float(out[0]), out[1], int(out[2])
    assert torch_imported == "False"
    assert vocab == SMOLLM2_VOCAB_SIZE
    assert seconds < 10


def test_transformers_folder_loads_through_auto_tokenizer(tmp_path):
    tiny_bos_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tok = load_tokenizer(str(tmp_path))
    assert tok.encode("hello world") == [1, 3, 4]
    assert tok.chat_template == tiny_bos_tokenizer().chat_template


def test_missing_model_raises():
    with pytest.raises(FileNotFoundError):
        load_tokenizer("/nonexistent/model.gguf")


def test_folder_without_tokenizer_files_names_the_folder_and_the_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text("{}")  # configures, but no vocabulary
    with pytest.raises(FileNotFoundError, match="has no tokenizer") as e:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(e.value)
    assert "tokenizer.json" in str(e.value) and "tokenizer.model" in str(e.value)
    assert "sentencepiece" not in str(e.value)


def test_sentencepiece_file_without_the_package_says_so(tmp_path):
    import importlib.util
    if importlib.util.find_spec("sentencepiece") or importlib.util.find_spec("tiktoken"):
        pytest.skip("a converter package is installed")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(ValueError, match="has no tokenizer.json, and its tokenizer.model "
                                         "needs the sentencepiece"):
        load_tokenizer(str(tmp_path))


def test_gguf_without_tokenizer_metadata_says_so(tmp_path, monkeypatch):
    from tests.helpers import make_tiny_gguf, make_tiny_llama

    make_tiny_llama(tmp_path / "hf")
    gguf = make_tiny_gguf(tmp_path / "no-tokenizer.gguf", tmp_path / "hf")  # stores none
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="has no tokenizer: the GGUF file lacks"):
        load_tokenizer(str(gguf))
    assert not resolve_model(str(gguf)).cache_dir("tokenizer").exists()


def test_failed_conversion_raises_and_leaves_no_cache(tmp_path, monkeypatch):
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tokenizer_module, "_CONVERT_SCRIPT", "import sys; sys.exit('boom')")
    with pytest.raises(RuntimeError, match="boom"):
        load_tokenizer(str(gguf))
    cache = resolve_model(str(gguf)).cache_dir("tokenizer")
    assert not cache.exists() and list(cache.parent.iterdir()) == []


def test_install_atomically(tmp_path):
    target = tmp_path / "a" / "tokenizer"
    install_atomically(target, lambda d: (d / "tokenizer.json").write_text("{}"))
    assert (target / "tokenizer.json").read_text() == "{}"
    # a second install (a concurrent start that lost the race) keeps the first one
    install_atomically(target, lambda d: (d / "tokenizer.json").write_text("second"))
    assert (target / "tokenizer.json").read_text() == "{}"
    assert [p.name for p in target.parent.iterdir()] == ["tokenizer"]


def test_install_atomically_failure_leaves_nothing(tmp_path):
    target = tmp_path / "tokenizer"

    def fill(d: Path) -> None:
        (d / "half.json").write_text("{")
        raise OSError("killed")

    with pytest.raises(OSError, match="killed"):
        install_atomically(target, fill)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_installs_give_one_complete_folder(tmp_path):
    target = tmp_path / "tokenizer"
    seen: list[str] = []

    def fill(d: Path) -> None:
        (d / "tokenizer.json").write_text(threading.current_thread().name)
        time.sleep(0.05)
        (d / "done").write_text("")

    def reader() -> None:  # must never see a half-written folder
        for _ in range(200):
            if target.is_dir():
                seen.append(",".join(sorted(p.name for p in target.iterdir())))
            time.sleep(0.001)

    threads = [threading.Thread(target=install_atomically, args=(target, fill), name=f"t{i}")
               for i in range(4)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(seen) <= {"done,tokenizer.json"}
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer"]


def test_encode_prompt_adds_bos_only_when_the_tokenizer_does():
    assert encode_prompt(smollm2_tokenizer(), "Hello world") == [19556, 905]  # SmolLM2: no BOS
    assert encode_prompt(tiny_bos_tokenizer(), "hello world") == [1, 3, 4]


def test_encode_chat_smollm2_uses_the_template_with_one_bos():
    tok = smollm2_tokenizer()
    ids = encode_chat(tok, CHAT)
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert text.endswith("<|im_start|>assistant\n")
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[0] == tok.bos_token_id and ids[1] != tok.bos_token_id
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)


def test_encode_chat_does_not_double_the_bos():
    tok = tiny_bos_tokenizer()  # adds <s> by default AND its template writes {{ bos_token }}
    ids = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert ids == [1, 5, 8, 6]  # <s> [user] hi [assistant]
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                       add_generation_prompt=True)
    assert tok.encode(rendered)[:2] == [1, 1]  # what the naive way would have sent


@pytest.mark.parametrize("tok, messages, match", [
    (tiny_bos_tokenizer, [], "chat.messages is empty"),
    (tiny_bos_tokenizer, [{"role": "user"}], r"messages\[0\] needs a string role"),
    (tiny_bos_tokenizer, [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "x"}],
     r"messages\[1\]\.role must be one of system, developer, user, assistant, tool, "
     r"function, got 'wizard'"),
    (tiny_sentencepiece_tokenizer, [{"role": "user", "content": "hi"}],
     "no chat template .*--chat-template FILE"),
])
def test_encode_chat_errors(tok, messages, match):
    with pytest.raises(RequestError, match=match) as e:
        encode_chat(tok(), messages)
    assert e.value.code.name == "INVALID_ARGUMENT"


def test_encode_chat_template_exception_is_invalid_argument():
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tiny_bos_tokenizer().backend_tokenizer,
        chat_template="{% if messages[0]['role'] != 'user' %}"
                      "{{ raise_exception('conversation must start with user') }}{% endif %}x")
    with pytest.raises(RequestError, match="must start with user"):
        encode_chat(tok, [{"role": "assistant", "content": "hi"}])


@pytest.mark.parametrize("as_file", [True, False])
def test_chat_template_flag_gives_a_base_model_a_template(tmp_path, as_file):
    """``--chat-template`` (a file, or the template text itself, as vLLM reads it) renders chat
    for a model without a template of its own."""
    model = tmp_path / "model"
    tiny_sentencepiece_tokenizer().save_pretrained(str(model))
    (model / "config.json").write_text('{"model_type": "llama"}')
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}a:"
    value = template
    if as_file:
        (tmp_path / "chat.jinja").write_text(template)
        value = str(tmp_path / "chat.jinja")
    with pytest.raises(RequestError, match="--chat-template"):
        encode_chat(load_tokenizer(str(model)), [{"role": "user", "content": "hi"}])
    tok = load_tokenizer(str(model), chat_template=value)
    ids = encode_chat(tok, [{"role": "user", "content": "hello"}])
    assert tok.decode(ids) == "user: hello\na:"


def test_chat_template_flag_naming_no_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="--chat-template 'nope.jinja': no such file"):
        load_tokenizer(None, chat_template="nope.jinja")
