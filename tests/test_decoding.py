"""`specjax.generate` (autoregressive, drafter=None) against transformers, and its input checks.

Greedy decoding must reproduce transformers token for token; sampling must draw from exactly
softmax(process(logits)), checked with a Pearson chi-square test against the exact law. These
are the baselines every speculative method is later compared with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

import specjax
from specjax import sampling, sharding
from specjax.models import decoder
from specjax.sampling import SamplingConfig, argmax, process_logits
from tests.helpers.stats import pooled_chi_square

VOCAB = 211  # hf_models._BASE
NEW = 64
GREEDY_VARIANTS = ["qwen3_qknorm", "llama_gqa_tied"]
TIE_GAP = 1e-4  # whole-model f32 tolerance: top-2 logits closer than this are a float tie


def _prompts(n=20, lo=3, hi=40, seed=0):
  """n prompts with lengths spread over [lo, hi], in shuffled order (batches mix lengths)."""
  rng = np.random.default_rng(seed)
  lengths = rng.permutation(np.linspace(lo, hi, n).round().astype(int))
  return [rng.integers(0, VOCAB, int(n)).tolist() for n in lengths]


def _hf_greedy(model, prompt, n):
  """transformers greedy generate on one unpadded prompt: n tokens and the raw logits of each."""
  ids = torch.tensor([prompt])
  with torch.no_grad():
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True)
  return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits)[:, 0].float().numpy()


def _assert_greedy_equal(ours, ref_tokens, ref_logits, where):
  """Token-for-token equality, with one narrow exception: at the first
  mismatch, ours may be HF's runner-up if HF's top-2 logits differ by < TIE_GAP; after such a tie
  the two sequences legitimately diverge, so the rest is not compared. Returns the tie step."""
  assert len(ours) == len(ref_tokens), where
  for i, (a, r) in enumerate(zip(ours, ref_tokens)):
    if a == r:
      continue
    order = np.argsort(ref_logits[i])
    gap = ref_logits[i][order[-1]] - ref_logits[i][order[-2]]
    assert order[-1] == r and a == order[-2] and gap < TIE_GAP, (
        f"{where}: step {i} specjax {a} transformers {r} (HF top-2 gap {gap:.2e})")
    return i
  return None


@pytest.fixture(scope="module")
def greedy_refs(hf_checkpoint):
  """variant -> (prompts, [(HF tokens, HF logits)] per prompt), computed once."""
  prompts = _prompts()
  refs = {}
  for variant in GREEDY_VARIANTS:
    model = hf_checkpoint(variant).hf_model
    refs[variant] = [_hf_greedy(model, p, NEW) for p in prompts]
  return prompts, refs


@pytest.fixture(scope="module")
def qwen(hf_checkpoint):
  return hf_checkpoint("qwen3_qknorm").target


# -- 7. greedy == transformers -----------------------------------------------------------------


@pytest.mark.parametrize("variant", GREEDY_VARIANTS)
@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_matches_transformers(hf_checkpoint, greedy_refs, variant, batch):
  """20 prompts of lengths 3..40, 64 new tokens, no EOS: specjax greedy equals transformers greedy
  run on each prompt alone, token for token (float ties excepted, see `_assert_greedy_equal`).
  Batch 4 mixes unequal lengths, so right-padding and per-row positions/lengths are exercised."""
  target = hf_checkpoint(variant).target
  prompts, refs = greedy_refs[0], greedy_refs[1][variant]
  ties = []
  for start in range(0, len(prompts), batch):
    result = specjax.generate(target, prompts[start:start + batch], max_new_tokens=NEW)
    assert len(result.tokens) == len(prompts[start:start + batch])
    for j, ours in enumerate(result.tokens):
      i = start + j
      tie = _assert_greedy_equal(ours, *refs[i], where=f"prompt {i} (len {len(prompts[i])})")
      if tie is not None:
        ties.append((i, tie))
  # A tie is a rare float event (gap < 1e-4 on logits of scale ~3); many would mean a real bug.
  assert len(ties) <= 2, ties


@pytest.mark.parametrize("variant", GREEDY_VARIANTS)
def test_chunked_prefill_matches_transformers(hf_checkpoint, variant):
  """Prompts padded to 192 positions are prefilled in chunks of `PREFILL_CHUNK` (64), as many as
  the batch's longest prompt needs: rows whose prompt ends inside, at the end of and past the
  first chunk, in one batch and alone, decode greedily as transformers does on each prompt
  alone (float ties excepted), and their first token's logits match its last prompt logits."""
  from specjax import decoding, rounds
  assert 192 % rounds.PREFILL_CHUNK == 0 and rounds.PREFILL_CHUNK < 192
  ckpt = hf_checkpoint(variant)
  rng = np.random.default_rng(11)
  prompts = [rng.integers(0, VOCAB, n).tolist() for n in (63, 64, 65, 130, 20, 190)]
  refs = [_hf_greedy(ckpt.hf_model, p, 16) for p in prompts]
  for group in ([0, 1, 2, 3], [4], [5]):
    result = specjax.generate(ckpt.target, [prompts[i] for i in group], max_new_tokens=16,
                              pad_to=192)
    for i, ours in zip(group, result.tokens):
      _assert_greedy_equal(ours, *refs[i], where=f"prompt {i} (len {len(prompts[i])})")
  run = decoding.prepare(ckpt.target, prompts[:4], 16, decoding.NoDrafter(), SamplingConfig(),
                         0, [], 192)
  params, tokens, lens = run.args.params, run.args.prompts, run.args.prompt_lens
  cfg = run.spec.config
  taps = (1, cfg.num_layers)  # what drafters read at init: a layer's output, the final state
  last, hidden, cache = rounds.prompt_pass(cfg, params, tokens, lens, run.fresh_cache(), taps)
  one_pass = decoder.full_forward(cfg, params, tokens, lens, hidden_layers=taps)
  for row in range(4):
    n = len(prompts[row])
    np.testing.assert_allclose(np.asarray(last[row]), refs[row][1][0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(hidden[:, row, :n]), np.asarray(one_pass.hidden[:, row,
                               :n]), rtol=1e-4, atol=1e-4)
  assert np.asarray(cache.length).tolist() == [0] * tokens.shape[0]


# -- 8. EOS and max_new_tokens ------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_setup(qwen):
  """4 prompts and their 24 greedy tokens without EOS; an EOS id that row 0 emits (not first) and
  row 1 never emits; a second id that row 2 emits."""
  prompts = _prompts(n=4, lo=5, hi=14, seed=7)
  free = specjax.generate(qwen, prompts, max_new_tokens=24, eos_token_id=[]).tokens
  eos = next(t for t in free[0][1:] if t not in free[1] and t != free[0][0])
  eos2 = next(t for t in free[2][1:] if t not in free[1] and t != eos)
  return prompts, free, eos, eos2


def _truncate(row, eos_ids):
  for i, t in enumerate(row):
    if t in eos_ids:
      return row[:i + 1]
  return row


def test_eos_stops_each_row_independently(qwen, eos_setup):
  """With EOS, each row ends at its own first EOS (kept, nothing after it) while the others go on
  to exactly max_new_tokens with unchanged tokens; a list of EOS ids stops at any of them, and the
  config's `eos_token_id` is the default. Stats count only emitted tokens."""
  prompts, free, eos, eos2 = eos_setup
  assert all(len(r) == 24 for r in free)
  for eos_ids in ([eos], [eos, eos2]):
    result = specjax.generate(qwen, prompts, max_new_tokens=24, eos_token_id=eos_ids)
    expect = [_truncate(r, eos_ids) for r in free]
    assert result.tokens == expect
    assert len(expect[0]) < 24 and expect[0][-1] in eos_ids and len(expect[1]) == 24
    assert result.stats.new_tokens == sum(map(len, expect))
    assert result.stats.tau == 1.0 and result.stats.target_calls == max(map(len, expect))
  with_default = qwen.replace(config=qwen.config.replace(eos_token_id=(eos,)))
  assert specjax.generate(with_default, prompts, max_new_tokens=24).tokens == [
      _truncate(r, [eos]) for r in free]


def test_max_new_tokens_one(qwen, eos_setup):
  """max_new_tokens=1 emits exactly the first greedy token per row (the prefill's sample), also
  when that token is EOS."""
  prompts, free, _, _ = eos_setup
  result = specjax.generate(qwen, prompts, max_new_tokens=1)
  assert result.tokens == [r[:1] for r in free]
  assert result.stats.target_calls == 1 and result.stats.new_tokens == 4
  result = specjax.generate(qwen, prompts, max_new_tokens=1, eos_token_id=free[0][0])
  assert result.tokens == [r[:1] for r in free]


# -- 9. sampling -------------------------------------------------------------------------------


def test_sampling_seed_reproducible_and_rows_independent(qwen):
  """T=1: the same seed reproduces the exact tokens, another seed changes them, and a row's tokens
  do not depend on how many rows share the batch (each row has its own rng stream)."""
  prompts = _prompts(n=4, lo=5, hi=14, seed=3)
  kw = dict(max_new_tokens=16, temperature=1.0)
  a = specjax.generate(qwen, prompts, seed=11, **kw).tokens
  assert specjax.generate(qwen, prompts, seed=11, **kw).tokens == a
  b = specjax.generate(qwen, prompts, seed=12, **kw).tokens
  assert all(x != y for x, y in zip(a, b))  # P(16 equal draws) is negligible at T=1
  assert specjax.generate(qwen, prompts[:2], seed=11, **kw).tokens == a[:2]


def _reference_probs(logits, temperature, top_k=0, top_p=1.0):
  """float64 numpy re-implementation of transformers' temperature -> top-k -> top-p warpers.

  Also returns how far the top-p cut is from a float32 rounding ambiguity (the cumulative mass at
  the cut vs 1 - top_p), so the test can refuse a prompt whose support is ill-defined in float32.
  """
  x = np.asarray(logits, np.float64) / temperature
  if top_k:
    x = np.where(x < np.sort(x)[-top_k], -np.inf, x)
  margin = np.inf
  if top_p < 1.0:
    order = np.argsort(x)
    p = np.exp(x[order] - x[order].max())
    cum = np.cumsum(p / p.sum())
    drop = cum <= 1.0 - top_p
    drop[-1] = False
    margin = np.min(np.abs(cum[np.isfinite(x[order])] - (1.0 - top_p)))
    x[order[drop]] = -np.inf
  p = np.exp(x - x.max())
  return p / p.sum(), margin


N_SAMPLES = 16384


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0)])
def test_first_token_distribution_chi_square(hf_checkpoint, temperature, top_k, top_p):
  """The first sampled token of 16384 copies of one prompt (max_new_tokens=1, each row its own rng
  stream, so the draws are independent) follows softmax(warped HF logits / T), the warping
  recomputed in float64 numpy from transformers' logits. Pearson chi-square (cells with expected
  count < 5 pooled), reject if p < 1e-4 (3 tests: family-wise false alarm < 3e-4). With N = 16384,
  a bias of D = sum (r - p)^2 / p ~ 0.01 is detected with high power. Tokens outside the top-k /
  top-p support must never be drawn, whatever their count."""
  ckpt = hf_checkpoint("qwen3_qknorm")
  prompt = _prompts(n=1, lo=12, hi=12, seed=5)[0]
  with torch.no_grad():
    logits = ckpt.hf_model(torch.tensor([prompt])).logits[0, -1].numpy()
  probs, margin = _reference_probs(logits, temperature, top_k, top_p)
  assert margin > 1e-4, "top-p cut within float32 rounding of 1 - top_p: choose another prompt"
  result = specjax.generate(ckpt.target, [prompt] * N_SAMPLES, max_new_tokens=1, seed=1,
                            temperature=temperature, top_k=top_k, top_p=top_p)
  first = np.array([r[0] for r in result.tokens])
  assert first.min() >= 0 and first.max() < VOCAB
  counts = np.bincount(first, minlength=VOCAB)
  outside = counts[probs == 0].sum()
  assert outside == 0, f"{outside} draws of zero-probability tokens"
  _, dof, pvalue = pooled_chi_square(counts, probs)
  cells = dof + 1
  assert cells >= 3, "degenerate distribution: the test would have no power"
  assert pvalue > 1e-4, f"chi-square p = {pvalue:.2e} over {cells} cells"


