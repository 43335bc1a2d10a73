"""Fixtures for the app tests."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # serve_support, shared with tests/


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "data"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("MTPCHAT_DATA_DIR", raising=False)
