# ---
# jupyter:
#   accelerator: TPU
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # specjax on a Colab TPU: lossless speculative decoding on a device mesh
#
# This notebook runs specjax end to end on every core of a TPU:
#
# 1. lays the target model out on a device mesh over all cores and shows what each core holds;
# 2. decodes a few prompts (HumanEval's, or your own) autoregressively and with three drafters,
#    and tabulates tau (tokens per target call), tokens/s, the speedup over autoregressive decoding
#    and whether the output is identical to autoregressive decoding (it must be: the drafters
#    change speed, never output), with the acceptance rate by draft depth as a plot;
# 3. trains a drafter for a few steps with the trainer's Python API and decodes with it;
# 4. writes a drafter of its own in one cell, registers it and checks it lossless.
#
# **Runtime.** *Runtime > Change runtime type > TPU*. A TPU v2-8 has 8 cores of 8 GB each; the
# embedded target (a 6-layer Qwen3-architecture code LM, about 26 MB in float32) fits on each of
# them many times over, so the default mesh puts every core on the `data` axis (batch rows) and
# replicates the parameters. A larger target of your own (`MODEL_DIR`) can split over the
# `model` axis instead (`MESH = "dp=2,tp=4"`: tensor parallelism over 4 cores).
#
# The notebook runs anywhere JAX does (CI executes it on CPU with 8 emulated devices and the
# small settings of `tests/test_notebook.py`); the figures it shows are measured where it runs.

# %% tags=["parameters"]
INSTALL = True  # pip-install jax[tpu] and specjax first (CI runs the notebook with False)
REPO_URL = None  # the git URL of the specjax repository to install from: set it when INSTALL
MODEL_DIR = None  # None: the embedded target; else an HF folder (e.g. "/content/drive/MyDrive/m")
MESH = None  # None: every device on the data axis; or a spec such as "dp=2,tp=4"
PROMPTS = None  # None: HumanEval prompts; or a list of text prompts
NUM_PROMPTS = 8  # HumanEval prompts to decode (in one batch)
MAX_PROMPT_TOKENS = 256  # the end of longer prompts is kept
MAX_NEW_TOKENS = 128
METHODS = ("eagle", "medusa", "prompt_lookup")  # those drafters.available(target) offers run
TRAIN_METHOD = "medusa"  # a learned family: medusa, hydra, eagle, eagle3
TRAIN_STEPS = 100
TRAIN_ROWS = 512  # self-distilled training rows (the target's own continuations of the corpus)
TRAIN_SOURCE_DIR = None  # None: this Python's standard library; or a folder of .py files
TRAIN_OVERRIDES = ()  # further "field=value" settings of the training config, as --set takes them
DATA_DIR = None  # TFDS data dir of the corpora (None: specjax's cache, ~/.cache/specjax)
WORKDIR = "runs/colab"  # the training run's checkpoints and exported drafter

# %% [markdown]
# ## Install
#
# JAX for TPUs and specjax from its repository (set `REPO_URL` above). This cell runs before
# anything imports JAX, so no runtime restart is needed after it.

# %%
import subprocess
import sys

if INSTALL:
  if not REPO_URL:
    raise ValueError("set REPO_URL (the parameters cell) to the git URL of the specjax "
                     "repository, or INSTALL = False where specjax is already installed")
  subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "jax[tpu]",
                         f"specjax @ git+{REPO_URL}"])

# %% [markdown]
# ## Google Drive (optional)
#
# A `MODEL_DIR` or `WORKDIR` under `/content/drive` needs Drive mounted; this cell mounts it
# when the notebook runs in Colab and one of them lies there.

# %%
IN_COLAB = "google.colab" in sys.modules
ON_DRIVE = [p for p in (MODEL_DIR, WORKDIR) if p and str(p).startswith("/content/drive")]
if IN_COLAB and ON_DRIVE:
  from google.colab import drive

  drive.mount("/content/drive")
print(f"in Colab: {IN_COLAB}; paths on Drive: {ON_DRIVE or 'none'}")