_WARPER_CASES = [
    SamplingConfig(0.7), SamplingConfig(1.0, top_k=5), SamplingConfig(1.0, top_k=1),
    SamplingConfig(1.0, top_k=VOCAB + 5), SamplingConfig(0.8, top_p=0.9),
    SamplingConfig(1.0, top_p=0.01), SamplingConfig(1.3, top_k=20, top_p=0.8),
    SamplingConfig(0.5, top_k=50, top_p=0.95),
]


@pytest.mark.parametrize("cfg", _WARPER_CASES, ids=str)
def test_process_logits_matches_transformers_warpers(cfg):
  """`process_logits` equals transformers' Temperature -> TopK -> TopP warpers (the order HF's
  generate applies them) on random float32 logits: the same support and, on it, values within
  1e-5 (a simple float32 op). Why: "the target distribution" must mean the same in both."""
  rng = np.random.default_rng(0)
  logits = (3.0 * rng.standard_normal((16, VOCAB))).astype(np.float32)
  ours = np.asarray(process_logits(jnp.asarray(logits), cfg))
  scores = torch.tensor(logits)
  ids = torch.zeros((16, 1), dtype=torch.long)
  warpers = [transformers.TemperatureLogitsWarper(cfg.temperature)]
  if cfg.top_k:
    warpers.append(transformers.TopKLogitsWarper(cfg.top_k))
  if cfg.top_p < 1.0:
    warpers.append(transformers.TopPLogitsWarper(cfg.top_p))
  for w in warpers:
    scores = w(ids, scores)
  theirs = scores.numpy()
  support = np.isfinite(theirs)
  np.testing.assert_array_equal(np.isfinite(ours), support)
  assert np.all(ours[~support] == -np.inf)
  np.testing.assert_allclose(ours[support], theirs[support], rtol=0, atol=1e-5)


