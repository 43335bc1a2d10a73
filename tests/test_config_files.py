"""Files a user or a download can damage or a later version can change: a broken
generation_config.json, the chats database's schema version, and the server settings in
settings.toml."""
import json
import sqlite3
import sys
import types

import pytest

from mtpchat import cli
from mtpchat.app.store import SCHEMA_VERSION, Store
from mtpchat.engine import Engine
from mtpchat.engine.config import ConfigError, GenerationConfig
from mtpchat.errors import UserError
from mtpchat.settings import load_settings
from tools.tiny import write_tiny_checkpoint
from helpers import isolated  # noqa: F401  (autouse: a settings file and a hub cache of the test's own)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("gen"), num_hidden_layers=2)


# ---- generation_config.json ------------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ('{"eos_token_id": [2,', "is not valid JSON"),
    ("\udcff".encode("utf-8", "surrogatepass").decode("latin-1"), "is not valid JSON"),
    ("[1, 2]", "holds a JSON list, not an object"),
])
def test_a_damaged_generation_config_is_named(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_text(text, encoding="latin-1")
    with pytest.raises(ConfigError, match=message) as e:
        GenerationConfig.load(tmp_path)
    assert "generation_config.json" in str(e.value)


def test_run_on_a_damaged_generation_config_says_so(capsys, ckpt, tmp_path):
    import shutil
    copy = shutil.copytree(ckpt, tmp_path / "copy")
    (copy / "generation_config.json").write_text('{"temperature": 0.6,')
    code = cli.main(["run", "--model", str(copy), "--device", "cpu", "--prompt", "hi", "--max-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 1 and "generation_config.json is not valid JSON" in err and "Traceback" not in err
    assert GenerationConfig.load(ckpt).eos_token_ids         # the intact one still reads


# ---- the chats database ----------------------------------------------------------------------------

def version(path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("PRAGMA user_version").fetchone()[0]


def test_a_new_database_carries_the_schema_version(tmp_path):
    store = Store(tmp_path)
    store.close()
    assert SCHEMA_VERSION >= 1 and version(tmp_path / "chats.sqlite3") == SCHEMA_VERSION


def test_a_database_from_before_the_version_keeps_its_chats(tmp_path):
    store = Store(tmp_path)
    sid = store.create_session("kept")
    store.add_message(sid, "user", "hello")
    store.close()
    with sqlite3.connect(tmp_path / "chats.sqlite3") as db:
        db.execute("PRAGMA user_version = 0")            # as a file written before versions were kept
    store = Store(tmp_path)
    assert [m.content for m in store.messages(sid)] == ["hello"]
    store.close()
    assert version(tmp_path / "chats.sqlite3") == SCHEMA_VERSION


def test_a_database_of_a_newer_version_is_refused_and_left_alone(tmp_path):
    Store(tmp_path).close()
    path = tmp_path / "chats.sqlite3"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    before = path.read_bytes()
    with pytest.raises(UserError, match="written by a newer mtpchat .* upgrade mtpchat, or pass --data-dir"):
        Store(tmp_path)
    assert path.read_bytes() == before and version(path) == SCHEMA_VERSION + 1


# ---- server and api_key in settings.toml -------------------------------------------------------------

def settings(tmp_path, text):
    (tmp_path / "settings.toml").write_text(text)     # MTPCHAT_SETTINGS points here (isolated)


def test_server_and_api_key_are_settings(tmp_path):
    settings(tmp_path, 'server = "http://gpu-box:8000"\napi_key = "k1"\n')
    assert load_settings() == {"server": "http://gpu-box:8000", "api_key": "k1"}


def app_args(monkeypatch, argv):
    seen = {}
    app = types.ModuleType("mtpchat.app.main")
    app.run_app = lambda args: seen.setdefault("args", args) and 0
    monkeypatch.setitem(sys.modules, "mtpchat.app.main", app)
    assert cli.main(argv) == 0
    return seen["args"]


def test_the_app_uses_the_settings_server_and_the_flags_win(tmp_path, monkeypatch):
    settings(tmp_path, 'server = "http://gpu-box:8000"\napi_key = "from-file"\n')
    monkeypatch.delenv("MTPCHAT_API_KEY", raising=False)
    args = app_args(monkeypatch, [])
    assert (args.server, args.api_key) == ("http://gpu-box:8000", "from-file")
    args = app_args(monkeypatch, ["--server", "http://other:9000", "--api-key", "from-flag"])
    assert (args.server, args.api_key) == ("http://other:9000", "from-flag")
    monkeypatch.setenv("MTPCHAT_API_KEY", "from-env")
    assert app_args(monkeypatch, []).api_key == "from-env"         # the environment beats the file


def test_run_uses_the_settings_server(tmp_path, monkeypatch, capsys):
    settings(tmp_path, 'server = "http://gpu-box:8000"\n')
    seen = {}
    remote = types.ModuleType("mtpchat.remote.run")
    remote.run_remote = lambda args, options, prompt, key: seen.update(server=args.server, prompt=prompt) or 0
    monkeypatch.setitem(sys.modules, "mtpchat.remote.run", remote)
    assert cli.main(["run", "--prompt", "hi"]) == 0
    assert seen == {"server": "http://gpu-box:8000", "prompt": "hi"}
