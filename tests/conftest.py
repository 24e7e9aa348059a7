"""Shared fixtures: tiny GGUF models (built with the gguf package) and a verifier on 127.0.0.1:0."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny_gguf import write_tiny_llama  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true", help="skip tests marked slow (real models, vLLM)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--fast"):
        skip = pytest.mark.skip(reason="--fast: slow tests skipped")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """target, a blurred draft of it (same tokenizer), and a model with a different tokenizer."""
    d = tmp_path_factory.mktemp("gguf")
    return {
        "target": write_tiny_llama(d / "target.gguf", seed=0),
        "draft": write_tiny_llama(d / "draft.gguf", seed=1, base_seed=0, noise=0.5),
        "other_vocab": write_tiny_llama(d / "other.gguf", seed=0, vocab_variant=1),
    }
