"""`Target`: a loaded target model (config, params, optional tokenizer, generation defaults)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from specjax import checks, sharding
from specjax.models import decoder
from specjax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
  """The special ids a folder's `generation_config.json` declares.

  transformers' `generate` stops at these ids, not at config.json's, so a loaded target keeps
  them to stop where transformers stops, and `save_hf` writes its bos and pad back.
  """

  eos_token_id: tuple[int, ...] = ()
  bos_token_id: int | None = None
  pad_token_id: int | None = None

  @classmethod
  def from_hf_dict(cls, d: dict[str, Any]) -> GenerationDefaults:
    """Parses a `generation_config.json`; `eos_token_id` may be an int, a list or absent."""
    eos = d.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    ids = {"eos_token_id": eos, "bos_token_id": d.get("bos_token_id"),
           "pad_token_id": d.get("pad_token_id")}
    for name, value in ids.items():
      for v in value if isinstance(value, tuple) else () if value is None else (value,):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
          raise ValueError(f"generation_config.json: {name} must be non-negative ints, "
                           f"got {d.get(name)!r}")
    return cls(**ids)

  def to_hf_dict(self) -> dict[str, Any]:
    d: dict[str, Any] = {"bos_token_id": self.bos_token_id,
                         "eos_token_id": list(self.eos_token_id) or None}
    if self.pad_token_id is not None:
      d["pad_token_id"] = self.pad_token_id
    return d


@dataclasses.dataclass(frozen=True, eq=False)
class Target:
  """What `load_target` returns and `generate` consumes.

  config: static model config (hashable, a jit static argument);
  params: the decoder's `nnx.State` pytree;
  tokenizer: a `tokenizers.Tokenizer` when the checkpoint ships `tokenizer.json`, else None;
  generation: what `generation_config.json` declared, None without one. `generate` stops at
  `config.eos_token_id`, which `load_target` sets to the generation config's EOS when there is one.
  mesh: the device mesh the params are laid out on (`specjax.sharding`), None on one device;
  `generate` runs on it.
  source: the folder it was loaded from (None for a target built in memory); a drafter that
  records the model it was trained for is checked against it.
  """

  config: ModelConfig
  params: nnx.State
  tokenizer: Any = None
  generation: GenerationDefaults | None = None
  mesh: Any = None
  source: str | None = None

  @classmethod
  def random(cls, config: ModelConfig, seed: int = 0, tokenizer: Any = None) -> Target:
    return cls(config, decoder.init_params(config, seed), tokenizer)

  @property
  def num_params(self) -> int:
    return decoder.num_params(self.params)

  @property
  def platform(self) -> str:
    """The platform its params are on: 'cpu', 'gpu' or 'tpu'."""
    leaf = jax.tree.leaves(self.params)[0]
    return next(iter(leaf.sharding.device_set)).platform

  def replace(self, **changes) -> Target:
    return dataclasses.replace(self, **changes)

  def on_mesh(self, mesh) -> Target:
    """This target with its params laid out on `mesh` (a Mesh, a spec such as 'dp=2,tp=4', or
    'auto': `sharding.auto_mesh`, which leaves a target it finds one device for as it is) by
    the partition rules of `specjax.sharding`."""
    mesh = sharding.model_mesh(mesh, self.config)
    if mesh is None:
      return self
    params = sharding.place(self.params, sharding.param_shardings(self.config, self.params, mesh))
    return self.replace(params=params, mesh=mesh)

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`. Whether a literal special token's text (e.g. '<|endoftext|>') becomes
    its id follows the folder's `split_special_tokens` (see `interop.hf.load_target`).
    add_special_tokens: the tokenizer's post-processor (e.g. a BOS) applies; False for text a
    chat template rendered, which spells its special tokens itself."""
    if self.tokenizer is None:
      raise ValueError("this target has no tokenizer: pass token ids instead of text")
    if not isinstance(text, str):
      raise ValueError(f"text must be a str, got {type(text).__name__}")
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    """Text of `ids`, without special tokens (EOS) unless asked, as transformers' `decode`
    with `skip_special_tokens=True` gives it."""
    if self.tokenizer is None:
      raise ValueError("this target has no tokenizer")
    vocab = self.config.vocab_size
    ids = ids.tolist() if hasattr(ids, "tolist") else ids  # a numpy or jax array of ids
    ids = [checks.integer("token id", t, lo=0, hi=vocab - 1) for t in ids]
    return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
