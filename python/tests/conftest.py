"""Shared fixtures of the Python tests: paths into ../shared, two threads for torch."""

from pathlib import Path

import pytest
import torch

torch.set_num_threads(2)

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"


def checkpoint(name: str) -> Path:
    """The Hugging Face checkpoint `name` of ../shared/fixtures/llama, or a failure naming it."""
    path = SHARED / "fixtures" / "llama" / name
    if not (path / "config.json").exists():
        pytest.fail(f"the {name} fixture is missing at {path} (../shared beside the checkout)")
    return path


@pytest.fixture(scope="session")
def llama_gqa() -> Path:
    return checkpoint("llama_gqa")


@pytest.fixture(scope="session")
def shakespeare() -> bytes:
    path = SHARED / "data" / "tinyshakespeare.txt"
    if not path.exists():
        pytest.fail(f"tinyshakespeare is missing at {path} (../shared beside the checkout)")
    return path.read_bytes()


@pytest.fixture(scope="session")
def mixtral_moe() -> Path:
    return checkpoint("mixtral_moe")


@pytest.fixture(scope="session")
def oogc_bin() -> Path:
    """The `oogc` binary: $OOGC_BIN, else the workspace's debug build (CI builds it first)."""
    import os

    path = Path(os.environ.get("OOGC_BIN", REPO / "target" / "debug" / "oogc"))
    if not os.access(path, os.X_OK):
        pytest.fail(f"the oogc binary is missing at {path}: build it (cargo build -p oogc-cli) or set OOGC_BIN")
    return path
