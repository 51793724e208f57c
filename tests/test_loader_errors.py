"""Bad checkpoints and bad prompts fail with a clear error, never a crash or a hang."""

import json
import shutil

import pytest
import torch

from freetoken import LLM, SamplingParams
from freetoken.models.loader import CheckpointError, resolve_model_path
from freetoken.models.config import ModelConfigError
from freetoken.models.registry import UnsupportedModelError
from freetoken.scheduler.core import RequestError
from hf_checkpoints import cached_checkpoint, make_hf_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return cached_checkpoint(str(tmp_path_factory.mktemp("hf")), "qwen3_moe", "gqa_norm_topk")


@pytest.fixture
def copy_of(good, tmp_path):
    def make():
        dst = tmp_path / "ckpt"
        shutil.copytree(good, dst)
        return dst
    return make


def test_missing_config(copy_of):
    d = copy_of()
    (d / "config.json").unlink()
    with pytest.raises(ModelConfigError, match="no config.json"):
        LLM(str(d), skip_tokenizer_init=True)


def test_unknown_family_lists_supported(copy_of):
    d = copy_of()
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        LLM(str(d), skip_tokenizer_init=True)
    for name in ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "GPT2LMHeadModel"):
        assert name in str(e.value)


def test_truncated_safetensors(copy_of):
    d = copy_of()
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(d), skip_tokenizer_init=True)


def test_corrupt_header(copy_of):
    d = copy_of()
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:40] = b"\xff" * 32
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        LLM(str(d), skip_tokenizer_init=True)


def test_header_that_lies_about_offsets(copy_of):
    """A well-formed header whose offsets point past the data (or overlap) is refused at load,
    naming the file: the tensors are read at startup, never lazily while serving."""
    d = copy_of()
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    start, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [start, end + 10 ** 9]          # far past the file's end
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLM(str(d), skip_tokenizer_init=True)


def test_sharded_checkpoint_and_absent_shard(tmp_path):
    d = tmp_path / "sharded"
    from hf_checkpoints import hf_classes, BASE, FAMILY_BASE, VARIANTS, redraw_weights
    cfg_cls, model_cls = hf_classes("mixtral")
    model = model_cls(cfg_cls(**BASE, **FAMILY_BASE["mixtral"], **VARIANTS["mixtral"]["gqa"]))
    redraw_weights(model, 0)
    model.save_pretrained(d, max_shard_size="100KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    llm = LLM(str(d), skip_tokenizer_init=True)
    with torch.no_grad():
        ref = model(torch.tensor([[1, 2, 3, 4]])).logits[0]
    assert ((llm.logits([1, 2, 3, 4]) - ref).abs().max() / ref.abs().max()) < 1e-4

    (d / shards[1]).unlink()
    with pytest.raises(CheckpointError, match=shards[1]):
        LLM(str(d), skip_tokenizer_init=True)


def test_missing_tensor_named(copy_of):
    from safetensors.torch import load_file, save_file
    d = copy_of()
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks 1 tensors.*experts.3"):
        LLM(str(d), skip_tokenizer_init=True)


def test_shape_mismatch(copy_of):
    d = copy_of()
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 40
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((CheckpointError, ValueError), match="shape"):
        LLM(str(d), skip_tokenizer_init=True)


def test_not_found_and_uncached_hub_id(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with pytest.raises(CheckpointError, match="nobody-here/no-such-model"):
        resolve_model_path("nobody-here/no-such-model")
    with pytest.raises(CheckpointError, match="there is no folder"):
        resolve_model_path(str(tmp_path / "absent" / "deeper" / "x"))


def test_bad_prompts_leave_engine_usable(good):
    llm = LLM(str(good), skip_tokenizer_init=True, max_model_len=64)
    with pytest.raises(RequestError, match="context"):
        llm.generate([[1] * 70], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="max_tokens"):
        llm.generate([[1] * 60], SamplingParams(max_tokens=10))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.generate([[1, 2, 320]], SamplingParams(max_tokens=4))
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.logits([-1, 2])
    with pytest.raises(RequestError, match="empty"):
        llm.generate([[]], SamplingParams(max_tokens=4))
    # Nothing leaked: every KV block is free and a good request still runs.
    assert llm.runner.allocator.num_free == llm.runner.allocator.num_blocks
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4


def test_model_larger_than_memory_is_refused(copy_of, monkeypatch):
    import freetoken.models.loader as loader
    monkeypatch.setattr(loader, "_available_bytes", lambda device: 1000)
    with pytest.raises(CheckpointError, match="GiB free"):
        LLM(str(copy_of()), skip_tokenizer_init=True)


def test_bad_sampling_params():
    for kwargs, param in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                          ({"max_tokens": 0}, "max_tokens"), ({"top_k": -5}, "top_k"),
                          ({"min_p": 2}, "min_p"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
                          ({"logprobs": 50}, "logprobs")]:
        with pytest.raises(ValueError, match=param) as e:
            SamplingParams(**kwargs)
        assert e.value.param == param
