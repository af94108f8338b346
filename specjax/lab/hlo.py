"""Collectives that a compiled program may enter in different orders on different devices.

XLA's CPU runtime runs a program's operations as a dataflow graph, several at a time on a pool of
worker threads, and orders its collectives among themselves. A loop or a branch that holds
collectives, though, is ordered against the program's other collectives only by the data that
passes between them (as compiled from JAX's persistent compilation cache, where the runtime is
rebuilt from its serialized form). Two such operations with no data path between them may start
in either order on each device: one device blocks in the first while the other blocks in the
second, each waiting for the other, and once every worker thread waits so the program hangs until
XLA aborts it. A 2-core machine has two worker threads for its two devices.

`races(hlo)` lists such pairs in a compiled program's optimized HLO text (`Compiled.as_text()`),
computation by computation: `generate`'s programs are tested to have none on a mesh.

Data paths follow what each operation reads: a loop reads only the carried values its body or
condition use (a value carried through unchanged is passed along, not read), and a value taken
from a loop's result that the loop carried through unchanged comes from what the loop was given,
not from the loop.
"""

from __future__ import annotations

import dataclasses
import re

COLLECTIVES = frozenset({
    "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
    "all-reduce-start", "all-gather-start", "collective-permute-start", "collective-broadcast"})
CONTROL_FLOW = frozenset({"while", "conditional", "call"})