def test_top_p_keeps_what_the_sorted_definition_keeps():
  """`nucleus_keeps` finds top-p's support by bisection, without a sort: on rows peaked, flat,
  and cut by top-k first (-inf), it keeps exactly the tokens whose ascending cumulative
  probability (float64, with a sort) exceeds 1 - top_p, and the top token always; tokens tied
  at the cut are kept together (a sort would keep some of them by position)."""
  rng = np.random.default_rng(3)
  scales = np.array([0.3, 1.0, 3.0, 8.0])[:, None, None]
  logits = (scales * rng.standard_normal((4, 64, 200))).reshape(256, 200).astype(np.float32)
  logits[::3, :150] = -np.inf  # rows a top-k of 50 cut first
  for top_p in (0.01, 0.5, 0.9, 0.99):
    ours = np.asarray(sampling.nucleus_keeps(jnp.asarray(logits), 1.0 - top_p))
    x = logits.astype(np.float64)
    order = np.argsort(x, axis=-1)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    cum = np.cumsum(np.take_along_axis(p, order, -1), axis=-1)
    keep_sorted = cum > 1.0 - top_p
    keep_sorted[:, -1] = True
    want = np.zeros_like(keep_sorted)
    np.put_along_axis(want, order, keep_sorted, axis=-1)
    clear = np.all(np.abs(cum - (1.0 - top_p)) > 1e-5, axis=-1)  # no cut within float rounding
    assert clear.mean() > 0.9
    np.testing.assert_array_equal(ours[clear], want[clear])
  tied = np.asarray(process_logits(jnp.asarray([[0.0, 0.0, 0.0, 0.0, -1.0]]),
                                   SamplingConfig(1.0, top_p=0.5)))
  np.testing.assert_array_equal(np.isfinite(tied), [[True, True, True, True, False]])


