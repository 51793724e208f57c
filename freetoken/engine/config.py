"""EngineConfig: what the engine is asked for, and the resolved values it runs with."""

from __future__ import annotations

import dataclasses

from freetoken.moe.config import MoeConfig


LM_HEAD_DTYPES = ("auto", "int8")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"             # "cpu", "cuda", "cuda:N"
    dtype: str = "auto"             # auto = the checkpoint's dtype
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    block_size: int = 16
    kv_cache_tokens: int | None = None  # None: sized from free memory (see model_runner)
    gpu_memory_utilization: float = 0.90
    cpu_kv_cache_gb: float = 4.0    # cap for the KV cache on the CPU
    skip_tokenizer_init: bool = False
    kernel_backend: str = "auto"    # auto | triton | reference
    moe: MoeConfig = dataclasses.field(default_factory=MoeConfig)   # where experts live and run
    # Hybrid linear-attention models: requests that can hold a state slot at once. None: sized
    # from memory (model_runner), at most AUTO_STATE_SLOTS.
    max_state_slots: int | None = None
    # A CPU engine replays its decode steps as one native program (engine/cpu_graph.py, a
    # CUDA graph's role); True runs the modules every step (vLLM's name).
    enforce_eager: bool = False
    # A CPU engine's output layer: "auto" as the checkpoint has it; "int8" read in 8 bits
    # with a scale a row (Linear.pack_cpu_int8: half a 16-bit head's bytes at every decode
    # step, as llama.cpp's q8_0 makes it 8-bit, there in blocks of 32; lossy, so opt-in).
    lm_head_dtype: str = "auto"

    def __post_init__(self):
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError("block_size must be one of 8, 16, 32, 64, 128")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens must be at least one block ({self.block_size})")
        if not 0.05 <= self.gpu_memory_utilization <= 0.99:
            raise ValueError("gpu_memory_utilization must be in [0.05, 0.99]")
        if self.max_state_slots is not None and self.max_state_slots < 1:
            raise ValueError("max_state_slots must be positive")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.lm_head_dtype not in LM_HEAD_DTYPES:
            raise ValueError(f"lm_head_dtype must be one of {', '.join(LM_HEAD_DTYPES)}, got "
                             f"{self.lm_head_dtype!r}")
        if self.lm_head_dtype != "auto" and self.device != "cpu":
            raise ValueError(f"lm_head_dtype {self.lm_head_dtype} is for the CPU engine "
                             f"(device cpu: --device cpu), got device {self.device}")
        if not isinstance(self.moe, MoeConfig):
            raise ValueError(f"moe must be a MoeConfig, got {type(self.moe).__name__}")
