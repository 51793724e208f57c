"""The transformers baseline, in-process: the same request bodies through the checkpoint's own
chat template and `model.generate`, one request at a time, every token stamped by a streamer.

With `offload` (GPU only) the model loads with accelerate's device_map="auto", the usual way
to run a model bigger than the GPU with transformers; accelerate is optional, so its absence
is detected and reported (ARM_UNSUPPORTED) rather than failing mid-run. Timing starts before
the chat template is applied, as a server's TTFT includes its tokenization.
"""

from __future__ import annotations

import importlib.util
import time

from bench.harness import provenance
from bench.harness.client import StreamResult
from bench.harness.validity import Reason


class _Stamps:
    """A generate() streamer: the first put() is the prompt, each later one new token(s)."""

    def __init__(self):
        self.times: list[float] = []
        self.num_tokens = 0
        self.seen_prompt = False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter())
        self.num_tokens += value.numel()

    def end(self) -> None:
        pass


class TransformersArm:
    kind = "transformers"

    def __init__(self, name: str, model_path: str, device: str = "cpu", dtype: str = "auto",
                 offload: bool = False):
        self.name, self.model_path, self.device, self.dtype, self.offload = name, model_path, device, dtype, offload
        self.model = self.tokenizer = None

    def describe(self) -> dict:
        return {"kind": self.kind, "model_path": self.model_path, "device": self.device,
                "dtype": self.dtype, "offload": self.offload}

    def preflight(self) -> list[Reason]:
        if importlib.util.find_spec("transformers") is None:
            return [Reason("ARM_UNSUPPORTED", "transformers is not installed", arm=self.name)]
        if self.offload and importlib.util.find_spec("accelerate") is None:
            return [Reason("ARM_UNSUPPORTED", "offload needs accelerate, which is not installed "
                           "(pip install accelerate)", arm=self.name)]
        if self.offload and not self.device.startswith("cuda"):
            return [Reason("ARM_UNSUPPORTED", "offload is a GPU arm: give a cuda device", arm=self.name)]
        if self.device.startswith("cuda"):
            import torch
            if not torch.cuda.is_available():
                return [Reason("ARM_UNSUPPORTED", f"device {self.device}: no CUDA device", arm=self.name)]
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        except (OSError, ValueError) as e:
            return [Reason("ARM_UNSUPPORTED", f"cannot load the tokenizer of {self.model_path}: {e}",
                           arm=self.name)]
        return []

    def supports(self, workload, concurrency: int) -> str | None:
        if concurrency > 1:
            return f"the in-process transformers arm runs one request at a time, not {concurrency}"
        return None

    def provenance(self, harness: dict) -> dict:
        sha = provenance.model_config_sha256(self.model_path)
        versions = {p: provenance.version(p) for p in ("torch", "transformers", "accelerate", "triton")}
        record = {"kind": self.kind, **self.describe(), "model": {"path": self.model_path, "config_sha256": sha},
                  "versions": versions, "accelerate_available": versions["accelerate"] is not None,
                  "device": {"type": self.device.split(":")[0], "gpu": self._gpu(harness)}}
        missing = [] if sha else [f"model.config_sha256 ({self.model_path}/config.json not readable)"]
        if self.device.startswith("cuda"):
            missing += [f"gpu.{k}" for k in ("name", "uuid", "driver") if not (record["device"]["gpu"] or {}).get(k)]
        record["missing"] = missing
        return record

    def _gpu(self, harness: dict) -> dict | None:
        if not self.device.startswith("cuda"):
            return None
        import torch
        props = torch.cuda.get_device_properties(torch.device(self.device))
        uuid = str(getattr(props, "uuid", "")) or None
        local = provenance.gpu_by_uuid(uuid, harness.get("gpus")) or {}
        return {"name": props.name, "uuid": uuid, "driver": local.get("driver")}

    def config_snapshot(self) -> dict:
        return {**self.describe(), "config_sha256": provenance.model_config_sha256(self.model_path),
                "versions": {p: provenance.version(p) for p in ("torch", "transformers", "accelerate")}}

    def open(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        dtype = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        if self.offload:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype, device_map="auto")
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(self.device)
        self.model.eval()

    def close(self) -> None:
        self.model = None

    def _input_ids(self, api: str, body: dict):
        if api == "chat":
            enc = self.tokenizer.apply_chat_template(
                body["messages"], tools=body.get("tools"), add_generation_prompt=True, return_dict=True,
                return_tensors="pt", **body.get("chat_template_kwargs", {}))
            return enc["input_ids"]
        return self.tokenizer(body["prompt"], return_tensors="pt")["input_ids"]

    async def count_prompt(self, api: str, body: dict, timeout: float) -> StreamResult:
        r = StreamResult(t_start=time.perf_counter(), t_start_unix=time.time())
        r.prompt_tokens, r.completion_tokens, r.finish_reason = self._input_ids(api, body).shape[1], 1, "length"
        return r

    async def generate(self, api: str, body: dict, timeout: float) -> StreamResult:
        import torch

        r = StreamResult(t_start=time.perf_counter(), t_start_unix=time.time())
        ids = self._input_ids(api, body).to(self.model.device)
        n = body["max_tokens"]
        kwargs = {"max_new_tokens": n, "min_new_tokens": n if body.get("ignore_eos") else None}
        if body.get("temperature", 1.0) > 0:
            kwargs.update(do_sample=True, temperature=body["temperature"], top_p=body.get("top_p", 1.0))
            if body.get("seed") is not None:
                torch.manual_seed(body["seed"])
        else:
            kwargs["do_sample"] = False
        stamps = _Stamps()
        with torch.inference_mode():
            self.model.generate(ids, attention_mask=torch.ones_like(ids), streamer=stamps, **kwargs)
        r.t_end = time.perf_counter()
        r.event_times, r.http_status = stamps.times, 200
        r.prompt_tokens, r.completion_tokens = ids.shape[1], stamps.num_tokens
        r.finish_reason = "length" if stamps.num_tokens >= n else "stop"
        return r
