"""Reading `tokenizer.json` (the HF `tokenizers` format) and fingerprinting a tokenizer.

The one loader and the one fingerprint: checkpoints, drafters and the training pipeline all read
tokenizers here, so a missing or corrupt file is reported the same way everywhere. Also the
`tokenizer_config.json` that makes `transformers.AutoTokenizer` run this very `tokenizer.json`
with the same settings (without one, it picks the model type's tokenizer class, which may split
text differently).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer

from specjax import config_utils

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def tokenizer_path(path: str | os.PathLike) -> str:
  """A folder means `<folder>/tokenizer.json` (the HF layout); a `.json` path is used as is."""
  path = os.fspath(path)
  return path if path.endswith(".json") else os.path.join(path, TOKENIZER_FILE)


def load_tokenizer(path: str | os.PathLike, *, vocab_size: int | None = None) -> Tokenizer:
  """Reads a `tokenizer.json` (or a folder holding one), with errors that name the file.

  With `vocab_size`, refuses a tokenizer that can emit ids >= it: the model could not embed them.
  """
  src = tokenizer_path(path)
  if not os.path.isfile(src):
    raise ValueError(f"no tokenizer file at {src!r}")
  try:
    tok = Tokenizer.from_file(src)
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ValueError(f"{src!r} is not a valid tokenizer.json: {e}") from e
  n = tok.get_vocab_size(with_added_tokens=True)
  if vocab_size is not None and n > vocab_size:
    raise ValueError(f"tokenizer {src!r} has {n} tokens but the model's vocab_size is "
                     f"{vocab_size}")
  return tok


def tokenizer_fingerprint(tok: Tokenizer | None) -> str | None:
  """sha256 of the serialized tokenizer (None for None): equal fingerprints mean equal token
  ids, so it pairs drafters with targets and keys caches of tokenized text."""
  return None if tok is None else hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()


def read_tokenizer_config(folder: str | os.PathLike) -> dict[str, Any]:
  """The folder's `tokenizer_config.json` as a dict ({} when it has none)."""
  d = config_utils.read_json_object(os.path.join(os.fspath(folder), TOKENIZER_CONFIG_FILE))
  return {} if d is None else d


def apply_tokenizer_config(tok: Tokenizer, config: dict[str, Any]) -> Tokenizer:
  """Sets the runtime switch `tokenizer.json` does not store as transformers does: with
  `split_special_tokens` (default false) the literal text of a special token is encoded as
  ordinary text, never as the special id."""
  tok.encode_special_tokens = bool(config.get("split_special_tokens", False))
  return tok


def _special_token(tok: Tokenizer, token_id: int | None) -> str | None:
  """The content of `token_id` if it is one of `tok`'s special added tokens. Naming any other
  token would make transformers add it as a new special token, changing how text splits."""
  added = tok.get_added_tokens_decoder()
  if token_id is None or token_id not in added or not added[token_id].special:
    return None
  return added[token_id].content


# Model types whose `tokenizer_class` transformers (5.x) overrides with its own class, which
# rebuilds the normalizer, pre-tokenizer and decoder from the family's recipe and keeps only the
# vocabulary, merges and post-processor of `tokenizer.json`: "qwen2" is in transformers'
# `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, so every Qwen2 folder gets `Qwen2Tokenizer`
# (Qwen's digit-by-digit split and NFC), whatever `tokenizer_config.json` names.
REBUILT_TOKENIZER_MODEL_TYPES = frozenset({"qwen2"})


