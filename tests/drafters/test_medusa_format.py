"""Published Medusa-1 heads (FasterDecoding/Medusa) read into the `medusa` family and written back.

The checkpoints are random heads built here as the authors' module builds them (a ModuleList of
`Sequential(*([ResBlock(H)] * L), Linear(H, V, bias=False))`, so the L layers of a head are one
shared block) and saved as their code saves them (`medusa_lm_head.safetensors`, or
`medusa_lm_head.pt` through torch.save; the `medusa_head.` prefix of full Medusa-2 checkpoints).
The reference forward is that torch module in float64, run on the final normed hidden state of
a tiny HF Llama target.

  1. Depth-k logits (head k on the final normed state) equal the torch heads' within 1e-4 in
     float32, through the drafter, its tree and its training view (`depth_logits`).
  2. Greedy decoding with the loaded drafter equals autoregressive decoding.
  3. Export in the published layout and load again: the same tensors; a specjax Medusa that
     drafts through the target's head is written with that head; `formats.detect` picks medusa.
  4. Clear errors for missing, unexpected, misshapen or differing tensors and other targets.
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax import sharding
from specjax.drafters import formats, io, learned, medusa, static_tree
from specjax.drafters.base import DraftContext, TargetView
from specjax.models import decoder
from specjax.sampling import SamplingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from tests.helpers import torch_ref  # noqa: E402

PROMPT = [5, 17, 3, 99, 42, 7, 150, 8, 61]


class ResBlock(torch.nn.Module):  # Medusa's, as published
  def __init__(self, hidden_size):
    super().__init__()
    self.linear = torch.nn.Linear(hidden_size, hidden_size)
    torch.nn.init.zeros_(self.linear.weight)
    self.act = torch.nn.SiLU()

  def forward(self, x):
    return x + self.act(self.linear(x))


def medusa_heads(hidden: int, vocab: int, k: int, n: int, seed: int = 0) -> torch.nn.ModuleList:
  """Medusa-1's heads with random weights (the shared block of each head randomised once)."""
  torch.manual_seed(seed)
  heads = torch.nn.ModuleList([
      torch.nn.Sequential(*([ResBlock(hidden)] * n), torch.nn.Linear(hidden, vocab, bias=False))
      for _ in range(k)])
  with torch.no_grad():
    for name, p in heads.named_parameters():
      p.copy_((0.15 if "linear" in name else 0.3) * torch.randn_like(p))
  return heads


def save_published(path, heads, k: int, n: int, *, pt: bool = False, prefix: str = "",
                   config: bool = True, extra: dict | None = None):
  os.makedirs(path, exist_ok=True)
  state = {prefix + name: t for name, t in heads.state_dict().items()}
  state.update(extra or {})
  if pt:
    torch.save(state, os.path.join(path, "medusa_lm_head.pt"))
  else:  # safetensors refuses tensors sharing memory (the repeated block): one copy each
    file = "model.safetensors" if prefix else "medusa_lm_head.safetensors"
    save_file({name: t.detach().clone().contiguous() for name, t in state.items()},
              os.path.join(path, file))
  if config:
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump({"medusa_num_heads": k, "medusa_num_layers": n,
                 "base_model_name_or_path": "tiny-llama"}, f)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """(HF model in float64, specjax Target in float32, final normed states of PROMPT [T, H])."""
  model, target = torch_ref.hf_target(tmp_path_factory.mktemp("target"), "llama_mha")
  return model, target, torch_ref.hidden_states(model, PROMPT)[-1]


CASES = {  # name -> (K heads, L layers, save_published options and the heads' dtype)
    "safetensors_L1": (4, 1, {}),
    "safetensors_fp16_L1": (4, 1, {"dtype": torch.float16}),
    "pt_bf16_L2_shared": (5, 2, {"pt": True, "dtype": torch.bfloat16}),
    "prefix_L2_no_config": (3, 2, {"prefix": "medusa_head.", "config": False}),
}


def published(tmp_path, hf, case: str):
  model, target, _ = hf
  k, n, opts = CASES[case]
  opts = dict(opts)
  heads = medusa_heads(target.config.hidden_size, target.config.vocab_size, k, n).to(
      opts.pop("dtype", torch.float32))
  extra = {}
  if opts.get("prefix"):  # a full Medusa-2 checkpoint also holds the base model
    extra = {f"model.{name}": t.float() for name, t in model.state_dict().items()
             if "norm" in name}
  save_published(tmp_path / case, heads, k, n, extra=extra, **opts)
  return tmp_path / case, heads.double()


