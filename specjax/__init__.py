"""specjax: lossless speculative decoding for LLMs in JAX/Flax.

Shape letters used in names, comments and einsums throughout the package:

  B batch    T new tokens    S cache slots    N draft-tree nodes    L layers
  H query heads    K key/value heads    G = H / K    D head dim    E model dim    V vocab

Public surface (one import for a notebook):

  target = specjax.load_target("path/to/hf_folder")
  result = specjax.generate(target, ["def fib(n):"], max_new_tokens=64)
  drafter = specjax.drafters.build("prompt_lookup", target)   # available(target) lists them
  drafter = specjax.load_drafter("path/to/eagle3_folder", target)   # a trained drafter
  result = specjax.generate(target, prompts, max_new_tokens=64, drafter=drafter)
  specjax.save_hf(target, "path/to/out")
"""

from specjax import drafters, trees, verify
from specjax.decoding import GenerateResult, Stats, generate
from specjax.drafters.io import load_drafter
from specjax.interop.hf import load_target, save_hf
from specjax.models.cache import KVCache
from specjax.models.config import ModelConfig, RopeScaling
from specjax.sampling import SamplingConfig
from specjax.target import Target

__all__ = [
    "GenerateResult", "KVCache", "ModelConfig", "RopeScaling", "SamplingConfig", "Stats",
    "Target", "drafters", "generate", "load_drafter", "load_target", "save_hf", "trees", "verify",
]
