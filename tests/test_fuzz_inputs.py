"""The project's fuzz test of its readers: seeded random mutations of valid plan, topology and
measured files (keys deleted or renamed, values of the wrong type, huge or non-finite numbers,
bad bytes) must load or raise InputError with one line naming the file, never another exception.
A handful go through the CLI as well: exit 2, one line, no traceback, nothing written."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from planner.files.io import InputError
from test_bad_input import LOADERS

ROOT = Path(__file__).resolve().parent.parent
SEED, CASES = 42, 2000       # about 5 s in all on one core
ODD = [None, True, "x", "", -1, 0, 0.5, 1e308, -1e308, 10**30, [], {}, [1, "a"], {"a": 1}, 2**63, 1e-300]
RAW = ["1e400", "NaN", "-Infinity", "1" + "0" * 5000, '"\\ud800"', "[" * 3000 + "]" * 3000]


def _paths(v, at=()):
    """Every (container, key) pair in the JSON value `v`, depth first."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield v, k
            yield from _paths(x)
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield v, i
            yield from _paths(x)


def mutate(rng: random.Random, good: dict) -> bytes:
    """One random mutation of `good` as file bytes."""
    d = json.loads(json.dumps(good))
    op = rng.choice(["delete", "rename", "odd", "odd", "raw", "bytes", "duplicate"])
    where, key = rng.choice(list(_paths(d)))
    if op == "delete":
        del where[key]
    elif op == "rename" and isinstance(key, str):
        where[key[:-1] + rng.choice("sx_")] = where.pop(key)
    elif op == "duplicate":
        where[key] = [where[key], where[key]]
    elif op == "raw":
        where[key] = "@RAW@"
        return json.dumps(d).replace('"@RAW@"', rng.choice(RAW)).encode()
    elif op == "bytes":
        text = json.dumps(d).encode()
        i = rng.randrange(len(text))
        return text[:i] + bytes([rng.choice([0x80, 0xff, 0xc3, 0x00, 0x7b])]) + text[i + 1:]
    else:
        where[key] = rng.choice(ODD)
    return json.dumps(d).encode()


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_fuzz_readers(tmp_path, kind):
    """Broken by: any reader letting a bad value reach float(), [], a division or torch (a
    TypeError, KeyError, OverflowError, ... instead of InputError), or an error of several lines."""
    loader, good = LOADERS[kind]
    rng = random.Random(f"{SEED}:{kind}")
    path = tmp_path / "f.json"
    refused = 0
    for case in range(CASES):
        raw = mutate(rng, good)
        path.write_bytes(raw)
        try:
            loader(path)
        except InputError as e:
            msg = str(e)
            assert msg.startswith(f"{path}: ") and "\n" not in msg and len(msg) < 1000, (case, raw[:200], msg)
            refused += 1
        except Exception as e:   # noqa: BLE001 - the point of the test
            raise AssertionError(f"case {case}: {type(e).__name__}: {e}; file: {raw[:300]!r}") from None
    assert refused > CASES // 3     # the mutations do reach the checks


def test_fuzz_cli_a_few(tmp_path):
    """Six mutated plans that the loader refuses, through `simulate`: exit 2, one line, no traceback, no
    output file (--trace). Broken by: an exception escaping the CLI's InputError handler."""
    rng = random.Random(SEED)
    topology = ROOT / "profiles" / "examples" / "workstation-gtx1650.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    loader, plan = LOADERS["plan"]
    plan = {k: v for k, v in plan.items() if k != "topology"}
    ran = 0
    for case in range(40):
        path = tmp_path / f"p{case}.json"
        path.write_bytes(mutate(rng, plan))
        try:
            loader(path)
            continue          # this mutation is a valid plan: nothing to check here
        except InputError:
            pass
        trace = tmp_path / "trace.json"
        r = subprocess.run([sys.executable, "-m", "hetplan", "simulate", str(path), "--topology",
                            str(topology), "--trace", str(trace)], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, (path.read_bytes()[:200], r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not trace.exists()
        ran += 1
        if ran == 6:
            break
    assert ran == 6