def test_process_logits_top_k_keeps_ties():
  """Top-k keeps every token tied with the k-th value, as transformers does."""
  logits = np.array([[1.0, 3.0, 2.0, 2.0, 0.0, 2.0]], np.float32)
  ours = np.asarray(process_logits(jnp.asarray(logits), SamplingConfig(1.0, top_k=2)))
  theirs = transformers.TopKLogitsWarper(2)(None, torch.tensor(logits)).numpy()
  np.testing.assert_array_equal(np.isfinite(ours), [[False, True, True, True, False, True]])
  np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(theirs))



@pytest.mark.parametrize("mesh", [None, "dp=4,tp=2", "dp=2,tp=4", "dp=1,tp=8"])
def test_argmax_equals_jnp_argmax_with_ties_infs_and_nans(mesh):
  """`sampling.argmax` (the decode path's) is `jnp.argmax` exactly: first index of the maximum
  among ties, -inf / +inf rows, and the first NaN when a row has one (never out of range); also
  traced under meshes that split the vocabulary (each shard reduces its slice, then one
  all-gather), with ties, infinities and NaNs across shard boundaries, and in bfloat16."""
  rng = np.random.default_rng(0)
  x = rng.integers(-3, 4, size=(64, 40)).astype(np.float32)  # many ties, in every slice
  x[0] = -np.inf
  x[1, 5] = x[1, 20] = np.inf
  x[2, 7] = x[2, 30] = np.nan
  x[3] = np.nan
  x[4, 39] = 100.0
  x[5, 24] = x[5, 4] = 9.0  # the tie's first index is in an earlier slice
  x[6, 33] = np.nan  # a NaN in the last slice only
  rows = rng.standard_normal((4, 5, 8192)).astype(np.float32)
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(sharding.make_mesh(mesh)):
    ours = jax.jit(argmax)
    for a in (x, rows, rows.astype(jnp.bfloat16)):
      np.testing.assert_array_equal(np.asarray(ours(jnp.asarray(a))),
                                    np.asarray(jnp.argmax(jnp.asarray(a), axis=-1)))