@pytest.mark.parametrize("case", list(CASES))
def test_depth_logits_match_the_torch_heads(tmp_path, hf, case):
  _, target, final = hf
  path, heads = published(tmp_path, hf, case)
  assert formats.detect(path) == "medusa"
  drafter = io.load_drafter(path, target)
  k, n, _ = CASES[case]
  assert drafter.hidden_layers == (target.config.num_layers,)
  assert drafter.net.num_heads == k and drafter.net.num_layers == n and drafter.net.own_heads
  np.testing.assert_array_equal(np.asarray(drafter.d2t), np.arange(target.config.vocab_size))
  with torch.no_grad():
    want = torch.stack([h(final) for h in heads], 1).numpy()  # [T, K, V]

  f = jnp.asarray(final.numpy(), jnp.float32)
  net = learned.merge(medusa.MedusaHeads, drafter.net, drafter.params)
  np.testing.assert_allclose(net.logits(net(f), drafter.head), want, atol=1e-4, rtol=1e-4)
  x = learned.DepthInputs(f[None], f[None], jnp.asarray([PROMPT]), None, drafter.head)
  view, _ = medusa.FAMILY.depth_logits(drafter.net, drafter.params, x, k)
  np.testing.assert_allclose(view[:, 0], want.transpose(1, 0, 2), atol=1e-4, rtol=1e-4)

  # The drafter's tree: node (r_1 .. r_d) is head d's rank-r_d token on the feature.
  history = jnp.asarray([PROMPT + [0] * 7], jnp.int32)
  ctx = DraftContext(history, jnp.asarray([len(PROMPT)]), history[:, len(PROMPT) - 1], None,
                     jax.random.key(0))
  tree, _, _ = drafter.draft(TargetView(target.config, SamplingConfig(), target.params),
                             medusa.HeadState(f[-1:]), ctx)
  for i, p in enumerate(drafter.template.paths):
    assert int(tree.tokens[0, i]) == int(np.argsort(-want[-1, len(p) - 1], kind="stable")[p[-1]])


def test_greedy_output_equals_autoregressive(tmp_path, hf):
  _, target, _ = hf
  path, _ = published(tmp_path, hf, "pt_bf16_L2_shared")
  drafter = io.load_drafter(path, target, choices="tree6")
  prompts = [PROMPT, PROMPT[:5]]
  ar = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=[])
  spec = specjax.generate(target, prompts, max_new_tokens=12, eos_token_id=[], drafter=drafter)
  assert spec.tokens == ar.tokens


@pytest.mark.parametrize("case", ["pt_bf16_L2_shared", "prefix_L2_no_config"])
def test_export_load_round_trip_is_identical(tmp_path, hf, case):
  _, target, _ = hf
  path, heads = published(tmp_path, hf, case)
  drafter = io.load_drafter(path, target)
  out = tmp_path / "out"
  io.export_drafter(out, drafter, target, "medusa")
  assert sorted(os.listdir(out)) == ["config.json", "medusa_lm_head.safetensors"]
  k, n, _ = CASES[case]
  with open(out / "config.json") as f:
    assert json.load(f) == {"medusa_num_heads": k, "medusa_num_layers": n,
                            "base_model_name_or_path": None}
  written = load_file(out / "medusa_lm_head.safetensors")
  published_state = {name: t.float().numpy() for name, t in heads.state_dict().items()}
  assert sorted(written) == sorted(published_state)
  for name, value in written.items():
    assert value.dtype == np.float32
    np.testing.assert_array_equal(value, published_state[name], err_msg=name)
  assert formats.detect(out) == "medusa"
  again = io.load_drafter(out, target)
  assert again.net == drafter.net
  for a, b in zip(jax.tree.leaves(drafter.params), jax.tree.leaves(again.params), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_specjax_medusa_is_written_with_the_targets_head(tmp_path, hf):
  _, target, final = hf
  mine = io.init_drafter("medusa", target)
  params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(1), p.shape),
                        mine.params)
  mine = mine.replace(params=params)
  io.export_drafter(tmp_path / "out", mine, target, "medusa")
  theirs = io.load_drafter(tmp_path / "out", target)
  assert theirs.net.own_heads and not mine.net.own_heads
  full = np.asarray(decoder.unembedding(target.config, target.params))
  for i in range(mine.net.num_heads):
    np.testing.assert_array_equal(np.asarray(theirs.params["lm_head"][...][i]), full)
  f = jnp.asarray(final.numpy(), jnp.float32)
  a = learned.merge(medusa.MedusaHeads, mine.net, mine.params)
  b = learned.merge(medusa.MedusaHeads, theirs.net, theirs.params)
  np.testing.assert_allclose(b.logits(b(f), None), a.logits(a(f), mine.head), atol=1e-5)

  small = io.init_drafter("medusa", target, d2t=np.arange(50))
  with pytest.raises(ValueError, match="cover the whole vocabulary"):
    io.export_drafter(tmp_path / "small", small, target, "medusa")


