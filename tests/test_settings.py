"""Settings: the TOML file, its checks, and the order defaults < file < environment < flags."""
import sys
from pathlib import Path

import pytest

from mtpchat import settings
from mtpchat.errors import SettingsError


@pytest.fixture
def file(tmp_path, monkeypatch):
    path = tmp_path / "settings.toml"
    monkeypatch.setenv("MTPCHAT_SETTINGS", str(path))
    monkeypatch.delenv("MTPCHAT_DATA_DIR", raising=False)
    return path


def test_no_file_means_defaults(file):
    assert settings.load_settings() == {}
    opts = settings.merge({}, {})
    # max_context None: the default context, or less where the model or the memory has less (loader.py)
    assert (opts.device, opts.dtype, opts.max_context, opts.draft_tokens, opts.mtp) == ("auto", "auto", None, 3, True)
    assert opts.temperature is None and opts.think is True and opts.model is None


def test_file_values_are_read_and_checked(file):
    file.write_text('model = "Qwen3.5-9B"\nmax_context = 16384\ntemperature = 0.7\nthink = false\n'
                    'device = "CUDA"\ntop_p = 1\n')
    values = settings.load_settings()
    assert values == {"model": "Qwen3.5-9B", "max_context": 16384, "temperature": 0.7, "think": False,
                      "device": "cuda", "top_p": 1.0}


def test_flags_win_over_the_file(file):
    file.write_text('max_context = 16384\ndraft_tokens = 2\nsystem = "be brief"\n')
    opts = settings.merge({"draft_tokens": 4, "unrelated": 1}, settings.load_settings())
    assert opts.draft_tokens == 4 and opts.max_context == 16384 and opts.system == "be brief"


@pytest.mark.parametrize("text, message", [
    ("max_contxt = 10\n", "unknown setting 'max_contxt'; did you mean 'max_context'?"),
    ("zzz = 1\n", "unknown setting 'zzz'; known keys: model, device"),
    ("draft_tokens = 12\n", "draft_tokens = 12 in .*: must be between 1 and 8, got 12"),
    ("mtp = \"yes\"\n", "mtp = 'yes' in .*: must be true or false, got 'yes'"),
    ("temperature = -1\n", "temperature = -1 in .*: must be at least 0.0, got -1.0"),
    ("top_p = 0\n", r"top_p = 0 in .*: must be in \(0.0, 1.0\], got 0.0"),
    ("max_context = 1.5\n", "max_context = 1.5 in .*: must be a whole number, got 1.5"),
    ("device = \"tpu\"\n", "device = 'tpu' in .*: must be one of auto, cpu, cuda, got 'tpu'"),
    ("min_p = 1.0\n", r"min_p = 1.0 in .*: must be in \[0.0, 1.0\), got 1.0"),
    ("model = [1]\n", r"model = \[1\] in .*: must be a string"),
    ("model = \n", "is not valid TOML"),
])
def test_bad_file_values(file, text, message):
    file.write_text(text)
    with pytest.raises(SettingsError, match=message) as e:
        settings.load_settings()
    assert str(file) in str(e.value)


def test_cuda_index_is_a_device(file):
    file.write_text('device = "cuda:1"\n')
    assert settings.load_settings()["device"] == "cuda:1"


def test_data_dir_order(file, monkeypatch, tmp_path):
    file.write_text(f'data_dir = "{tmp_path / "from-file"}"\n')
    values = settings.load_settings()
    assert settings.data_dir(settings.merge({}, values)) == tmp_path / "from-file"
    monkeypatch.setenv("MTPCHAT_DATA_DIR", str(tmp_path / "from-env"))
    assert settings.data_dir(settings.merge({}, values)) == tmp_path / "from-env"
    flag = {"data_dir": str(tmp_path / "from-flag")}
    assert settings.data_dir(settings.merge(flag, values)) == tmp_path / "from-flag"


def test_platform_directories(monkeypatch):
    import platformdirs
    monkeypatch.delenv("MTPCHAT_SETTINGS", raising=False)
    monkeypatch.setattr(platformdirs, "user_config_dir", lambda app, appauthor=None: f"/cfg/{app}")
    monkeypatch.setattr(platformdirs, "user_data_dir", lambda app, appauthor=None: f"/data/{app}")
    assert settings.settings_path() == Path("/cfg/mtpchat/settings.toml")
    assert settings.data_dir(settings.Options()) == Path("/data/mtpchat")


def test_without_platformdirs_the_xdg_defaults_apply(monkeypatch, tmp_path):
    monkeypatch.delenv("MTPCHAT_SETTINGS", raising=False)
    monkeypatch.setitem(sys.modules, "platformdirs", None)   # import fails, as where it is not installed
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    assert settings.settings_path() == tmp_path / "cfg" / "mtpchat" / "settings.toml"
    assert settings.data_dir(settings.Options()) == tmp_path / "data" / "mtpchat"
