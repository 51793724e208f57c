"""The frozen workload manifest (bench/workloads/manifest.json), its fixtures and their hashes.

A workload turns into requests here: `conversation(workload, n)` gives the ordered request
bodies that conversation number n sends (one for a chat, one per assistant turn for a pinned
multi-turn fixture). A text fixture is used as written, less the one newline that ends the
file. Nothing here talks to a server.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from pathlib import Path

DEFAULT_MANIFEST = Path(__file__).resolve().parents[1] / "workloads" / "manifest.json"
APIS = ("chat", "completions")


class ManifestError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class PromptClass:
    """The prompt lengths, in the server's tokens, that belong to a workload's class."""
    target: int
    min: int
    max: int

    def contains(self, n: int) -> bool:
        return self.min <= n <= self.max


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    cls: str
    description: str
    api: str
    fixture_path: Path
    fixture_sha256: str
    unique_prefix: str
    chat_template_kwargs: dict
    sampling: dict
    ignore_eos: bool
    prompt_classes: tuple[PromptClass, ...]     # one per turn
    output_tokens: int
    output_tolerance: int
    concurrency: tuple[int, ...]
    spec: dict                                  # the manifest's entry, as written

    @property
    def num_turns(self) -> int:
        return len(self.prompt_classes)


@dataclasses.dataclass(frozen=True)
class Manifest:
    path: Path
    version: int
    sha256: str
    warmups: int
    measured: int
    sessions: int
    order: str
    workloads: dict[str, Workload]

    @property
    def is_default(self) -> bool:
        return self.path.resolve() == DEFAULT_MANIFEST.resolve()


def sha256_file(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load_manifest(path: str | Path | None = None) -> Manifest:
    path = Path(path or DEFAULT_MANIFEST)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ManifestError(f"cannot read the manifest {path}: {e}") from None
    proto = _need(raw, "protocol", dict, "manifest")
    workloads = {name: _workload(name, spec, path.parent)
                 for name, spec in _need(raw, "workloads", dict, "manifest").items()}
    return Manifest(path=path, version=_need(raw, "manifest_version", int, "manifest"),
                    sha256=sha256_file(path), warmups=_need(proto, "warmups", int, "protocol"),
                    measured=_need(proto, "measured", int, "protocol"),
                    sessions=_need(proto, "sessions", int, "protocol"),
                    order=_need(proto, "order", str, "protocol"), workloads=workloads)


def _need(obj: dict, key: str, kind, where: str):
    value = obj.get(key)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise ManifestError(f"{where}: '{key}' must be a {kind.__name__}, got {value!r}")
    return value


def _workload(name: str, spec: dict, root: Path) -> Workload:
    where = f"workload {name}"
    api = _need(spec, "api", str, where)
    if api not in APIS:
        raise ManifestError(f"{where}: api must be one of {APIS}, got {api!r}")
    fixture = _need(spec, "fixture", dict, where)
    prompt = _need(spec, "prompt_tokens", dict, where)
    turns = prompt.get("per_turn", [prompt])
    classes = tuple(PromptClass(_need(t, "target", int, where), _need(t, "min", int, where),
                                _need(t, "max", int, where)) for t in turns)
    output = _need(spec, "output_tokens", dict, where)
    concurrency = tuple(_need(spec, "concurrency", list, where))
    if not concurrency or not all(isinstance(c, int) and c >= 1 for c in concurrency):
        raise ManifestError(f"{where}: concurrency must be a list of positive integers")
    if len(classes) > 1 and api != "chat":
        raise ManifestError(f"{where}: multi-turn workloads use the chat API")
    template = spec.get("chat_template", {})
    return Workload(
        name=name, cls=_need(spec, "class", str, where), description=spec.get("description", ""),
        api=api, fixture_path=root / _need(fixture, "path", str, where),
        fixture_sha256=_need(fixture, "sha256", str, where),
        unique_prefix=spec.get("unique_prefix", ""), chat_template_kwargs=template.get("kwargs", {}),
        sampling=_need(spec, "sampling", dict, where), ignore_eos=_need(spec, "ignore_eos", bool, where),
        prompt_classes=classes, output_tokens=_need(output, "count", int, where),
        output_tolerance=output.get("tolerance", 0), concurrency=concurrency, spec=spec)


def fixture_problem(w: Workload) -> str | None:
    """Why the fixture cannot be used as pinned, or None."""
    if not w.fixture_path.is_file():
        return f"fixture {w.fixture_path} is missing"
    actual = sha256_file(w.fixture_path)
    if actual != w.fixture_sha256:
        return f"fixture {w.fixture_path.name} has sha256 {actual}, the manifest pins {w.fixture_sha256}"
    return None


def conversation(w: Workload, n: int) -> list[dict]:
    """The request bodies conversation number n sends, in order (model and stream left out)."""
    prefix = w.unique_prefix.format(n=n)
    common = {"max_tokens": w.output_tokens, "ignore_eos": w.ignore_eos, **w.sampling}
    if w.fixture_path.suffix != ".json":
        text = prefix + w.fixture_path.read_text().removesuffix("\n")
        if w.api == "completions":
            return [{"prompt": text, **common}]
        return [_chat_body([{"role": "user", "content": text}], None, w, common)]
    fixture = json.loads(w.fixture_path.read_text())
    messages = copy.deepcopy(fixture["messages"])
    messages[0]["content"] = prefix + messages[0]["content"]
    cuts = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if messages[-1]["role"] != "assistant":
        cuts.append(len(messages))
    if len(cuts) != w.num_turns:
        raise ManifestError(f"workload {w.name}: the fixture makes {len(cuts)} requests, "
                            f"prompt_tokens.per_turn has {w.num_turns}")
    return [_chat_body(messages[:i], fixture.get("tools"), w, common) for i in cuts]


def _chat_body(messages: list[dict], tools, w: Workload, common: dict) -> dict:
    body = {"messages": messages, **common}
    if tools:
        body["tools"] = tools
    if w.chat_template_kwargs:
        body["chat_template_kwargs"] = w.chat_template_kwargs
    return body