def test_sharding_rules_cover_the_own_heads(tmp_path, hf):
  _, target, _ = hf
  path, _ = published(tmp_path, hf, "safetensors_L1")
  drafter = io.load_drafter(path, target)
  rules = sharding.drafter_rules(drafter)
  logical = {}
  for key, leaf in jax.tree_util.tree_flatten_with_path(drafter)[0]:
    name = sharding.path_str(key)
    logical[name] = next(axes for pattern, axes in rules if re.search(pattern, name))
    assert len(logical[name]) <= leaf.ndim, name
  assert logical["params/lm_head"] == (None, None, "vocab")
  assert logical["params/weight"] == (None, None, "mlp")
  placed = sharding.shard_drafter(drafter, target.config, sharding.make_mesh("dp=4,tp=2"))
  assert placed.params["weight"][...].sharding.spec == jax.sharding.PartitionSpec(
      None, None, "model")


def _edit(tmp_path, hf, edit, **opts):
  """A published L = 2 safetensors checkpoint of 3 heads with `edit(state)` applied."""
  _, target, _ = hf
  heads = medusa_heads(target.config.hidden_size, target.config.vocab_size, 3, 2)
  state = {n: t.detach().clone() for n, t in heads.state_dict().items()}
  edit(state)
  path = tmp_path / "bad"
  os.makedirs(path)
  save_file(state, os.path.join(path, "medusa_lm_head.safetensors"))
  if opts.get("config", True):
    with open(path / "config.json", "w") as f:
      json.dump({"medusa_num_heads": opts.get("heads", 3), "medusa_num_layers":
                 opts.get("layers", 2)}, f)
  return path


def _pop(name):
  return lambda s: s.pop(name)


def _set(name, value):
  return lambda s: s.__setitem__(name, value(s[name]))


ERRORS = {
    "missing_bias": (_pop("1.1.linear.bias"), {}, r"head 1 lacks \['1.1.linear.bias'\]"),
    "missing_head": (lambda s: [s.pop(n) for n in list(s) if n.startswith("1.")], {},
                     r"heads \[1\] are missing"),
    "unexpected_name": (lambda s: s.update({"extra.weight": torch.zeros(2)}), {},
                        r"tensors its format does not use: \['extra.weight'\]"),
    "unexpected_kind": (lambda s: s.update({"0.1.weight": torch.zeros(64, 64)}), {},
                        r"unexpected tensors \['0.1.weight'\]"),
    "wrong_shape": (_set("2.1.linear.weight", lambda t: t[:, :-1].contiguous()), {},
                    r"tensor '2.1.linear.weight' .* has shape \(64, 63\), expected \(64, 64\)"),
    "differing_layers": (_set("1.1.linear.weight", lambda t: t + 1e-3), {},
                         r"head 1's layers differ \(1.0.linear.weight != 1.1.linear.weight\)"),
    "vocab": (lambda s: [s.__setitem__(f"{i}.2.weight", torch.zeros(300, 64)) for i in range(3)],
              {}, "300 rows, the target's vocabulary 211"),
    "hidden": (lambda s: s.update({n: (t[:32, :32] if t.ndim == 2 else t[:32]).contiguous()
                                   if "linear" in n else t[:, :32].contiguous()
                                   for n, t in s.items()}), {},
               "32 wide .* the target's hidden size is 64"),
    "config_layers": (lambda s: None, {"layers": 3}, "medusa_num_layers 3, the tensors hold 2"),
    "config_heads": (lambda s: None, {"heads": 4}, "medusa_num_heads 4, the tensors hold 3"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_checkpoints_are_refused_clearly(tmp_path, hf, case):
  edit, opts, message = ERRORS[case]
  path = _edit(tmp_path, hf, edit, **opts)
  with pytest.raises(ValueError, match=message):
    io.load_drafter(path, hf[1], format="medusa")


def test_config_naming_fewer_heads_reads_all_of_them(tmp_path, hf):
  """The authors' uploaded configs named fewer heads than their weights hold."""
  path = _edit(tmp_path, hf, lambda s: None, heads=2)
  conv = formats.read(path, hf[1], "medusa")
  assert conv.net.num_heads == 3 and "config.json names 2 heads" in conv.source["config_heads"]
  assert conv.tree == {"choices": tuple(p for p in static_tree.DEFAULT_CHOICES
                                        if len(p) <= 3)}


def test_a_pickle_without_torch_names_the_fix(tmp_path, hf, monkeypatch):
  path, _ = published(tmp_path, hf, "pt_bf16_L2_shared")
  monkeypatch.setitem(sys.modules, "torch", None)
  with pytest.raises(ValueError, match="pickled torch checkpoint and torch is not installed"):
    io.load_drafter(path, hf[1], format="medusa")
