"""Bad inputs to `generate`, `SamplingConfig` and the drafter builders, in one table.

Each case must raise a ValueError whose message names the argument and what it may be (its
range or type): never a TypeError or a JSONDecodeError from deep inside, never a silent
coercion (`int(b"a")`-style ids, seeds read modulo 2**32). All but the non-finite-logits case
fail before anything is compiled, so the table runs fast.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

import specjax
from specjax import drafters
from specjax.drafters import io
from specjax.drafters.base import NoDrafter
from specjax.sampling import SamplingConfig
from tests.helpers import tiny_targets as tt

V = tt.GREEDY_VOCAB  # 96; context 256
OTHER_VOCAB_CONFIG = tt.config(V + 4, num_layers=1)
THREE_LAYER_CONFIG = tt.config(V, num_layers=3)


@functools.cache
def _target():
  return tt.greedy_target()


@functools.cache
def _other_vocab():
  return tt.scaled_target(OTHER_VOCAB_CONFIG, seed=3)


@functools.cache
def _three_layers():
  return specjax.Target.random(THREE_LAYER_CONFIG, seed=0)


@functools.cache
def _one_layer():
  return tt.draft_target()


def gen(target=None, prompts=((1, 2, 3),), **kwargs):
  """A call of generate on the tiny greedy target (4 new tokens unless overridden)."""
  prompts = [list(p) for p in prompts] if isinstance(prompts, tuple) else prompts
  kwargs = dict(max_new_tokens=4) | kwargs
  return lambda: specjax.generate(target or _target(), prompts, **kwargs)


def build(name, target=None, **options):
  return lambda: drafters.build(name, target or _target(), **options)


def learned(method, **tree_options):
  return lambda: io.init_drafter(method, _target(), **tree_options)


def foreign_drafter(make, other):
  """generate with `other` and a drafter built for the greedy target."""
  return lambda: specjax.generate(other(), [[1, 2, 3]], max_new_tokens=2, drafter=make())


def _nan_target():
  t = _target()
  return t.replace(params=jax.tree.map(lambda x: x * np.nan, t.params))


CONTEXT = r"\[0, 96\)"
CHOICES = r"choices must be a tree name \(chain4, tree11, tree15, tree6, tree8\), a non-empty list"

CASES = {
    # -- prompts ---------------------------------------------------------------------------------
    "bytes_prompt": (gen(prompts=[b"abc"]), ValueError, r"prompt 0 is bytes: decode it to text"),
    "bytes_prompts": (gen(prompts=b"abc"), ValueError, r"prompts is bytes: decode it to text"),
    "float_token": (gen(prompts=[[1.7]]), ValueError,
                    r"prompt 0 token 0 is 1\.7 \(float\): token ids must"),
    "str_token": (gen(prompts=[[1, "1"]]), ValueError,
                  r"prompt 0 token 1 is '1' \(str\): token ids must"),
    "bool_token": (gen(prompts=[[True]]), ValueError,
                   r"prompt 0 token 0 is True \(bool\): token ids must"),
    "np_float_token": (gen(prompts=[[np.float32(2)]]), ValueError,
                       r"\(float32\): token ids must be ints"),
    "float_list": (gen(prompts=[[1, 2], [1.5, 2.0]]), ValueError,
                   r"prompt 1 token 0 is 1\.5 \(float\)"),
    "float_array": (gen(prompts=[np.array([1.0, 2.0])]), ValueError,
                    r"prompt 0 must be a 1-D integer array of token ids, got dtype float64"),
    "none_prompt": (gen(prompts=[None]), ValueError,
                    r"prompt 0 must be a string or a sequence of int token ids, got None"),
    "none_prompts": (gen(prompts=None), ValueError,
                     r"prompts must be a list of prompts .* got NoneType"),
    "single_prompt_not_in_a_list": (gen(prompts=[1, 2, 3]), ValueError,
                                    r"list of prompts.*not a single"),
    "empty_prompt": (gen(prompts=[[1, 2], []]), ValueError, r"prompt 1 is empty"),
    "no_prompts": (gen(prompts=[]), ValueError, r"no prompts given"),
    "token_id_too_large": (gen(prompts=[[1, 2], [3, V]]), ValueError,
                           rf"prompt 1 has token id 96 outside the vocabulary {CONTEXT}"),
    "negative_token_id": (gen(prompts=[[1, -1]]), ValueError,
                          rf"token id -1 outside the vocabulary {CONTEXT}"),
    "text_without_tokenizer": (gen(prompts=["hello"]), ValueError, r"no tokenizer: pass token ids"),
    # -- lengths ---------------------------------------------------------------------------------
    "beyond_context": (gen(prompts=[[1] * 250], max_new_tokens=10), ValueError,
                       r"prompt length 250 \+ max_new_tokens 10 exceeds the model's context of "
                       r"256 tokens"),
    "max_new_tokens_zero": (gen(max_new_tokens=0), ValueError,
                            r"max_new_tokens must be >= 1, got 0"),
    "max_new_tokens_float": (gen(max_new_tokens=2.5), ValueError,
                             r"max_new_tokens must be an int, got 2\.5 \(float\)"),
    "max_new_tokens_bool": (gen(max_new_tokens=True), ValueError,
                            r"max_new_tokens must be an int, got True"),
    "pad_to_shorter": (gen(prompts=[[1] * 5, [2] * 12], pad_to=8), ValueError,
                       r"pad_to=8 is shorter than the longest prompt \(12\)"),
    "pad_to_float": (gen(pad_to=16.0), ValueError, r"pad_to must be an int, got 16\.0 \(float\)"),
    # -- eos, seed -------------------------------------------------------------------------------
    "eos_bool": (gen(eos_token_id=True), ValueError,
                 r"eos_token_id must be an int, a sequence of ints, or None / \[\], got True"),
    "eos_float_in_list": (gen(eos_token_id=[1, 2.0]), ValueError,
                          r"eos_token_id must be an int.*got 2\.0"),
    "eos_outside_vocab": (gen(eos_token_id=V), ValueError,
                          rf"eos_token_id 96 outside the vocabulary {CONTEXT}"),
    "seed_aliasing": (gen(seed=2**32 + 5), ValueError,
                      r"seed must be an int in \[0, 2\*\*32\), got 4294967301"),
    "seed_huge": (gen(seed=2**70), ValueError, r"seed must be an int in \[0, 2\*\*32\)"),
    "seed_negative": (gen(seed=-1), ValueError, r"seed must be an int in \[0, 2\*\*32\), got -1"),
    "seed_str": (gen(seed="1"), ValueError, r"seed must be an int, got '1' \(str\)"),
    "seed_float": (gen(seed=1.0), ValueError, r"seed must be an int, got 1\.0 \(float\)"),
    # -- sampling --------------------------------------------------------------------------------
    "top_k_float": (gen(temperature=1.0, top_k=2.5), ValueError,
                    r"top_k must be an int, got 2\.5 \(float\)"),
    "negative_top_k": (gen(temperature=1.0, top_k=-1), ValueError, r"top_k must be >= 0, got -1"),
    "temperature_str": (gen(temperature="0.7"), ValueError,
                        r"temperature must be a number, got '0\.7'"),
    "temperature_bool": (lambda: SamplingConfig(True), ValueError,
                         r"temperature must be a number, got True"),
    "negative_temperature": (gen(temperature=-1), ValueError,
                             r"temperature must be >= 0 \(0: greedy\), got"),
    "nan_temperature": (gen(temperature=float("nan")), ValueError,
                        r"temperature must be >= 0 .*got nan"),
    "inf_temperature": (gen(temperature=float("inf")), ValueError,
                        r"temperature must be finite, got inf"),
    "tiny_temperature": (gen(temperature=1e-45), ValueError,
                         r"temperature must be 0 \(greedy\) or >= 0\.0001 .*got 1e-45"),
    "top_p_zero": (gen(temperature=1.0, top_p=0), ValueError,
                   r"top_p must be in \(0, 1\], got 0\.0"),
    "top_p_above_one": (gen(temperature=1.0, top_p=1.5), ValueError,
                        r"top_p must be in \(0, 1\], got 1\.5"),
    "top_p_str": (gen(temperature=1.0, top_p="0.9"), ValueError,
                  r"top_p must be a number, got '0\.9'"),
    # -- the drafter argument --------------------------------------------------------------------
    "drafter_name": (gen(drafter="eagle"), ValueError,
                     r"not the name 'eagle': pass specjax\.drafters\.build\('eagle', target\)"),
    "drafter_not_a_drafter": (gen(drafter=object()), ValueError,
                              r"Drafter protocol \(num_nodes, .*\): object has no num_nodes"),
    "drafter_hidden_layer_out_of_range": (gen(drafter=NoDrafter(hidden_layers=(5,))), ValueError,
                                          r"hidden_layers holds 5: .* ints in \[0, 2\]"),
    "prompt_lookup_other_vocab": (
        foreign_drafter(build("prompt_lookup"), _other_vocab), ValueError,
        r"built for another target \(vocab_size 96, this target has 100\)"),
    "draft_lm_other_vocab_in_generate": (
        foreign_drafter(lambda: drafters.build("draft_lm", _target(), draft=_one_layer()),
                        _other_vocab), ValueError,
        r"built for another target \(vocab_size 96, this target has 100\)"),
    "eagle_other_depth_in_generate": (
        foreign_drafter(lambda: io.init_drafter("eagle", _target()), _three_layers), ValueError,
        r"built for another target \(num_layers 2, this target has 3\)"),
    # -- builders --------------------------------------------------------------------------------
    "unknown_drafter": (build("no_such_drafter"), ValueError,
                        r"unknown drafter 'no_such_drafter'; registered"),
    "prompt_lookup_float_tokens": (build("prompt_lookup", num_tokens=3.5), ValueError,
                                   r"prompt_lookup num_tokens must be an int, got 3\.5"),
    "prompt_lookup_no_branches": (build("prompt_lookup", num_branches=0), ValueError,
                                  r"prompt_lookup num_branches must be in \[1, 85\], got 0"),
    "prompt_lookup_bool_ngram": (build("prompt_lookup", max_ngram=True), ValueError,
                                 r"prompt_lookup max_ngram must be an int, got True"),
    "prompt_lookup_ngram_order": (build("prompt_lookup", min_ngram=3, max_ngram=2), ValueError,
                                  r"need 1 <= min_ngram <= max_ngram, got 3, 2"),
    "prompt_lookup_size_past_the_tree": (build("prompt_lookup", num_tokens=2, num_branches=2,
                                               verify_sizes=(0, 5)), ValueError,
                                         r"prompt_lookup verify_sizes entry must be in \[0, 4\], "
                                         r"got 5"),
    "ngram_float_tokens": (build("ngram", num_tokens=3.5), ValueError,
                           r"ngram num_tokens must be an int, got 3\.5"),
    "ngram_ngram_order": (build("ngram", min_ngram=3, max_ngram=2), ValueError,
                          r"need 1 <= min_ngram <= max_ngram, got 3, 2"),
    "ngram_negative_scale": (build("ngram", match_scale=-1), ValueError,
                             r"ngram match_scale must be > 0 \(or None: fixed length\), got -1"),
    "ngram_str_scale": (build("ngram", match_scale="1"), ValueError,
                        r"ngram match_scale must be a number, got '1'"),
    "ngram_size_past_the_draft": (build("ngram", num_tokens=4, verify_sizes=(0, 5)), ValueError,
                                  r"ngram verify_sizes entry must be in \[0, 4\], got 5"),
    "ngram_size_not_an_int": (build("ngram", verify_sizes=(0, 2.5)), ValueError,
                              r"ngram verify_sizes entry must be an int, got 2\.5"),
    "ngram_sizes_a_str": (build("ngram", verify_sizes="0,3"), ValueError,
                          r"ngram verify_sizes must be a list of ints, got '0,3'"),
    "drafter_verify_size_out_of_range": (
        gen(drafter=drafters.build("ngram", None, num_tokens=4).replace(verify_sizes=(9,))),
        ValueError, r"drafter\.verify_sizes holds 9: sizes are ints in \[0, 4\]"),
    "token_recycling_k_above_vocab": (build("token_recycling", k=9000), ValueError,
                                      r"k=9000 exceeds the vocabulary: token_recycling k must be "
                                      r"in \[2, 96\]"),
    "token_recycling_k_huge": (build("token_recycling", k=100_000), ValueError,
                               r"k must be in \[2, 96\]"),
    "token_recycling_k_too_small": (build("token_recycling", k=1), ValueError,
                                    r"k=1 is smaller than the template's largest rank \+ 1: "
                                    r"token_recycling k must be in \[2, 96\]"),
    "token_recycling_k_zero": (build("token_recycling", k=0), ValueError,
                               r"k must be in \[2, 96\]"),
    "token_recycling_k_float": (build("token_recycling", k=2.0), ValueError,
                                r"token_recycling k must be an int, got 2\.0"),
    "token_recycling_no_paths": (build("token_recycling", paths=[]), ValueError,
                                 r"paths must hold at least one rank path"),
    "token_recycling_paths_name": (build("token_recycling", paths="tree8"), ValueError,
                                   r"paths must be a sequence of rank paths"),
    "layer_skip_too_many_layers": (build("layer_skip", num_layers=2), ValueError,
                                   r"layer_skip num_layers must be in \[1, 1\], got 2"),
    "layer_skip_float_layers": (build("layer_skip", num_layers=1.0), ValueError,
                                r"layer_skip num_layers must be an int, got 1\.0"),
    "layer_skip_no_tokens": (build("layer_skip", num_tokens=0), ValueError,
                             r"layer_skip num_tokens must be in \[1, 256\], got 0"),
    "layer_skip_one_layer_target": (lambda: drafters.build("layer_skip", _one_layer()),
                                    ValueError,
                                    r"layer_skip needs a target with at least 2 layers"),
    "draft_lm_other_vocab": (lambda: drafters.build("draft_lm", _target(),
                                                    draft=_other_vocab()), ValueError,
                             r"draft LM vocab_size 100 != target vocab_size 96"),
    "draft_lm_float_tokens": (build("draft_lm", draft=None, num_tokens=1.5), ValueError,
                              r"draft_lm num_tokens must be an int, got 1\.5"),
    "draft_lm_not_a_target": (build("draft_lm", draft="small"), ValueError,
                              r"draft_lm draft must be a loaded specjax\.Target, got str"),
    # -- learned drafters' tree options ----------------------------------------------------------
    "medusa_empty_choices": (learned("medusa", choices=[]), ValueError, CHOICES + r".*got \[\]"),
    "medusa_unknown_tree": (learned("hydra", choices="tree99"), ValueError,
                            CHOICES + r".*got 'tree99'"),
    "medusa_float_rank": (learned("medusa", choices=[[0.5]]), ValueError, CHOICES),
    "medusa_tree_too_deep": (learned("medusa", choices=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0],
                                                        [0, 0, 0, 0, 0]]), ValueError,
                             r"tree depth 5 exceeds the drafter's 4 heads"),
    "eagle_float_depth": (learned("eagle", depth=2.5), ValueError,
                          r"depth must be an int, got 2\.5"),
    "eagle_top_k_zero": (learned("eagle", top_k=0), ValueError, r"depth and top_k must be >= 1"),
    "eagle_top_k_above_vocab": (learned("eagle3", top_k=V + 1), ValueError,
                                r"top_k 97 exceeds the draft vocabulary \(96\): top_k must be in "
                                r"\[1, 96\]"),
    "eagle_too_many_nodes": (learned("eagle", depth=2, top_k=2, total_tokens=7), ValueError,
                             r"total_tokens must be in \[1, 6\] for depth 2 and top_k 2, got 7"),
    "dflash_depth_beyond_block": (learned("dflash", depth=8), ValueError,
                                  r"depth 8 does not fit the drafter's block: a block of 8 "
                                  r"drafts depths 1\.\.7"),
    "dflash_too_many_nodes": (learned("dflash", depth=2, top_k=2, total_tokens=7), ValueError,
                              r"total_tokens must be in \[1, 6\] for depth 2 and top_k 2"),
    "dflash_top_k_above_vocab": (learned("dflash", top_k=V + 1), ValueError,
                                 r"top_k must be in \[1, 96\] \(the draft vocabulary\), got 97"),
    "recent_tokens_negative": (learned("medusa", recent_tokens=-1), ValueError,
                               r"recent_tokens must be >= 0, got -1"),
    "recent_tokens_float": (learned("eagle", recent_tokens=2.5), ValueError,
                            r"recent_tokens must be an int >= 0, got 2\.5"),
    "recent_tokens_beyond_context": (learned("eagle", recent_tokens=300), ValueError,
                                     r"recent_tokens must be in \[0, 256\]"),
    # -- the target's numbers (compiles one tiny program) ----------------------------------------
    "nan_weights": (lambda: specjax.generate(_nan_target(), [[1, 2, 3]], max_new_tokens=2),
                    ValueError,
                    r"the target's logits are not finite \(NaN/inf weights\?\) for prompt 0"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_raises_value_error_naming_it(case):
  call, error, message = CASES[case]
  with pytest.raises(error, match=message):
    call()