# -- 10. compiled program reuse ------------------------------------------------------------------


class _CompileLog(logging.Handler):

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.compiles = []

  def emit(self, record):
    if record.getMessage().startswith("Compiling "):
      self.compiles.append(record.getMessage()[:120])


def test_no_recompile_within_a_bucket(qwen):
  """Same batch size and max_new_tokens: prompt lengths 17 then 30 share the 32 bucket, so the
  second call reports `compiled == False` and triggers no XLA compilation at all (checked with
  `jax.log_compiles`); length 40 is bucket 64 and compiles. max_new_tokens=13 is used by no other
  test, so the first compile of each bucket happens here."""
  import jax

  def run(n):
    log = _CompileLog()
    logger = logging.getLogger("jax")
    logger.addHandler(log)
    try:
      with jax.log_compiles(True):
        r = specjax.generate(qwen, [list(range(1, n + 1))] * 2, max_new_tokens=13)
    finally:
      logger.removeHandler(log)
    return r.stats, log.compiles

  stats, _ = run(17)
  assert stats.compiled and stats.compile_seconds > 0
  stats, compiles = run(30)
  assert not stats.compiled and stats.compile_seconds == 0.0
  assert compiles == []
  stats, compiles = run(40)
  assert stats.compiled and any("generate_program" in c for c in compiles)


# -- 11. stats -----------------------------------------------------------------------------------


def test_autoregressive_stats(qwen):
  """AR on one row without EOS: tau == 1.0 exactly, one target call per token (prefill included),
  `new_tokens` is the total, and the throughput is a positive finite number."""
  result = specjax.generate(qwen, [[5, 6, 7]], max_new_tokens=20)
  s = result.stats
  assert len(result.tokens[0]) == 20
  assert s.tau == 1.0 and s.target_calls == 20 and s.new_tokens == 20
  assert s.wall_seconds > 0 and 0 < s.tokens_per_second < float("inf")
  assert result.text is None  # no tokenizer in the checkpoint


# -- 12. bad input -------------------------------------------------------------------------------


def _tensors(folder):
  return load_file(os.path.join(folder, "model.safetensors"))


def _resave(folder, tensors):
  save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})


def _edit_config(folder, **changes):
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    d = json.load(f)
  d.update(changes)
  with open(path, "w") as f:
    json.dump(d, f)


def _gpt2(folder):
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": VOCAB,
               "n_embd": 64, "n_layer": 2, "n_head": 4}, f)


def _drop_tensor(folder):
  t = _tensors(folder)
  del t["model.layers.1.mlp.up_proj.weight"]
  _resave(folder, t)


def _misshape_tensor(folder):
  t = _tensors(folder)
  t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
  _resave(folder, t)


def _extra_tensor(folder):
  t = _tensors(folder)
  t["model.layers.0.self_attn.rope_thing.weight"] = np.zeros((3,), np.float32)
  _resave(folder, t)


def _untie_lm_head(folder):  # llama_mha is untied: declare it tied while lm_head differs
  _edit_config(folder, tie_word_embeddings=True)