_HEADER = re.compile(r"^(?:ENTRY )?%?([^\s(]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%?([^\s=]+) = ")
_OPCODE = re.compile(r" ([a-z][a-z0-9\-]*)\(")
_CALLED = re.compile(r"\b(body|condition|calls|true_computation|false_computation)=%?([^\s,}]+)"
                     r"|branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  opcode: str
  operands: tuple[str, ...]
  called: dict[str, tuple[str, ...]]  # attribute -> computations (body, condition, ...)
  index: int | None  # get-tuple-element's index
  root: bool


@dataclasses.dataclass(frozen=True)
class Race:
  computation: str
  first: str  # "opcode name"
  second: str

  def __str__(self) -> str:
    return f"{self.computation}: {self.first} and {self.second} have no data path between them"


def _split_operands(text: str) -> tuple[str, tuple[str, ...], str]:
  """`type opcode(operands), attributes` -> (opcode, operand names, attributes)."""
  text = " " + text  # the opcode follows a space, even at the start
  m = _OPCODE.search(text)
  if m is None:
    return "", (), text
  start = end = m.end() - 1  # at the opcode's "("
  depth = 0
  for end in range(start, len(text)):
    depth += (text[end] == "(") - (text[end] == ")")
    if depth == 0:
      break
  operands = tuple(re.findall(r"%([^\s,()]+)", text[start:end + 1]))
  return m.group(1), operands, text[end + 1:]


def parse(hlo: str) -> dict[str, dict[str, Instruction]]:
  """Computation name -> its instructions by name, in order."""
  computations: dict[str, dict[str, Instruction]] = {}
  current = None
  for line in hlo.splitlines():
    if current is None:
      m = _HEADER.match(line)
      if m:
        current = computations.setdefault(m.group(1), {})
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    opcode, operands, attributes = _split_operands(line[m.end():])
    called: dict[str, tuple[str, ...]] = {}
    for key, one, many in _CALLED.findall(attributes):
      if one:
        called[key] = (one,)
      else:
        called["branch_computations"] = tuple(x.strip().lstrip("%") for x in many.split(","))
    index = re.search(r"\bindex=(\d+)", attributes) if opcode == "get-tuple-element" else None
    current[m.group(2)] = Instruction(m.group(2), opcode, operands, called,
                                      int(index.group(1)) if index else None, bool(m.group(1)))
  return computations


class _Program:

  def __init__(self, hlo: str):
    self.computations = parse(hlo)
    self._communicates: dict[str, bool] = {}
    self._carried: dict[str, tuple[frozenset[int] | None, frozenset[int]]] = {}

  def communicates(self, computation: str) -> bool:
    """Whether `computation` (or one it calls, loops or branches to) holds a collective."""
    if computation not in self._communicates:
      self._communicates[computation] = False  # a computation does not call itself
      self._communicates[computation] = any(
          self.holds_collective(i) for i in self.computations.get(computation, {}).values())
    return self._communicates[computation]

  def holds_collective(self, inst: Instruction) -> bool:
    if inst.opcode in COLLECTIVES:
      return True
    return inst.opcode in CONTROL_FLOW and any(
        self.communicates(c) for names in inst.called.values() for c in names)

  def carried(self, computation: str) -> tuple[frozenset[int] | None, frozenset[int]]:
    """For a loop body or condition: (the tuple indices it reads, or None for all of them when
    it uses its parameter whole; the indices its root passes through unchanged)."""
    if computation not in self._carried:
      self._carried[computation] = self._find_carried(computation)
    return self._carried[computation]

  def _find_carried(self, computation: str) -> tuple[frozenset[int] | None, frozenset[int]]:
    insts = self.computations.get(computation, {})
    params = {n for n, i in insts.items() if i.opcode == "parameter"}
    root = next((i for i in insts.values() if i.root), None)
    users: dict[str, list[tuple[Instruction, int]]] = {}
    for inst in insts.values():
      for pos, op in enumerate(inst.operands):
        users.setdefault(op, []).append((inst, pos))
    read: set[int] = set()
    through: set[int] = set()
    for p in params:
      for user, _ in users.get(p, []):
        if user.opcode != "get-tuple-element":
          return None, frozenset()
        k = user.index
        uses = users.get(user.name, [])
        if root is not None and root.opcode == "tuple" and (root, k) in uses:
          through.add(k)
        if any(not (u is root and root.opcode == "tuple" and pos == k) for u, pos in uses):
          read.add(k)
    return frozenset(read), frozenset(through - read)

  def reads(self, insts: dict[str, Instruction], inst: Instruction) -> tuple[str, ...]:
    """The instructions of the same computation whose results `inst` reads."""
    if inst.opcode == "while" and len(inst.operands) == 1:
      given = insts.get(inst.operands[0])
      if given is not None and given.opcode == "tuple":
        body, = inst.called.get("body", ("",))
        cond, = inst.called.get("condition", ("",))
        in_body, in_cond = self.carried(body)[0], self.carried(cond)[0]
        if in_body is not None and in_cond is not None:
          return tuple(op for k, op in enumerate(given.operands) if k in in_body | in_cond)
    if inst.opcode == "get-tuple-element" and inst.operands:
      loop = insts.get(inst.operands[0])
      if loop is not None and loop.opcode == "while":
        body, = loop.called.get("body", ("",))
        given = insts.get(loop.operands[0]) if loop.operands else None
        if (inst.index in self.carried(body)[1] and given is not None
            and given.opcode == "tuple"):
          return (given.operands[inst.index],)
    return inst.operands

  def races(self) -> list[Race]:
    found = []
    for name, insts in self.computations.items():
      bearing = [i for i in insts.values() if self.holds_collective(i)]
      if not any(i.opcode in CONTROL_FLOW for i in bearing):
        continue
      before: dict[str, frozenset[str]] = {}
      for inst in insts.values():  # HLO text lists operands before their users
        seen: set[str] = set()
        for op in self.reads(insts, inst):
          if op in insts:
            seen.add(op)
            seen |= before.get(op, frozenset())
        before[inst.name] = frozenset(seen)
      for k, a in enumerate(bearing):
        for b in bearing[k + 1:]:
          if CONTROL_FLOW.isdisjoint((a.opcode, b.opcode)):
            continue  # two plain collectives: the runtime orders them
          if a.name in before[b.name] or b.name in before[a.name]:
            continue
          found.append(Race(name, f"{a.opcode} {a.name}", f"{b.opcode} {b.name}"))
    return found


def races(hlo: str) -> list[Race]:
  """The pairs of operations of an optimized HLO module (each a collective, or a loop, branch
  or call holding one, at least one of them not a plain collective) that no data path orders:
  devices may enter them in different orders and wait for each other forever."""
  return _Program(hlo).races()
