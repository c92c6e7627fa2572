"""jaxserve: a JAX/XLA LLM inference server.

`from jaxserve import LLM, SamplingParams` for offline batch generation. The names are
imported on first use, so `import jaxserve` (the command line) does not start JAX.
"""

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from jaxserve.engine.engine import LLM

        return LLM
    if name == "SamplingParams":
        from jaxserve.engine.sequence import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'jaxserve' has no attribute {name!r}")
