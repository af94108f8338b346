"""A user's prompt file: JSONL, one prompt per line, for the benchmark and the experiments.

Each line is one of
  "text"                                    a JSON string
  {"prompt": "..."} | {"text": ...} | {"question": ...} | {"instruction": ...}
  {"turns": ["first user turn", ...]}       Spec-Bench / MT-Bench questions: the first turn
  {"messages": [{"role": "user", "content": "..."}, ...]}   a chat (also "conversations")
Other keys (ids, categories, references) are ignored. Blank lines are skipped.

`render(prompt, chat_template)` gives the text the target reads: the prompt as it is, or, with
the checkpoint's chat template, the conversation rendered as transformers'
`apply_chat_template(add_generation_prompt=True)` renders it. A chat without a template is
refused (its roles would have no text).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from specjax.interop.tokenizer import ChatTemplate

TEXT_KEYS = ("prompt", "text", "question", "instruction")
CHAT_KEYS = ("messages", "conversations")


@dataclasses.dataclass(frozen=True)
class Prompt:
  """One prompt: plain text, or a conversation of {"role", "content"} messages."""

  text: str | None = None
  messages: tuple[dict[str, str], ...] | None = None


def _messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
  if not isinstance(value, list) or not value:
    raise ValueError(f"{where}: messages must be a non-empty list")
  out = []
  for m in value:
    if not isinstance(m, dict):
      raise ValueError(f"{where}: each message must be an object with role and content")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    if not isinstance(role, str) or not isinstance(content, str):
      raise ValueError(f"{where}: each message needs a string role and content, got {m}")
    out.append({"role": {"human": "user", "gpt": "assistant"}.get(role, role),
                "content": content})
  return tuple(out)


def parse_line(value: Any, where: str) -> Prompt:
  if isinstance(value, str):
    if not value:
      raise ValueError(f"{where}: the prompt is empty")
    return Prompt(text=value)
  if not isinstance(value, dict):
    raise ValueError(f"{where}: a prompt line is a JSON string or object, got "
                     f"{type(value).__name__}")
  found = [k for k in (*CHAT_KEYS, "turns", *TEXT_KEYS) if k in value]
  if len(found) > 1:  # which one is the prompt? Taking the first would drop the others unsaid
    raise ValueError(f"{where}: several prompts in one line ({', '.join(found)}); give one")
  for key in CHAT_KEYS:
    if key in value:
      return Prompt(messages=_messages(value[key], where))
  if "turns" in value:
    turns = value["turns"]
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
      raise ValueError(f"{where}: turns must be a non-empty list of strings")
    return Prompt(messages=({"role": "user", "content": turns[0]},))
  for key in TEXT_KEYS:
    if key in value:
      if not isinstance(value[key], str):
        raise ValueError(f"{where}: {key} must be a string")
      if not value[key]:
        raise ValueError(f"{where}: {key} is empty")
      return Prompt(text=value[key])
  raise ValueError(f"{where}: no prompt in keys {sorted(value)}; expected one of "
                   f"{list(TEXT_KEYS) + list(CHAT_KEYS) + ['turns']}")


def _loads(text: str, where: str) -> Any:
  try:
    return json.loads(text)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: not JSON ({e.msg})") from None
  except RecursionError:
    raise ValueError(f"{where}: JSON nested too deeply to be a prompt") from None


def read_prompts(path: str | os.PathLike) -> list[Prompt]:
  """Every prompt of a JSONL file (one per line; a UTF-8 byte-order mark is skipped), or of a
  JSON file holding one list of them, in order; a bad line or item is named by its number."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise ValueError(f"no prompt file at {path}")
  prompts = []
  with open(path, "rb") as f:
    data = f.read().removeprefix(b"\xef\xbb\xbf")
  if data.lstrip().startswith(b"["):  # one JSON list of prompts (a .json file, say)
    try:
      items = _loads(data.decode("utf-8"), path)
    except UnicodeDecodeError as e:
      raise ValueError(f"{path}: not UTF-8 text (at byte {e.start})") from None
    if not isinstance(items, list):
      raise ValueError(f"{path}: a prompt file is JSONL or one JSON list of prompts")
    prompts = [parse_line(v, f"{path}[{i}]") for i, v in enumerate(items)]
    if not prompts:
      raise ValueError(f"{path} holds no prompts")
    return prompts
  for n, raw in enumerate(data.splitlines(), 1):
    where = f"{path}:{n}"
    try:
      line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
      raise ValueError(f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column "
                       f"{e.start + 1}); a prompt file is UTF-8 JSONL") from None
    if not line.strip():
      continue
    prompts.append(parse_line(_loads(line, where), where))
  if not prompts:
    raise ValueError(f"{path} holds no prompts")
  return prompts


def render(prompt: Prompt, template: ChatTemplate | None, **options: Any) -> str:
  """The text the target reads (see the module docstring); `options` go to the template."""
  if template is not None:
    messages = prompt.messages or ({"role": "user", "content": prompt.text},)
    return template.render(list(messages), **options)
  if prompt.messages is not None:
    if len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user":
      return prompt.messages[0]["content"]  # a single user turn reads as its text
    raise ValueError("a conversation of several messages needs the checkpoint's chat template "
                     "(chat_template=true)")
  return prompt.text