def _corrupt_config(folder):
  with open(os.path.join(folder, "config.json"), "w") as f:
    f.write("{oops")


def _truncate_weights(folder):
  path = os.path.join(folder, "model.safetensors")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def _big_tokenizer(folder):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {f"t{i}": i for i in range(VOCAB + 20)}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(folder, "tokenizer.json"))


_BAD_CHECKPOINTS = {
    "unknown_architecture": (_gpt2, r"unsupported architecture GPT2LMHeadModel"),
    "missing_tensor": (_drop_tensor, r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    "misshaped_tensor": (_misshape_tensor,
                         r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(16, 64\)"),
    "unexpected_tensor": (_extra_tensor, r"does not use.*rope_thing"),
    "tied_but_lm_head_differs": (_untie_lm_head, r"tie_word_embeddings.*lm_head\.weight differs"),
    "corrupt_safetensors": (_truncate_weights, r"corrupt safetensors file .*model\.safetensors"),
    "no_weights": (lambda d: os.remove(os.path.join(d, "model.safetensors")), r"no weights in"),
    "missing_config": (lambda d: os.remove(os.path.join(d, "config.json")), r"no config\.json"),
    "corrupt_config": (_corrupt_config, r"not valid JSON"),
    "gelu_activation": (lambda d: _edit_config(d, hidden_act="gelu"), r"unsupported hidden_act"),
    "sliding_window": (lambda d: _edit_config(d, use_sliding_window=True), r"sliding-window"),
    "tokenizer_larger_than_vocab": (_big_tokenizer,
                                    r"tokenizer .* 231 tokens .* vocab_size is 211"),
}


@pytest.mark.parametrize("case", list(_BAD_CHECKPOINTS))
def test_load_target_rejects_bad_checkpoints(hf_checkpoint, tmp_path, case):
  """A broken checkpoint folder raises ValueError naming the problem (never a KeyError, a
  safetensors/torch exception, or a silently wrong model)."""
  folder = tmp_path / "ckpt"
  shutil.copytree(hf_checkpoint("llama_mha").path, folder)
  specjax.load_target(folder)  # the unmodified copy loads
  mutate, message = _BAD_CHECKPOINTS[case]
  mutate(os.fspath(folder))
  with pytest.raises(ValueError, match=message):
    specjax.load_target(folder)


def test_load_target_missing_folder(tmp_path):
  """A folder that does not exist is reported as such."""
  with pytest.raises(ValueError, match="does not exist"):
    specjax.load_target(tmp_path / "nope")


_BAD_CALLS = {
    "token_id_too_large": (dict(prompts=[[1, 2], [3, VOCAB]]), r"prompt 1 .*token id 211"),
    "negative_token_id": (dict(prompts=[[1, -1]]), r"prompt 0 .*token id -1"),
    "empty_prompt": (dict(prompts=[[1, 2], []]), r"prompt 1 is empty"),
    "no_prompts": (dict(prompts=[]), r"no prompts"),
    "single_prompt_not_in_a_list": (dict(prompts=[1, 2, 3]), r"list of prompts"),
    "text_without_tokenizer": (dict(prompts=["hello"]), r"no tokenizer"),
    "beyond_context": (dict(prompts=[[1] * 500], max_new_tokens=13),
                       r"500 \+ max_new_tokens 13 exceeds .* 512"),
    "max_new_tokens_zero": (dict(max_new_tokens=0), r"max_new_tokens must be >= 1"),
    "eos_outside_vocab": (dict(eos_token_id=VOCAB), r"eos_token_id 211 outside"),
    "negative_temperature": (dict(temperature=-0.5), r"temperature must be >= 0"),
    "nan_temperature": (dict(temperature=float("nan")), r"temperature must be >= 0"),
    "top_p_zero": (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
    "negative_top_k": (dict(temperature=1.0, top_k=-1), r"top_k must be >= 0"),
}


@pytest.mark.parametrize("case", list(_BAD_CALLS))
def test_generate_rejects_bad_input(qwen, case):
  """Bad prompts or settings raise ValueError naming the problem, before anything is compiled."""
  changes, message = _BAD_CALLS[case]
  kwargs = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | changes
  with pytest.raises(ValueError, match=message):
    specjax.generate(qwen, kwargs.pop("prompts"), **kwargs)
