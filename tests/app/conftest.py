"""Fixtures for the app tests."""
import pytest


@pytest.fixture
def data_dir(tmp_path):
    return tmp_path / "data"


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    monkeypatch.delenv("MTPCHAT_DATA_DIR", raising=False)
