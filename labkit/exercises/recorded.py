"""Answers recorded for the student build: a check there compares with the value the reference answer gave
for the same inputs, recorded when `make release` ran, since the reference itself is not shipped.

`fingerprint` names a call by its inputs (numbers, strings, tuples, lists, dicts, dataclasses, tensors);
`lookup` is what an answer function's stub in release/student/ calls. In this repository nothing calls
`lookup`: the reference answers are here (see labkit/course/release.py).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import pickle
import sys
from fractions import Fraction
from pathlib import Path

TABLE_FILE = "recorded_answers.b64"  # beside this module in release/student/labkit/exercises/
_table: dict[str, object] | None = None


class Unrecordable(TypeError):
    """An input the fingerprint cannot name (a model object, say): that answer stays in the student build."""


def _parts(obj) -> str:
    if obj is None or isinstance(obj, (bool, int, float, str, Fraction)):
        return f"{type(obj).__name__}:{obj!r}"
    if isinstance(obj, (tuple, list)):
        return f"{type(obj).__name__}[" + ",".join(_parts(o) for o in obj) + "]"
    if isinstance(obj, dict):
        return "dict{" + ",".join(f"{_parts(k)}={_parts(v)}" for k, v in sorted(obj.items(), key=repr)) + "}"
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = ",".join(f"{f.name}={_parts(getattr(obj, f.name))}" for f in dataclasses.fields(obj))
        return f"{type(obj).__qualname__}({fields})"
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        data = obj.detach().cpu().contiguous()
        digest = hashlib.sha256(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"").hexdigest()
        return f"tensor({data.dtype},{tuple(data.shape)},{digest})"
    raise Unrecordable(f"cannot fingerprint a {type(obj).__name__}")


def fingerprint(name: str, args: tuple, kwargs: dict) -> str:
    """A digest of a call: the answer function's qualified name and its inputs."""
    text = name + "|" + _parts(tuple(args)) + "|" + _parts(dict(kwargs))
    return hashlib.sha256(text.encode()).hexdigest()


def dump(table: dict[str, object], path: Path) -> None:
    path.write_text(base64.b64encode(pickle.dumps(table)).decode() + "\n")


def load(path: Path) -> dict[str, object]:
    return pickle.loads(base64.b64decode(path.read_text()))


def lookup(name: str, hint: str, caller_file: str, args: tuple, kwargs: dict):
    """The recorded answer, when a check of this build asks (the caller's file is the exercise module);
    otherwise NotImplementedError with the hint: writing it is the exercise."""
    global _table
    if Path(caller_file).resolve() != Path(sys.modules[name.rsplit(".", 1)[0]].__file__).resolve():
        raise NotImplementedError(f"{name.rsplit('.', 1)[1]} is an exercise's answer, not shipped in this build: "
                                  f"write it yourself. Hint: {hint}")
    if _table is None:
        _table = load(Path(__file__).with_name(TABLE_FILE))
    key = fingerprint(name, args, kwargs)
    if key not in _table:
        raise NotImplementedError(f"this build's check knows the answer only for the lesson's own inputs; "
                                  f"{name.rsplit('.', 1)[1]} was called with others")
    return _table[key]
