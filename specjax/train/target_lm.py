"""Training a causal LM (the embedded target or the draft LM) on the stdlib-code corpus.

The pipeline, each step resumable: build the TFDS dataset -> train (or reuse) a byte-level BPE
tokenizer saved in the workdir -> tokenize and pack the corpus (cached) -> optax training with
orbax checkpoints -> export an HF folder (`save_hf`) with `tokenizer.json` and `metadata.json`.
The export's `tokenizer_config.json` carries the corpus encoding (literal special-token text
stays text), so `load_target` and transformers encode prompts as training encoded the corpus.
With `mesh` set (e.g. "dp=4,tp=2") the run trains on that device mesh: the decoder tensor
parallel over `model` by `specjax.sharding`'s rules, each batch split over `data`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import sysconfig
from typing import Annotated, Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax import files, provenance, sharding
from specjax.config_utils import Ge, NonEmptyStr, NonNegInt, PosInt, Seed, config, to_dict
from specjax.data import pipeline, stdlib_code
from specjax.data import tokenizer as tokenizer_lib
from specjax.interop.hf import save_hf
from specjax.interop.tokenizer import load_tokenizer
from specjax.models import decoder
from specjax.models.config import ModelConfig
from specjax.target import Target
from specjax.train import loop
from specjax.train.optim import OptimConfig, make_optimizer


@config
class DataConfig:
  data_dir: NonEmptyStr | None = None  # TFDS data dir (default: $SPECJAX_DATA_DIR or the cache)
  source_dir: NonEmptyStr | None = None  # a folder of .py files instead of the stdlib (tests)
  tokenizer_path: NonEmptyStr | None = None  # reuse this tokenizer.json instead of training one


@config
class LMTrainConfig:
  """An LM training run. `model.vocab_size` must equal the tokenizer's vocabulary size."""

  model: ModelConfig
  optim: OptimConfig
  data: DataConfig = DataConfig()
  seq_len: Annotated[int, Ge(2)] = 512
  batch_size: PosInt = 16
  # Sequence-length curriculum: the last `long_steps` steps train on `long_seq_len`-token rows
  # (batch shrunk to keep tokens per step), so the model learns its full context cheaply.
  long_steps: NonNegInt = 0
  long_seq_len: Annotated[int, Ge(2)] = 1024
  seed: Seed = 0
  log_every: PosInt = 10
  eval_every: PosInt = 250
  save_every: PosInt = 250
  eval_rows: PosInt = 64  # held-out rows scored at each periodic evaluation (all at the end)
  # Device mesh to train on, a `specjax.sharding` spec such as "dp=4,tp=2" over every device
  # (None: one device). Not a run setting: a checkpoint resumes on any mesh.
  mesh: NonEmptyStr | None = None
  workdir: NonEmptyStr = "runs/target_stdlib"
  export_dir: NonEmptyStr | None = None  # default: <workdir>/export
  export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"

  def __post_init__(self):
    if self.mesh is not None:
      sharding.check_mesh_spec(self.mesh)
    if self.long_steps >= self.optim.total_steps:
      raise ValueError(f"long_steps ({self.long_steps}) must be < optim.total_steps "
                       f"({self.optim.total_steps}): they are the run's last steps")
    longest = self.long_seq_len if self.long_steps else self.seq_len
    self.model.check_window(longest, "the training sequence length")
    if longest > self.model.max_position_embeddings:
      raise ValueError(f"sequence length {longest} exceeds the model's context "
                       f"{self.model.max_position_embeddings}")
    if self.long_steps and (self.batch_size * self.seq_len) % self.long_seq_len:
      raise ValueError(f"batch_size * seq_len ({self.batch_size * self.seq_len}) must be a "
                       f"multiple of long_seq_len ({self.long_seq_len})")

  @property
  def final_seq_len(self) -> int:
    return self.long_seq_len if self.long_steps else self.seq_len

  @property
  def long_batch_size(self) -> int:
    """Rows per step of the long-context phase (the same tokens per step as the short one)."""
    return self.batch_size * self.seq_len // self.long_seq_len


def lm_loss(cfg: ModelConfig, params, batch: pipeline.LMBatch):
  """Mean next-token cross-entropy (nats/token) of `targets` given `inputs`, in float32."""
  logits = decoder.full_forward(cfg, params, batch.inputs).logits.astype(jnp.float32)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets).mean()
  return loss, {}


def make_evaluator(cfg: ModelConfig, batches: list[pipeline.LMBatch]):
  """Returns `params -> {"heldout_loss": nats/token}` averaged over all tokens of `batches`."""
  score = jax.jit(lambda p, b: lm_loss(cfg, p, b)[0] * b.targets.size)

  def evaluate(params) -> dict[str, float]:
    total = sum(float(score(params, b)) for b in batches)
    return {"heldout_loss": total / sum(b.targets.size for b in batches)}

  return evaluate


