"""Reading safetensors files tensor by tensor with plain reads, never a memory map.

A memory-mapped checkpoint keeps every page it has touched resident in the process until the
map closes, so loading a bfloat16 model through one holds the file and the model at once: twice
the model in host memory. Here each tensor (or a block of its leading rows, for a sharded load)
is read into a buffer of its own with `os.pread` and handed to the caller, which converts and
drops it; the peak is the loaded model plus the largest tensor.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length
N, a JSON header of N bytes naming each tensor's dtype, shape and [begin, end) byte offsets into
the data that follows. Every header entry is checked against the file's size before use, so a
truncated or corrupt file is named as such instead of read short.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
_MAX_HEADER = 100 << 20


class SafetensorsFile:
  """The tensors of one safetensors file: `shapes`, `dtypes` (numpy) and `read`."""

  def __init__(self, file: str | os.PathLike):
    self.file = os.fspath(file)
    try:
      size = os.path.getsize(self.file)
      with open(self.file, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= min(_MAX_HEADER, size - 8):
          raise ValueError(f"header length {n} does not fit a file of {size} bytes")
        header = json.loads(f.read(n))
    except (OSError, ValueError, UnicodeDecodeError) as e:
      raise ValueError(f"corrupt safetensors file {self.file}: {e}") from None
    self._data = 8 + n
    self.shapes: dict[str, tuple[int, ...]] = {}
    self.dtypes: dict[str, np.dtype] = {}
    self._offsets: dict[str, tuple[int, int]] = {}
    for name, entry in header.items():
      if name == "__metadata__":
        continue
      try:
        dtype = np.dtype(DTYPES[entry["dtype"]])
        shape = tuple(int(d) for d in entry["shape"])
        begin, end = (int(x) for x in entry["data_offsets"])
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"corrupt safetensors file {self.file}: entry {name!r}: "
                         f"{type(e).__name__} {e}") from None
      if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize or not (
          0 <= begin <= end <= size - self._data):
        raise ValueError(f"corrupt safetensors file {self.file}: tensor {name!r} of shape "
                         f"{shape} {entry['dtype']} does not fit bytes [{begin}, {end}) of its "
                         f"{size - self._data}-byte data")
      self.shapes[name], self.dtypes[name], self._offsets[name] = shape, dtype, (begin, end)

  def keys(self) -> list[str]:
    return list(self.shapes)

  def read(self, name: str, rows: slice | None = None) -> np.ndarray:
    """The tensor (or its leading-axis rows `rows`, a step-1 slice) in its stored dtype."""
    shape, dtype = self.shapes[name], self.dtypes[name]
    begin, _ = self._offsets[name]
    if rows is not None and shape:
      lo, hi, step = rows.indices(shape[0])
      if step != 1:
        raise ValueError(f"rows must be a step-1 slice, got {rows}")
      shape = (max(hi - lo, 0),) + shape[1:]
      begin += lo * int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    count = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    out = np.empty(shape, dtype)
    view = memoryview(out.reshape(-1).view(np.uint8)) if count else memoryview(b"")
    fd = os.open(self.file, os.O_RDONLY)
    try:
      done = 0
      while done < count:
        got = os.preadv(fd, [view[done:]], self._data + begin + done)
        if got <= 0:
          raise ValueError(f"corrupt safetensors file {self.file}: tensor {name!r} ends early")
        done += got
    except OSError as e:
      raise ValueError(f"cannot read tensor {name!r} of {self.file}: {e}") from None
    finally:
      os.close(fd)
    return out
