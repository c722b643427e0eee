"""What differs between two computations of one artifact, and whether it is float rounding.

Two computations of one key (a retried step, a second writer, another machine) store the same
bytes when nothing but the plan enters them. Where they do not, `compare` says what differs: the
files, the first difference (a JSON path or a tensor, with both values), and the largest difference
between two floats. It is *float rounding* when the artifacts differ in nothing but floats (every
key, count, id, text and shape equal) and every pair of floats agrees within `ROUNDING`, relative
to the larger of their magnitudes and 1; anything else is a real difference: an input missing from
the key, or a computation that is not deterministic (a sampled token that flipped counts here too).

JSON files are compared value by value; `.safetensors` files tensor by tensor; any other file as bytes.
"""

import json
import math
from dataclasses import dataclass
from typing import Any

# float32 sums of the same terms in other orders (other batch shapes, kernels, devices) differ by at
# most (n - 1) eps32 sum|terms| (Higham 4.4): measured here at <= 1.4e-5 on the log-probs of tiny and
# 135M models across batch shapes and ATEN_CPU_CAPABILITY settings (tests/lm_fixtures.py,
# ON_POLICY_ROUNDING). A difference beyond 1e-4 of the values' scale is not rounding.
ROUNDING = 1e-4


@dataclass(frozen=True)
class Difference:
    files: tuple[str, ...]  # the files that differ (or are in one computation only)
    first: str  # the first difference found, with both values
    max_float: float  # the largest |a - b| / max(1, |a|, |b|) over the floats compared
    only_floats: bool  # everything but floats is equal

    @property
    def rounding(self) -> bool:
        return self.only_floats and self.max_float <= ROUNDING

    def describe(self) -> str:
        what = f"{', '.join(self.files)} differ; first: {self.first}"
        if self.rounding:
            return f"{what}. Float rounding: only floats differ, by at most {self.max_float:.2g} (relative), within {ROUNDING:g}"
        if self.only_floats:
            return f"{what}. Not float rounding: floats differ by up to {self.max_float:.2g} (relative), beyond {ROUNDING:g}"
        return f"{what}. Not float rounding: more than floats differ"


class _Walk:
    def __init__(self) -> None:
        self.first = ""
        self.max_float = 0.0
        self.only_floats = True

    def note(self, where: str, a: Any, b: Any, structural: bool) -> None:
        if structural:
            if self.only_floats:
                self.first = f"{where}: {_short(a)} vs {_short(b)}"
            self.only_floats = False
        elif not self.first:
            self.first = f"{where}: {_short(a)} vs {_short(b)}"

    def floats(self, where: str, a: float, b: float) -> None:
        if a == b or (math.isnan(a) and math.isnan(b)):
            return
        if not (math.isfinite(a) and math.isfinite(b)):
            self.note(where, a, b, structural=True)
            return
        rel = abs(a - b) / max(1.0, abs(a), abs(b))
        if rel > self.max_float:
            self.max_float = rel
            if self.only_floats:
                self.first = f"{where}: {a!r} vs {b!r}"

    def value(self, where: str, a: Any, b: Any) -> None:
        if isinstance(a, bool) or isinstance(b, bool):
            if a is not b:
                self.note(where, a, b, structural=True)
        elif isinstance(a, (int, float)) and isinstance(b, (int, float)):
            if isinstance(a, int) and isinstance(b, int):
                if a != b:
                    self.note(where, a, b, structural=True)
            else:
                self.floats(where, float(a), float(b))
        elif isinstance(a, dict) and isinstance(b, dict):
            if a.keys() != b.keys():
                self.note(where, sorted(a), sorted(b), structural=True)
            for k in sorted(a.keys() & b.keys(), key=str):
                self.value(f"{where}.{k}", a[k], b[k])
        elif isinstance(a, list) and isinstance(b, list):
            if len(a) != len(b):
                self.note(f"{where} (length)", len(a), len(b), structural=True)
            for i, (x, y) in enumerate(zip(a, b, strict=False)):
                self.value(f"{where}[{i}]", x, y)
        elif a != b:
            self.note(where, a, b, structural=True)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tensors(walk: _Walk, name: str, a: bytes, b: bytes) -> None:
    import numpy as np
    from safetensors.numpy import load

    ta, tb = load(a), load(b)
    if ta.keys() != tb.keys():
        walk.note(f"{name} (tensors)", sorted(ta), sorted(tb), structural=True)
    for key in sorted(ta.keys() & tb.keys()):
        x, y = ta[key], tb[key]
        where = f"{name}:{key}"
        if x.shape != y.shape or x.dtype != y.dtype:
            walk.note(where, f"{x.dtype}{list(x.shape)}", f"{y.dtype}{list(y.shape)}", structural=True)
        elif not np.issubdtype(x.dtype, np.floating):
            if not np.array_equal(x, y):
                walk.note(where, "integers", "other integers", structural=True)
        elif not np.array_equal(x, y, equal_nan=True):
            x64, y64 = x.astype(np.float64).reshape(-1), y.astype(np.float64).reshape(-1)
            scale = np.maximum(np.maximum(np.abs(x64), np.abs(y64)), 1.0)
            i = int(np.nan_to_num(np.abs(x64 - y64) / scale, nan=np.inf).argmax())
            walk.floats(f"{where}[{i}]", float(x64[i]), float(y64[i]))


def compare(a: dict[str, bytes], b: dict[str, bytes]) -> Difference | None:
    """What differs between two computations of one artifact (file name -> bytes), or None."""
    walk = _Walk()
    differing = sorted(n for n in a.keys() | b.keys() if a.get(n) != b.get(n))
    if not differing:
        return None
    for name in differing:
        if name not in a or name not in b:
            walk.note(name, "present" if name in a else "absent", "present" if name in b else "absent", structural=True)
            continue
        try:
            if name.endswith(".json"):
                walk.value(name, json.loads(a[name]), json.loads(b[name]))
            elif name.endswith(".safetensors"):
                _tensors(walk, name, a[name], b[name])
            else:
                walk.note(name, f"{len(a[name])} bytes", f"{len(b[name])} other bytes", structural=True)
        except (ValueError, ImportError) as e:  # not what its name says: compared as bytes
            walk.note(name, f"{len(a[name])} bytes", f"{len(b[name])} other bytes ({e})", structural=True)
    return Difference(tuple(differing), walk.first or f"{differing[0]}: other bytes", walk.max_float, walk.only_floats)
