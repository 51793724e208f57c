"""KeyMap: how a family's checkpoint keys map onto its modules (the family file's KEY_MAP).

Most keys are the modules' own names (Hugging Face's); a KeyMap renames the rest, lists what a
family knowingly skips, and converts experts stored as fused whole-layer tensors into the
bank's layout.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch

# Keys some checkpoints carry that no forward reads, whatever the family.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.mtp\.)")


def fused_v5(leaf: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """transformers v5's fused layout: experts.gate_up_proj [E, 2I, D] (gate rows, then up),
    experts.down_proj [E, D, I]; None for a leaf it does not know."""
    name = {"gate_up_proj": "w13", "down_proj": "w2"}.get(leaf)
    return None if name is None else {name: tensor}


@dataclasses.dataclass(frozen=True)
class KeyMap:
    """How a family's checkpoint keys map onto its modules (a family's KEY_MAP; this default
    fits checkpoints whose keys are the modules' names).

    renames: (regex, replacement) applied in order to every key first (a prefix such as
      `model.language_model.`, or a module HF names differently from ours);
    skip: regexes of tensors the family knowingly does not use (an MTP head), each listed by
      the family; anything else unexpected is still refused, naming it;
    fused_experts: (leaf, tensor [E, ...]) -> {bank tensor name: tensor in the bank's layout}
      for a layer's experts stored as whole tensors (`...experts.{leaf}`).
    """
    renames: tuple[tuple[str, str], ...] = ()
    skip: tuple[str, ...] = ()
    fused_experts: Callable[[str, torch.Tensor], dict[str, torch.Tensor] | None] = fused_v5

    def rename(self, key: str) -> str:
        for pattern, repl in self.renames:
            key = re.sub(pattern, repl, key)
        return key

    def skipped(self, key: str) -> bool:
        return _IGNORED.search(key) is not None or any(re.search(p, key) for p in self.skip)


DEFAULT_KEY_MAP = KeyMap()