# %% [markdown]
# ## Devices and the mesh
#
# `sharding.make_mesh(MESH)` builds a (data, model) mesh over all devices; `target.on_mesh(mesh)`
# lays the parameters out by specjax's partition rules (q/k/v and MLP projections by columns,
# output projections by rows, embeddings over the vocabulary, norms replicated; KV heads split
# when the model axis divides them, replicated otherwise). `generate` then runs on that mesh.

# %%
import collections
import dataclasses

import jax
import matplotlib.pyplot as plt
from IPython.display import Markdown, display

import specjax
from specjax import assets, drafters, sharding
from specjax.lab import benchmark

devices = jax.devices()
print(f"{len(devices)} {devices[0].platform} devices ({devices[0].device_kind}); "
      f"jax {jax.__version__}")
kinds = collections.Counter(d.device_kind for d in devices)
print("kinds:", dict(kinds))

# %%
base_target = specjax.load_target(MODEL_DIR or assets.TARGET_DIR, dtype="float32")
cfg = base_target.config
print(f"target: {cfg.hf_architecture}, {base_target.num_params / 1e6:.2f}M parameters, "
      f"{cfg.num_layers} layers, {cfg.num_heads} query / {cfg.num_kv_heads} KV heads, "
      f"vocabulary {cfg.vocab_size}")

mesh = sharding.make_mesh(MESH)
target = base_target.on_mesh(mesh)
print("mesh:", sharding.describe(mesh))
per_device = sharding.bytes_per_device(target.params)
total = sum(x.nbytes for x in jax.tree.leaves(base_target.params))
print(f"parameter bytes: {total / 2**20:.1f} MiB in all; per device (id: MiB):",
      {d: round(b / 2**20, 2) for d, b in sorted(per_device.items())})

# %% [markdown]
# The same parameters on the other meshes these devices allow: each core's share shrinks with
# the model axis (tensor parallelism), while the data axis replicates.

# %%
n = len(devices)
rows = ["| mesh | MiB per device (max) | status |", "|---|---|---|"]
for tp in (t for t in (1, 2, 4, 8) if n % t == 0):
  spec = f"dp={n // tp},tp={tp}"
  try:
    placed = base_target.on_mesh(spec).params
  except sharding.ShardingError as e:
    rows.append(f"| {spec} | - | {e} |")
    continue
  rows.append(f"| {spec} | {max(sharding.bytes_per_device(placed).values()) / 2**20:.2f} | ok |")
  del placed
display(Markdown("\n".join(rows)))

# %% [markdown]
# ## Autoregressive decoding and three drafters
#
# The prompts are decoded as one batch (rows split over the data axis; `generate` pads the batch
# to a multiple of it with rows that start finished). Greedy decoding, so every method must emit
# exactly the autoregressive tokens. tokens/s excludes compilation (`stats.compile_seconds`).

# %%
if PROMPTS is None:
  prompt_cfg = benchmark.BenchmarkConfig(num_prompts=NUM_PROMPTS,
                                         max_prompt_tokens=MAX_PROMPT_TOKENS, data_dir=DATA_DIR)
  prompts = benchmark.load_prompts(base_target, "humaneval", prompt_cfg)
else:
  prompts = [base_target.encode(p)[-MAX_PROMPT_TOKENS:] for p in PROMPTS]
print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens")
print(base_target.decode(prompts[0])[-300:])

# %%
results = {}  # name -> GenerateResult


def run(name, drafter=None):
  """Decodes the prompts with `drafter` (None: autoregressive) on the target's mesh."""
  out = specjax.generate(target, prompts, max_new_tokens=MAX_NEW_TOKENS, drafter=drafter)
  results[name] = out
  print(f"{name}: tau {out.stats.tau:.2f}, {out.stats.tokens_per_second:.1f} tokens/s "
        f"(compiled in {out.stats.compile_seconds:.1f} s)")
  return out