def hf_tokenizer_config(tok: Tokenizer, *, model_max_length: int,
                        eos_token_ids: Sequence[int] = (), bos_token_id: int | None = None,
                        pad_token_id: int | None = None,
                        model_type: str | None = None) -> dict[str, Any]:
  """The `tokenizer_config.json` under which `AutoTokenizer` encodes and decodes like `tok`.

  `PreTrainedTokenizerFast` runs `tokenizer.json` as is (a model-specific class may rebuild it);
  no `add_bos_token`/`add_eos_token` keys, which would replace the post-processor; no cleanup of
  spaces in decode; `split_special_tokens` carries `tok.encode_special_tokens`. The EOS token is
  the first of `eos_token_ids` that is a special token (transformers names one).

  For a `model_type` in `REBUILT_TOKENIZER_MODEL_TYPES` (config.json's, which picks the class),
  transformers' own class is used whatever `tokenizer_class` says. There `trust_remote_code: true`
  makes that class load `tokenizer.json` unchanged instead of rebuilding its pipeline (transformers
  passes this key to `TokenizersBackend.convert_to_native_format`; no code is run: the folder has
  no `auto_map` and no code, and `AutoTokenizer` decides on remote code from its own argument
  alone), and each special-token role without a special token is written as null so the class's
  defaults (`<|endoftext|>`) are not added as new tokens. transformers' own `save_pretrained`
  drops the key: a folder it re-saves gets the class's recipe back.
  """
  pre = json.loads(tok.to_str()).get("pre_tokenizer") or {}
  rebuilt = model_type in REBUILT_TOKENIZER_MODEL_TYPES
  d: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                       "model_max_length": model_max_length,
                       "clean_up_tokenization_spaces": False,
                       "split_special_tokens": bool(tok.encode_special_tokens)}
  if rebuilt:
    d["trust_remote_code"] = True
  if "add_prefix_space" in pre:
    d["add_prefix_space"] = bool(pre["add_prefix_space"])
  eos = next((e for e in eos_token_ids if _special_token(tok, e) is not None), None)
  for name, token_id in (("bos_token", bos_token_id), ("eos_token", eos),
                         ("pad_token", pad_token_id), ("unk_token", None)):
    content = _special_token(tok, token_id)
    if content is not None or rebuilt:
      d[name] = content
  return d


# -- chat templates ------------------------------------------------------------------------------

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"


def _token_text(value: Any) -> str | None:
  """A special token as tokenizer_config.json spells it: a string or an AddedToken dict."""
  if isinstance(value, dict):
    return value.get("content")
  return value if isinstance(value, str) else None


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
  """A checkpoint's chat template (Jinja), rendered as transformers renders it: a sandboxed
  environment with `trim_blocks` and `lstrip_blocks`, loop controls, `raise_exception`,
  `strftime_now` and the special tokens' text (`bos_token`, `eos_token`, ...) in scope."""

  source: str
  special_tokens: tuple[tuple[str, str], ...] = ()

  @classmethod
  def from_folder(cls, folder: str | os.PathLike) -> ChatTemplate:
    """The template of an HF folder: `chat_template.jinja`, `chat_template.json` or
    `tokenizer_config.json`'s `chat_template` (a string, or named templates: "default")."""
    folder = os.fspath(folder)
    config = read_tokenizer_config(folder)
    source: Any = None
    jinja = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(jinja):
      with open(jinja, encoding="utf-8") as f:
        source = f.read()
    elif os.path.isfile(os.path.join(folder, CHAT_TEMPLATE_JSON)):
      source = (config_utils.read_json_object(os.path.join(folder, CHAT_TEMPLATE_JSON))
                or {}).get("chat_template")
    else:
      source = config.get("chat_template")
    if isinstance(source, list):
      named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
      source = named.get("default")
    if not isinstance(source, str) or not source:
      raise ValueError(f"{folder} has no chat template ({CHAT_TEMPLATE_FILE}, "
                       f"{CHAT_TEMPLATE_JSON} or chat_template in {TOKENIZER_CONFIG_FILE})")
    tokens = tuple((k, t) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                   if (t := _token_text(config.get(k))) is not None)
    return cls(source, tokens)

  def render(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True,
             **options: Any) -> str:
    """The conversation as text; `options` are the template's own switches (e.g. Qwen3's
    `enable_thinking=False`), passed as transformers passes extra `apply_chat_template` args."""
    import jinja2
    import jinja2.ext  # submodules: `import jinja2` alone does not load them
    import jinja2.meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
      raise ValueError(f"the chat template refused the conversation: {message}")

    def strftime_now(fmt):
      import datetime
      return datetime.datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
      template = env.from_string(self.source)
      reads = jinja2.meta.find_undeclared_variables(env.parse(self.source))
    except jinja2.TemplateError as e:
      raise ValueError(f"the chat template does not parse: {e}") from None
    unread = sorted(set(options) - reads)
    if unread:  # a misspelt switch would otherwise change nothing, silently
      switches = sorted(reads - {"messages", "add_generation_prompt", "raise_exception",
                                 "strftime_now", *dict(self.special_tokens)})
      raise ValueError(f"the chat template has no switch {unread}; the variables it reads: "
                       f"{switches}")
    return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                           **dict(self.special_tokens), **options)
