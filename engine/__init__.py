"""mtpchat's inference engine: Qwen3.5 / Qwen3.6 hybrid models with MTP self-speculative decoding."""

__all__ = ["Engine", "SamplingParams"]


def __getattr__(name):
    # Imported on first use, so that `mtpchat.engine.config` and `.memory` load without torch.
    if name == "Engine":
        from mtpchat.engine.engine import Engine
        return Engine
    if name == "SamplingParams":
        from mtpchat.engine.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
