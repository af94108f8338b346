"""Loading a bfloat16 checkpoint streams it: host memory peaks near the model, not at twice it.

A ~250 MB random bfloat16 Llama folder is loaded (`specjax.load_target(dtype="bfloat16")`) in a
fresh process, whose peak resident set is compared with its resident set before the load. A
memory-mapped read would keep every page of the file resident beside the built model (about 2x
the model); tensor-by-tensor reads leave the model plus the largest tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
          "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": True,
          "hidden_act": "silu", "torch_dtype": "bfloat16"}

# The high-water mark is read from /proc/self/status (VmHWM, this address space's own), not from
# getrusage's ru_maxrss: Linux carries ru_maxrss across fork + exec, so a child of a large pytest
# process starts with the parent's peak and would report it.
PROBE = """
import json, sys
import jax, jax.numpy as jnp
import specjax

def status(key):
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

jnp.zeros(1).block_until_ready()
before = status("VmRSS")  # resident now (the high-water mark may sit above it)
target = specjax.load_target(sys.argv[1], dtype="bfloat16")
jax.block_until_ready(target.params)
print(json.dumps({"before": before, "after": status("VmHWM")}))
"""


def _write_checkpoint(path) -> int:
  c = CONFIG
  e, f, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
  shapes = {"model.embed_tokens.weight": (c["vocab_size"], e), "model.norm.weight": (e,)}
  for i in range(c["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({
        p + "input_layernorm.weight": (e,), p + "post_attention_layernorm.weight": (e,),
        p + "self_attn.q_proj.weight": (c["num_attention_heads"] * d, e),
        p + "self_attn.k_proj.weight": (c["num_key_value_heads"] * d, e),
        p + "self_attn.v_proj.weight": (c["num_key_value_heads"] * d, e),
        p + "self_attn.o_proj.weight": (e, c["num_attention_heads"] * d),
        p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e),
        p + "mlp.down_proj.weight": (e, f)})
  rng = np.random.default_rng(0)
  tensors = {k: (0.02 * rng.standard_normal(s, np.float32)).astype(ml_dtypes.bfloat16)
             for k, s in shapes.items()}
  save_file(tensors, os.path.join(path, "model.safetensors"))
  with open(os.path.join(path, "config.json"), "w") as fp:
    json.dump(CONFIG, fp)
  return sum(t.nbytes for t in tensors.values())


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux /proc")
def test_bfloat16_load_peaks_near_the_model_not_twice_it(tmp_path):
  model_bytes = _write_checkpoint(tmp_path)
  assert model_bytes > 200 << 20
  out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True,
                       text=True, timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-2000:]
  rss = json.loads(out.stdout.strip().splitlines()[-1])
  growth = rss["after"] - rss["before"]
  assert growth >= 0.9 * model_bytes  # the model itself is resident
  assert growth < 1.5 * model_bytes, (
      f"loading grew the peak by {growth / 2**20:.0f} MiB for a {model_bytes / 2**20:.0f} MiB "
      "model: the file's pages stay resident beside it")