def table(names=None):
  """The result table of `names` (default: every run so far) against autoregressive decoding."""
  ar = results["autoregressive"]
  lines = ["| method | tau | tokens/s | speedup | target calls | identical to AR |",
           "|---|---|---|---|---|---|"]
  for name in names or results:
    s = results[name].stats
    lines.append(f"| {name} | {s.tau:.2f} | {s.tokens_per_second:.1f} | "
                 f"{s.tokens_per_second / ar.stats.tokens_per_second:.2f}x | {s.target_calls} | "
                 f"{'yes' if results[name].tokens == ar.tokens else 'NO'} |")
  return Markdown("\n".join(lines))


offered = drafters.available(target)
methods = [m for m in METHODS if m in offered]
print("drafters available for this target:", offered)
print("running:", methods, "| not available:", [m for m in METHODS if m not in offered])
run("autoregressive")
for m in methods:
  run(m, drafters.build(m, target))
display(table())

# %%
for prompt, text in zip(prompts[:2], results["autoregressive"].text):
  print(base_target.decode(prompt)[-200:] + "\033[1m" + text + "\033[0m", end="\n----\n")


# %%
def plot_acceptance(names):
  """alpha_d = P(a depth-d draft node is accepted | its parent was), per method."""
  fig, ax = plt.subplots(figsize=(7, 4))
  for name in names:
    alpha = results[name].stats.acceptance_by_depth
    if alpha:
      ax.plot(range(1, len(alpha) + 1), alpha, marker="o", label=name)
  ax.set(title=f"acceptance rate by depth ({len(prompts)} prompts x {MAX_NEW_TOKENS} tokens)",
         xlabel="draft depth d", ylabel="P(accept d | accepted d-1)", ylim=(0, 1.05))
  ax.legend()
  plt.show()


plot_acceptance(methods)

# %% [markdown]
# ## Training a drafter
#
# A short run of the drafter trainer (`specjax.train.drafter.train_drafter`, the Python API
# behind `python -m experiments.train_drafter`) on the shipped recipe `configs/<method>_stdlib.py`
# with fewer steps and rows: the frozen target's own greedy continuations of standard-library
# prompts (self-distillation, generated once and cached in the workdir), a 2048-token draft
# vocabulary, AdamW. The run checkpoints into `WORKDIR` (running the cell again resumes it) and
# exports a drafter folder, loaded back with `specjax.load_drafter`.
#
# Training runs on the notebook's mesh (batch rows over `data`, params tensor-parallel) when its
# batch size splits over the data axis, else on one device (the next cell prints which). A few
# steps do not make a good drafter: the shipped ones got 600-1800.

# %%
import os

from specjax.config_utils import apply_overrides, load_config
from specjax.train.drafter import train_drafter

workdir = os.path.join(WORKDIR, TRAIN_METHOD)
train_cfg = load_config(f"configs.{TRAIN_METHOD}_stdlib")
train_cfg = apply_overrides(train_cfg, [
    f"optim.total_steps={TRAIN_STEPS}", f"optim.warmup_steps={max(1, TRAIN_STEPS // 10)}",
    f"distill_rows={TRAIN_ROWS}", f"log_every={max(1, TRAIN_STEPS // 50)}",
    f"eval_every={TRAIN_STEPS}", f"save_every={TRAIN_STEPS}", "export_dtype=float32",
    *TRAIN_OVERRIDES])
train_cfg = dataclasses.replace(
    train_cfg, target_path=MODEL_DIR, source_dir=TRAIN_SOURCE_DIR, data_dir=DATA_DIR,
    workdir=workdir, export_dir=os.path.join(workdir, "export"),
    distill_cache=os.path.join(WORKDIR, "self_distill"))
if train_cfg.batch_size % sharding.data_size(mesh) == 0:
  train_cfg = dataclasses.replace(train_cfg, mesh=sharding.mesh_spec(mesh))
  print("training on the mesh", sharding.mesh_spec(mesh))
else:  # every data shard takes the same number of rows
  print(f"training on one device: batch_size {train_cfg.batch_size} does not split over "
        f"dp={sharding.data_size(mesh)}")
summary = train_drafter(train_cfg, target=base_target)
meta = summary["metadata"]
print(f"{meta['steps']} steps, {meta['tokens_seen']} tokens in {meta['wall_seconds']} s; "
      f"held-out top-1 agreement by depth {meta['heldout_agreement_by_depth']}, "
      f"chain tau {meta['heldout_chain_tau']}")

