"""ServerConfig: what `ft serve` listens on and how it answers, frozen and validated."""

from __future__ import annotations

import dataclasses

from freetoken.server.model_meta import PARSER_CHOICES
from freetoken.server.toolcalls import TOOL_PARSER_CHOICES


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 1919
    served_model_name: str = ""
    model_path: str = ""
    api_key: str | None = None
    max_body_bytes: int = 32 * 2**20
    shutdown_timeout_s: float = 10.0
    ping_interval_s: float = 15.0
    # torch CPU threads; None = all cores but one, which is left to the event loop's I/O and
    # to local clients (on 2 cores, two busy-waiting OpenMP threads halve streaming speed).
    cpu_threads: int | None = None
    # How model output is split into reasoning and answer: "auto" (the model family's
    # markers, when its chat template uses them), "off", or a family name (model_meta.py).
    reasoning_parser: str = "auto"
    # How tool calls are read out of the answer: "auto" (from the model type and the markers
    # its chat template writes) or a parser name (toolcalls.TOOL_PARSERS, vLLM's names).
    tool_call_parser: str = "auto"
    allowed_origins: tuple[str, ...] = ()   # CORS (--allowed-origins); "*": any origin

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be positive")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError("shutdown_timeout_s must be >= 0")
        if not self.ping_interval_s > 0:
            raise ValueError("ping_interval_s must be positive")
        if self.reasoning_parser not in PARSER_CHOICES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(PARSER_CHOICES)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSER_CHOICES)}, "
                             f"got {self.tool_call_parser!r}")
