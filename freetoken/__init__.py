"""FreeToken: serve mixture-of-experts models larger than the GPU from one GPU.

The public Python API uses vLLM's names: `LLM`, `SamplingParams`, `llm.generate`,
plus `llm.logits` for scoring. Heavy modules load lazily so `ft --help` is fast.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput"]


def __getattr__(name):
    if name == "LLM":
        from freetoken.llm import LLM
        return LLM
    if name in ("SamplingParams",):
        from freetoken.engine.sampling_params import SamplingParams
        return SamplingParams
    if name == "RequestOutput":
        from freetoken.llm import RequestOutput
        return RequestOutput
    raise AttributeError(name)