def unigram_baseline(train_stream: np.ndarray, heldout_stream: np.ndarray, vocab: int) -> float:
  """Cross-entropy (nats/token) of add-one-smoothed train unigram frequencies on held-out tokens."""
  counts = np.bincount(train_stream, minlength=vocab).astype(np.float64) + 1.0
  logp = np.log(counts / counts.sum())
  return float(-logp[heldout_stream].mean())


def _tokenizer(cfg: LMTrainConfig, train_texts):
  path = os.path.join(cfg.workdir, "tokenizer.json")
  if cfg.data.tokenizer_path:
    tok = tokenizer_lib.for_corpus(load_tokenizer(cfg.data.tokenizer_path))
  elif os.path.exists(path):  # resuming: never retrain, the checkpoints depend on these ids
    tok = tokenizer_lib.for_corpus(load_tokenizer(path))
  else:
    tok = tokenizer_lib.train_tokenizer(train_texts, vocab_size=cfg.model.vocab_size)
  if tok.get_vocab_size() != cfg.model.vocab_size:
    raise ValueError(f"tokenizer vocabulary ({tok.get_vocab_size()}) != model vocab_size "
                     f"({cfg.model.vocab_size}); set model.vocab_size to match the tokenizer")
  tokenizer_lib.save_tokenizer(tok, path)
  return tok


@dataclasses.dataclass
class PreparedData:
  tokenizer: Any
  train_stream: np.ndarray  # int32[n]: the train split, documents joined by EOS
  heldout_stream: np.ndarray
  corpus: dict[str, Any]  # what the dataset builder recorded (python version, split sizes, ...)


def prepare_data(cfg: LMTrainConfig) -> PreparedData:
  """Builds the dataset, trains or reloads the tokenizer and tokenizes (cached) both splits."""
  os.makedirs(cfg.workdir, exist_ok=True)
  train = stdlib_code.load_stdlib_code("train", cfg.data.data_dir, cfg.data.source_dir)
  heldout = stdlib_code.load_stdlib_code("heldout", cfg.data.data_dir, cfg.data.source_dir)
  for name, split in (("train", train), ("heldout", heldout)):
    if len(split) == 0:
      raise ValueError(f"the {name} split of {cfg.data.source_dir or 'the stdlib'} is empty; "
                       "a source folder needs enough .py files for both splits (~2% held out)")
  train_texts = [ex["text"] for ex in train]
  tok = _tokenizer(cfg, train_texts)
  corpus = stdlib_code.stdlib_metadata(cfg.data.data_dir, cfg.data.source_dir)
  corpus["split_sizes"] = stdlib_code.split_sizes(cfg.data.data_dir, cfg.data.source_dir)
  return PreparedData(tok, pipeline.cached_token_stream(tok, train_texts),
                      pipeline.cached_token_stream(tok, [ex["text"] for ex in heldout]), corpus)


def batch_stream(cfg: LMTrainConfig, train_stream: np.ndarray):
  """`start_step -> iterator` over the curriculum: short rows first, `long_seq_len` rows last."""
  short = pipeline.TrainBatches(pipeline.pack_stream(train_stream, cfg.seq_len), cfg.batch_size,
                                cfg.seed)
  switch = cfg.optim.total_steps - cfg.long_steps
  long = None
  if cfg.long_steps:
    long = pipeline.TrainBatches(pipeline.pack_stream(train_stream, cfg.long_seq_len),
                                 cfg.long_batch_size, cfg.seed + 1)

  def iterate(start_step: int):
    step = start_step
    while True:
      yield short[step] if step < switch else long[step - switch]
      step += 1

  return iterate


def training_mesh(cfg: LMTrainConfig):
  """(the mesh `cfg.mesh` names or None, the params' shardings on it or None), checked before any
  work: the spec must match the devices, the batches must split over `data` and the model over
  `model` (tensor parallel by the partition rules of `specjax.sharding`)."""
  if cfg.mesh is None:
    return None, None
  mesh = sharding.make_mesh(cfg.mesh)
  loop.check_batch_size("batch_size", cfg.batch_size, mesh)
  if cfg.long_steps:
    loop.check_batch_size("long-phase batch size (batch_size * seq_len / long_seq_len)",
                          cfg.long_batch_size, mesh)
  return mesh, sharding.param_shardings(cfg.model, decoder.abstract_params(cfg.model), mesh)


