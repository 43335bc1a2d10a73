"""Sampling settings as the app edits them, Qwen's recommended presets, and the user's keymap."""
from __future__ import annotations

import json
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 20
    min_p: float = 0.0
    presence_penalty: float = 1.5
    max_tokens: int = 32768
    seed: int | None = None

    def check(self) -> str | None:
        """The first invalid field as one line, or None (the same bounds as the engine's)."""
        if self.temperature < 0:
            return "temperature must be >= 0 (0 = greedy)"
        if not 0 < self.top_p <= 1:
            return "top_p must be in (0, 1]"
        if self.top_k < 0:
            return "top_k must be >= 0 (0 turns it off)"
        if not 0 <= self.min_p < 1:
            return "min_p must be in [0, 1)"
        if self.max_tokens < 1:
            return "max tokens must be >= 1"
        return None

    def to_params(self, stop_token_ids=None):
        from mtpchat.engine.sampling import SamplingParams   # pulls in torch: only in the worker
        return SamplingParams(**asdict(self), stop_token_ids=stop_token_ids)

    def summary(self) -> str:
        if self.temperature == 0:
            return "greedy"
        return f"T {self.temperature:g} · top-p {self.top_p:g} · top-k {self.top_k} · presence {self.presence_penalty:g}"


# Qwen3.5/3.6 model card recommendations
PRESETS: dict[str, Sampling] = {
    "thinking · general": Sampling(1.0, 0.95, 20, 0.0, 1.5),
    "thinking · precise coding": Sampling(0.6, 0.95, 20, 0.0, 0.0),
    "instruct · general": Sampling(0.7, 0.8, 20, 0.0, 1.5),
    "instruct · reasoning": Sampling(1.0, 1.0, 40, 0.0, 2.0),
    "greedy": Sampling(0.0, 1.0, 0, 0.0, 0.0),
}


def initial_sampling(opts, folder: Path | None) -> Sampling:
    """The same rule as `mtpchat run`: a value the user set, else the checkpoint's
    generation_config.json, else off (temperature 0 = greedy). Presets are one key away."""
    gen = {}
    if folder is not None and (Path(folder) / "generation_config.json").exists():
        try:
            gen = json.loads((Path(folder) / "generation_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            gen = {}
    pick = lambda name, off: next((v for v in (getattr(opts, name, None), gen.get(name)) if v is not None), off)
    return Sampling(temperature=float(pick("temperature", 0.0)), top_p=float(pick("top_p", 1.0)),
                    top_k=int(pick("top_k", 0)), min_p=float(getattr(opts, "min_p", None) or 0.0),
                    presence_penalty=float(getattr(opts, "presence_penalty", None) or 0.0),
                    max_tokens=int(getattr(opts, "max_tokens", None) or 2048), seed=getattr(opts, "seed", None))


def load_keymap(path: Path) -> tuple[dict[str, str], str | None]:
    """keymap.toml (`binding_id = "keys"` lines) -> (keymap, error line or None)."""
    if not path.exists():
        return {}, None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return {}, f"{path}: not valid TOML ({exc}); using the default keys"
    data = data.get("keys", data)
    bad = [k for k, v in data.items() if not isinstance(v, str)]
    if bad:
        return {}, f"{path}: {bad[0]} must be a string of keys like \"ctrl+t\"; using the default keys"
    return dict(data), None
