"""Fixtures of the worker tests: tiny random-weight Llamas written by transformers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import make_tiny_llama


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-layer GQA Llama (vocab 512, hidden 64, 4 heads, 2 KV heads), untied LM head."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def one_torch_thread():
    """Run the test with one torch thread (tiny forwards: two threads on a loaded 2-core
    machine are far slower), restoring the count after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
