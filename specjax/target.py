"""`Target`: a loaded target model (config, params, optional tokenizer)."""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import nnx

from specjax.models import decoder
from specjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
  """What `load_target` returns and `generate` consumes.

  config: static model config (hashable, a jit static argument);
  params: the decoder's `nnx.State` pytree;
  tokenizer: a `tokenizers.Tokenizer` when the checkpoint ships `tokenizer.json`, else None.
  """

  config: ModelConfig
  params: nnx.State
  tokenizer: Any = None

  @classmethod
  def random(cls, config: ModelConfig, seed: int = 0, tokenizer: Any = None) -> Target:
    return cls(config, decoder.init_params(config, seed), tokenizer)

  @property
  def num_params(self) -> int:
    return decoder.num_params(self.params)

  def replace(self, **changes) -> Target:
    return dataclasses.replace(self, **changes)

  def encode(self, text: str) -> list[int]:
    if self.tokenizer is None:
      raise ValueError("this target has no tokenizer: pass token ids instead of text")
    return self.tokenizer.encode(text).ids

  def decode(self, ids) -> str:
    if self.tokenizer is None:
      raise ValueError("this target has no tokenizer")
    return self.tokenizer.decode(list(ids), skip_special_tokens=False)
