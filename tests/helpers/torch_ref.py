"""Independent torch pieces for reference forwards of published drafters, written from the
layouts' descriptions (never from specjax's code): a tiny HF target, its hidden states, and
Llama-style RMSNorm, RoPE, grouped-query attention and SwiGLU over torch-layout weights.

Tensors are float64 (exact enough that a 1e-4 comparison tests the mapping, not rounding).
"""

from __future__ import annotations

import os

import numpy as np
import torch

import specjax
from tests.helpers.hf_models import save_hf_model


def hf_target(path: str | os.PathLike, variant: str = "llama_gqa_tied", seed: int = 0,
              **overrides):
  """(transformers model, specjax Target in float32) of one random HF checkpoint folder."""
  model = save_hf_model(variant, path, seed, **overrides)
  return model.double(), specjax.load_target(os.fspath(path), dtype="float32")


def hidden_states(model, ids) -> tuple[torch.Tensor, ...]:
  """HF hidden_states of `ids` (list of token ids): [0] the embeddings, [i] the output of
  layer i, [L] the final normed state; each [T, H] float64."""
  with torch.no_grad():
    out = model(torch.tensor([ids]), output_hidden_states=True)
  return tuple(h[0].double() for h in out.hidden_states)


def weight(tensors: dict[str, np.ndarray], name: str) -> torch.Tensor:
  return torch.from_numpy(np.asarray(tensors[name], np.float64))


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
  return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
  """x: [T, heads, D] rotated by its positions (the rotate-half convention of Llama)."""
  d = x.shape[-1]
  inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
  ang = positions.double()[:, None] * inv[None]  # [T, D/2]
  cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
  half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
  return x * cos + half * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
              ) -> torch.Tensor:
  """q [T, H, D], k/v [S, K, D], mask bool[T, S] (True: may attend) -> [T, H * D]."""
  group = q.shape[1] // k.shape[1]
  k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
  scores = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
  scores = scores.masked_fill(~mask[None], float("-inf"))
  out = torch.einsum("hts,shd->thd", scores.softmax(-1), v)
  return out.reshape(q.shape[0], -1)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
           ) -> torch.Tensor:
  return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
