"""Reading and writing the JSON files that pass between hetplan's steps.

Every file from outside goes through `Reader`, so a bad value always produces one line that
names the file, the field and what was expected (raised as `InputError`, exit code 2 in the
CLI). Every file we write goes through `replace_atomically` (JSON: `write_json_atomic`), so a
failure never leaves a half-written file behind.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import stat
import tempfile
from pathlib import Path
from typing import Any, Callable

_MISSING = object()


class InputError(Exception):
    """Bad input from outside (file, flag, spec). The message is one line for the user; `detail`
    (lines printed under it, e.g. a deadlocked plan's grid) where one line cannot show it."""

    def __init__(self, message: str = "", detail: str = ""):
        super().__init__(message)
        self.detail = detail


MAX_INT = 2**63 - 1   # the largest integer a file may hold (int64: what torch and numpy index with)


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """The JSON value in `path`: a regular file of UTF-8 JSON whose numbers are finite and whose
    integers fit in int64. Anything else (a FIFO, bad bytes, deep nesting, `NaN`, `1e400`, a
    4,301-digit integer) is one InputError line naming the file and, where known, the field."""
    p = Path(path)
    try:
        if not stat.S_ISREG(os.stat(p).st_mode):   # a FIFO would block open(), a folder fail late
            raise InputError(f"{p}: {what} is not a regular file; expected a JSON file")
        raw = p.read_bytes()
    except FileNotFoundError:
        raise InputError(f"{p}: {what} not found") from None
    except OSError as e:
        raise InputError(f"{p}: cannot read {what}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{p}: not UTF-8 text (byte {e.start}); expected a UTF-8 JSON {what}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise InputError(f"{p}: not valid JSON: nested too deeply") from None
    except ValueError:          # an integer over sys.int_max_str_digits (4,300)
        raise InputError(f"{p}: not valid JSON: an integer of over 4,300 digits; expected a finite number") from None
    bad = _first_bad_number(data)
    if bad is not None:
        field_, v = bad
        raise InputError(f"{p}: {field_ or 'top level'}: expected a finite number"
                         f"{' within ±2**63' if isinstance(v, int) else ''}, got {_short(v)}")
    return data


def _first_bad_number(data: Any) -> tuple[str, Any] | None:
    """(dotted field, value) of the first NaN, infinity or integer beyond MAX_INT, depth first;
    None when every number is fine. Iterative: a deep file cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            stack.extend((f"{where}.{k}" if where else str(k), x) for k, x in reversed(list(v.items())))
        elif isinstance(v, list):
            stack.extend((f"{where}[{i}]", x) for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, float) and not math.isfinite(v):
            return where, v
        elif isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_INT:
            return where, v
    return None


def _short(v: Any) -> str:
    """A value for an error line: at most 60 characters (a 4,000-digit integer is not printed)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) > 10**40:
        return f"an integer of {len(str(abs(v)))} digits"
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)    # json.dumps would refuse or write NaN/Infinity; "nan", "inf" say it
    try:
        return json.dumps(v)[:60]
    except (TypeError, ValueError):
        return repr(v)[:60]


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file and an atomic rename.

    A path that cannot be written (a folder, no permission) raises InputError naming it; NaN
    and infinity are refused (JSON has no such numbers, and our loaders would reject the file)."""
    p = Path(path)
    try:
        text = json.dumps(obj, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise InputError(f"{p}: not written: a value is NaN or infinite") from None
    try:
        replace_atomically(p, lambda tmp: tmp.write_text(text))
    except OSError as e:
        raise InputError(f"{p}: cannot write: {e.strerror}") from None


def replace_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Create or replace `path` with what `write(temporary path)` writes: a temporary file beside
    `path` (its folder is created), then an atomic rename, so a reader never sees half a file.
    The temporary file is removed on any failure; the file gets the usual mode (umask)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~_umask())   # mkstemp makes 0600
        os.replace(tmp, p)
    except BaseException:
        _unlink_quietly(tmp)
        raise


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of the file's bytes, hex: how a plan names its topology and a measured file its plan."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _type_name(kind: Any) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false",
             list: "a list", dict: "an object"}
    if isinstance(kind, tuple):
        return " or ".join(names.get(k, k.__name__) for k in kind)
    return names.get(kind, kind.__name__)


class Reader:
    """Typed access to a JSON object; errors name `file` and the dotted field path."""

    def __init__(self, data: Any, file: str, prefix: str = ""):
        self.file, self.prefix = str(file), prefix
        if not isinstance(data, dict):
            raise self.error("", "expected an object")
        self.data = data

    def where(self, key: str | int) -> str:
        if isinstance(key, int):
            return f"{self.prefix}[{key}]"
        return f"{self.prefix}.{key}" if self.prefix else key

    def error(self, key: str | int, msg: str) -> InputError:
        field = self.where(key) if key != "" else (self.prefix or "top level")
        return InputError(f"{self.file}: {field}: {msg}")

    def has(self, key: str) -> bool:
        return key in self.data

    def get(self, key: str, kind: Any, default: Any = _MISSING,
            check: Callable[[Any], bool] | None = None, expected: str = "") -> Any:
        """Return data[key] as `kind` (int accepted for float; bool never for int/float)."""
        if key not in self.data or self.data[key] is None:
            if default is not _MISSING:
                return default
            raise self.error(key, f"missing; expected {expected or _type_name(kind)}")
        v = self.data[key]
        kinds = kind if isinstance(kind, tuple) else (kind,)
        ok = False
        for k in kinds:
            if k is float and isinstance(v, (int, float)) and not isinstance(v, bool):
                v, ok = float(v), math.isfinite(float(v))
            elif k is int and isinstance(v, int) and not isinstance(v, bool):
                ok = True
            elif k is int and isinstance(v, float) and v.is_integer() and abs(v) <= 2**53 and float not in kinds:
                v, ok = int(v), True     # 4.0 is 4; 1e308 is not an exact integer
            elif k not in (int, float) and isinstance(v, k):
                ok = True
            if ok:
                break
        if not ok or (check is not None and not check(v)):
            raise self.error(key, f"expected {expected or _type_name(kind)}, got {_short(v)}")
        return v

    def only(self, known: Any, free: Any = ()) -> None:
        """Refuse a key outside `known` (and `free`, the documented free-form keys) with the
        closest known name: a typo must not be dropped silently for a default."""
        names = set(known) | set(free)
        for key in self.data:
            if key not in names:
                close = difflib.get_close_matches(str(key), sorted(names), n=1, cutoff=0.6)
                hint = f"did you mean `{close[0]}`?" if close else f"expected one of {', '.join(sorted(known))}"
                raise self.error(str(key), f"unknown field; {hint}")

    def sub(self, key: str) -> "Reader":
        return Reader(self.get(key, dict), self.file, self.where(key))

    def items(self, key: str, allow_empty: bool = False) -> list[Any]:
        v = self.get(key, list)
        if not v and not allow_empty:
            raise self.error(key, "expected a non-empty list")
        return v

    def readers(self, key: str, allow_empty: bool = False) -> list["Reader"]:
        items = self.items(key, allow_empty)
        return [Reader(x, self.file, f"{self.where(key)}[{i}]") for i, x in enumerate(items)]
