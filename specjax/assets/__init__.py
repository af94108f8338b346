"""Shipped artefacts of the embedded default (HF-format folders), located beside this file."""

import os

ASSETS_DIR = os.path.dirname(os.path.abspath(__file__))
TARGET_DIR = os.path.join(ASSETS_DIR, "target")  # the Qwen3 code LM trained on the stdlib
DRAFT_LM_DIR = os.path.join(ASSETS_DIR, "draft_lm")  # the small draft LM with the same tokenizer
