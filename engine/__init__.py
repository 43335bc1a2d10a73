"""mtpchat's inference engine: Qwen3.5 / Qwen3.6 hybrid models with MTP self-speculative decoding."""
from mtpchat.engine.sampling import SamplingParams

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name):
    # Engine pulls in the model code; import it on first use so `mtpchat.engine.config` stays light.
    if name == "Engine":
        from mtpchat.engine.engine import Engine
        return Engine
    raise AttributeError(name)