# %%
losses = [(r["step"], r["loss"]) for r in summary["history"] if "loss" in r]
if losses:
  plt.figure(figsize=(6, 3))
  plt.plot(*zip(*losses), marker=".")
  plt.gca().set(title=f"{TRAIN_METHOD} training loss", xlabel="step", ylabel="loss")
  plt.show()

trained = specjax.load_drafter(summary["export_dir"], target)
trained_out = run(f"{TRAIN_METHOD} ({meta['steps']} steps)", trained)
assert trained_out.tokens == results["autoregressive"].tokens, "the drafter changed the output"

# %% [markdown]
# ## A drafter of your own
#
# A drafter is a pytree with `init`, `draft` and `update` (`specjax/drafters/base.py`), all pure
# and traced inside the jitted decoding loop, plus static `num_nodes` and `hidden_layers`. This
# one keeps a state: for each row, the latest position at which each token was followed by
# another (`last[b, v]`), built from the prompt in `init` and extended with the verified tokens
# in `update`; `draft` follows it from the pending token for `num_tokens` steps, a chain (a
# bigram model of the text so far). Its children are chosen deterministically (its trees carry
# no q), so verification keeps greedy and sampled output exact. Registered with
# `drafters.register`, it is built like any shipped drafter (and the benchmark would pick it up).

# %%
import jax.numpy as jnp
from flax import struct

from specjax import trees
from specjax.drafters.base import TargetFacts


@struct.dataclass
class Bigram:
  num_tokens: int = struct.field(pytree_node=False, default=4)
  vocab_size: int = struct.field(pytree_node=False, default=0)
  hidden_layers: tuple[int, ...] = struct.field(pytree_node=False, default=())
  built_for: TargetFacts | None = struct.field(pytree_node=False, default=None)

  @property
  def num_nodes(self) -> int:
    return self.num_tokens

  def _learn(self, last, history, hist_len, lo):
    """last[v] = max(last[v], t) for t in [lo, hist_len) where history[t - 1] == v (one row)."""
    t = jnp.arange(1, history.shape[0])
    prev = jnp.where((t >= lo) & (t < hist_len), history[:-1], self.vocab_size)  # dropped
    return last.at[prev].max(t, mode="drop")

  def init(self, target, prefill):
    last = jnp.zeros((prefill.history.shape[0], self.vocab_size), jnp.int32)
    return jax.vmap(self._learn)(last, prefill.history, prefill.hist_len,
                                 jnp.zeros_like(prefill.hist_len))

  def draft(self, target, state, ctx):
    def row(last, history, pending):
      tokens, ok, cur, alive = [], [], pending, jnp.bool_(True)
      for _ in range(self.num_tokens):
        pos = last[cur]
        alive &= pos > 0
        cur = history[pos]
        tokens.append(cur)
        ok.append(alive)
      return jnp.stack(tokens), jnp.stack(ok)

    tokens, valid = jax.vmap(row)(state, ctx.history, ctx.pending)
    return trees.chain(tokens, valid=valid), state, ctx.cache

  def update(self, target, state, result):
    # A round emits at most num_tokens + 1 tokens: re-learning a few more is harmless (max).
    lo = jnp.maximum(result.hist_len - self.num_tokens - 1, 1)
    return jax.vmap(self._learn)(state, result.history, result.hist_len, lo)


@drafters.register("bigram", description="follows the latest bigram of prompt + output")
def build_bigram(target, *, num_tokens: int = 4) -> Bigram:
  return Bigram(num_tokens=num_tokens, vocab_size=target.config.vocab_size,
                built_for=TargetFacts.of(target.config))


print("bigram" in drafters.available(target))
mine = run("bigram", drafters.build("bigram", target, num_tokens=4))
assert mine.tokens == results["autoregressive"].tokens, "the drafter changed the output"
print("bigram output identical to autoregressive decoding")

# %% [markdown]
# ## All runs

# %%
display(table())
plot_acceptance([name for name in results if name != "autoregressive"])
assert all(r.tokens == results["autoregressive"].tokens for r in results.values())
