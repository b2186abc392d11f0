"""Load a model's HF fast tokenizer (the router's for text, the worker's for grammars).

A transformers folder loads through ``AutoTokenizer``. A GGUF file carries its tokenizer in its
metadata: transformers converts it (``AutoTokenizer.from_pretrained(folder, gguf_file=name)``)
once, and ``save_pretrained`` writes the result to ``source.cache_dir("tokenizer")``; later
starts load that folder (router and worker share it). SmolLM2, measured here: ~20 s the first
time (child start included), ~0.4 s from the cache.

NOTE: transformers' GGUF reader needs torch (``load_gguf_checkpoint`` raises ImportError
without it), and the router must not import torch. So the one-time conversion runs in a child
Python process; the router process only ever loads the converted folder, which needs neither
torch nor gguf. (A torch-less router image therefore needs the cache filled beforehand.)
``AutoTokenizer`` itself imports torch whenever torch is installed, so transformers folders
load it in the router process of a dev install; an image without torch is unaffected.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from services.common.model_files import (
    ModelSource,
    check_tokenizer_files,
    resolve_model,
    tokenizer_files,
)
from services.common.progress import startup_step

_CONVERT_TIMEOUT_S = 600
_NO_TOKENIZER_EXIT = 3  # the child's exit code for a GGUF file without a tokenizer
_CONVERT_SCRIPT = (
    "import os, sys\n"
    "import gguf\n"
    "fields = gguf.GGUFReader(os.path.join(sys.argv[1], sys.argv[2])).fields\n"
    f"if 'tokenizer.ggml.tokens' not in fields: sys.exit({_NO_TOKENIZER_EXIT})\n"
    "from transformers import AutoTokenizer\n"
    "tok = AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2])\n"
    "tok.save_pretrained(sys.argv[3])\n"
)


def load_tokenizer(model: str | None, chat_template: str | None = None,
                   ) -> PreTrainedTokenizerFast:
    """Load the tokenizer of ``--model`` (None or "" is the packaged default, SmolLM2).

    Args:
        chat_template: ``--chat-template``: a Jinja template file, or the template text itself
            (vLLM's rule: a value that is not a file but has a ``{`` or a newline is the
            template), used instead of the model's own (e.g. for a base model that has none).

    Raises:
        FileNotFoundError: no such model (see ``resolve_model``), or a model without a
            tokenizer: a folder without tokenizer files (``check_tokenizer_files``), a GGUF
            file without tokenizer metadata.
        RuntimeError: the GGUF conversion failed (the child's error output is in the message).
        subprocess.TimeoutExpired: the conversion took over 600 s.
        ValueError: the folder only has a slow (pure-Python) tokenizer, or one that needs
            sentencepiece / tiktoken to be converted.
    """
    template = read_chat_template(chat_template) if chat_template else None
    source = resolve_model(model)
    if source.is_gguf:
        cache = source.cache_dir("tokenizer")
        if not cache.is_dir():
            with startup_step(f"converting the tokenizer of {source.name}", detail="once"):
                install_atomically(cache, lambda tmp: _convert_gguf(source, tmp))
        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(cache))
    else:
        check_tokenizer_files(source.path)
        from transformers import AutoTokenizer  # imports torch when it is installed

        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path)
        except (ValueError, ImportError) as e:  # a slow tokenizer that cannot be converted
            if not re.search("sentencepiece|tiktoken", str(e), re.IGNORECASE):
                raise
            raise ValueError(
                f"--model folder {source.path} has no tokenizer.json, and its "
                f"{', '.join(tokenizer_files(source.path))} needs the sentencepiece (or "
                "tiktoken) package to be converted: install it, or save the tokenizer as "
                "tokenizer.json (tokenizer.save_pretrained(folder) with a fast tokenizer)"
            ) from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"{source.path}: no fast tokenizer (tokenizer.json) found, got "
                         f"{type(tokenizer).__name__}")
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def read_chat_template(value: str) -> str:
    """The text of a ``--chat-template`` value: the file's contents, or ``value`` itself when it
    is not a file but looks like a template (has ``{`` or a newline), as vLLM reads it.

    Raises:
        FileNotFoundError: neither a file nor template text (naming ``--chat-template``).
    """
    if os.path.isfile(value):
        return Path(value).read_text()
    if "{" in value or "\n" in value:
        return value
    raise FileNotFoundError(f"--chat-template {value!r}: no such file (pass a Jinja template "
                            "file, or the template text itself)")


def install_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Create the folder ``target`` by calling ``fill(tmp)`` on an empty temporary folder next
    to it, then renaming it into place, so no reader ever sees a half-written ``target``.

    If another process installed ``target`` first, its copy is kept and ours is dropped.

    Raises:
        Whatever ``fill`` raises (the temporary folder is removed).
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like its parent
        fill(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(source: ModelSource, out_dir: Path) -> None:
    """Convert the GGUF tokenizer into ``out_dir`` (tokenizer.json + config) in a child process."""
    assert source.gguf_file is not None  # called for GGUF sources only
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT_SCRIPT, source.folder, source.gguf_file, str(out_dir)],
        capture_output=True, text=True, timeout=_CONVERT_TIMEOUT_S)
    if proc.returncode == _NO_TOKENIZER_EXIT:
        raise FileNotFoundError(
            f"--model {source.path} has no tokenizer: the GGUF file lacks the tokenizer.ggml.* "
            "metadata (tokens, merges); use a GGUF converted with its tokenizer, or a "
            "transformers folder with tokenizer.json")
    if proc.returncode != 0 or not (out_dir / "tokenizer.json").is_file():
        raise RuntimeError(f"converting the tokenizer of {source.path} failed "
                           f"(exit {proc.returncode}): {proc.stderr[-2000:]}")