def train_lm(cfg: LMTrainConfig, *, stop_after: int | None = None,
             progress: bool = True, overwrite_shipped: bool = False) -> dict[str, Any]:
  """Runs (or resumes) the training described by `cfg`; exports when it reaches the end.

  The summary's `resumed_from` is the checkpoint step this run resumed from (None: a fresh
  start). A non-finite loss or params raise `loop.NonFiniteError`, and nothing is exported.
  An export_dir inside the shipped assets needs `overwrite_shipped=True` (`--overwrite-shipped`),
  checked before any work; the workdir never lies there."""
  loop.check_outputs(cfg.workdir, cfg.export_dir, overwrite_shipped, files.MODEL)
  mesh, param_shardings = training_mesh(cfg)
  loop.check_run_config(cfg.workdir, cfg)
  data = prepare_data(cfg)
  eos = tokenizer_lib.eos_id(data.tokenizer)
  model_cfg = cfg.model.replace(eos_token_id=(eos,), bos_token_id=eos)
  periodic = pipeline.heldout_batches(
      pipeline.pack_stream(data.heldout_stream, cfg.seq_len)[:cfg.eval_rows], cfg.batch_size)
  loop_cfg = loop.LoopConfig(total_steps=cfg.optim.total_steps, log_every=cfg.log_every,
                             eval_every=cfg.eval_every, save_every=cfg.save_every,
                             tokens_per_step=cfg.batch_size * cfg.seq_len)
  n_params = decoder.num_params(decoder.abstract_params(model_cfg))
  result = loop.train(
      lambda p, b: lm_loss(model_cfg, p, b), decoder.init_params(model_cfg, cfg.seed),
      make_optimizer(cfg.optim), batch_stream(cfg, data.train_stream), loop_cfg,
      workdir=os.path.join(cfg.workdir, "checkpoints"),
      evaluate=make_evaluator(model_cfg, periodic), stop_after=stop_after, progress=progress,
      desc=f"train {model_cfg.architecture} {n_params / 1e6:.2f}M", mesh=mesh,
      param_shardings=param_shardings)
  summary: dict[str, Any] = {"step": result.step, "history": result.history,
                             "params": result.params, "finished": False,
                             "resumed_from": result.resumed_from}
  if result.step < cfg.optim.total_steps:
    return summary
  export_dir = cfg.export_dir or os.path.join(cfg.workdir, "export")
  metadata = export(cfg, model_cfg, result, data, export_dir,
                    overwrite_shipped=overwrite_shipped)
  summary.update(finished=True, export_dir=export_dir, metadata=metadata)
  return summary


def export(cfg: LMTrainConfig, model_cfg: ModelConfig, result: loop.TrainResult,
           data: PreparedData, export_dir: str, *, overwrite_shipped: bool = False
           ) -> dict[str, Any]:
  """Writes the HF folder + tokenizer (+ its config) + metadata.json (one atomic folder swap,
  `save_hf`); scores the exported weights held-out."""
  export_cfg = model_cfg.replace(dtype=cfg.export_dtype)
  params = jax.tree.map(lambda x: x.astype(export_cfg.jnp_dtype), result.params)
  # Score what is shipped: the exported weights read back in float32, at the final context.
  eval_params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  seq = cfg.final_seq_len
  heldout = pipeline.heldout_batches(pipeline.pack_stream(data.heldout_stream, seq),
                                     max(1, cfg.batch_size * cfg.seq_len // seq))
  metadata = {
      "model": export_cfg.to_hf_dict(),
      "num_params": decoder.num_params(params),
      "training": to_dict(cfg, strings=portable_path),
      "steps": result.step,
      "tokens_seen": result.step * cfg.batch_size * cfg.seq_len,
      "wall_seconds": round(result.elapsed_seconds, 1),
      "heldout_loss": make_evaluator(model_cfg, heldout)(eval_params)["heldout_loss"],
      "heldout_seq_len": seq,
      "heldout_tokens": int(data.heldout_stream.size),
      "unigram_baseline_loss": unigram_baseline(data.train_stream, data.heldout_stream,
                                                model_cfg.vocab_size),
      "train_tokens": int(data.train_stream.size),
      "corpus": to_dict(data.corpus, strings=portable_path),
      "trainer_python": sys.version.split()[0],
      "provenance": provenance.collect(),  # the config is "training"
  }
  save_hf(Target(export_cfg, params, data.tokenizer), export_dir,
          extra_files={"metadata.json": json.dumps(metadata, indent=2)},
          overwrite_shipped=overwrite_shipped)
  return metadata


def portable_path(text: str) -> str:
  """Shipped metadata names no machine: the interpreter's stdlib becomes `<stdlib of CPython
  X.Y.Z>`, paths under the working directory become relative; other strings pass unchanged."""
  if not os.path.isabs(text):
    return text
  stdlib = sysconfig.get_paths()["stdlib"]
  if os.path.normpath(text) == os.path.normpath(stdlib):
    return f"<stdlib of {platform.python_implementation()} {platform.python_version()}>"
  rel = os.path.relpath(text)
  return text if rel.startswith("..") else rel
