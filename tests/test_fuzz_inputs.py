"""The project's fuzz test of its readers: seeded random mutations of valid plan, topology and
measured files (keys deleted or renamed, values of the wrong type, huge or non-finite numbers,
bad bytes) must load or raise InputError with one line naming the file, never another exception.
A handful go through the CLI as well: exit 2, one line, no traceback, nothing written. And every
command's flags, given ill-typed or extreme values (test_fuzz_cli_flags): the same promise."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from hetplan.planner.files.io import InputError
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
    topology = ROOT / "hetplan" / "topologies" / "workstation-gtx1650.json"
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


# --- the command line's flags ---------------------------------------------------------------
# Each command from a valid base command line, one flag given a value it must refuse: exit 2, one
# error line, no traceback, nothing written. Values a flag accepts are left out (a huge --seed or
# --iterations, a --steps of 10**20: valid, only long), so that no case starts real work.
FLAG_CASES = 4000     # about 35 s on 2 cores, in this process (no interpreter start per case)


def _bad_int(rng):
    return rng.choice(["0", "-1", f"-{rng.randrange(2, 10**30)}", "x", "", f"{rng.random():.3f}", "1e3", "0x10",
                       "nan"])     # (not "\u0663": Python reads that digit as 3)


def _huge_int(rng):
    return rng.choice([f"{rng.randrange(10**7, 10**30)}", _bad_int(rng)])


def _bad_float(rng):
    return rng.choice(["0", "-1", "nan", "inf", "-inf", "1e400", "-1e400", "x", "", f"-{rng.random():.3g}"])


def _flag_tables(tmp_path):
    """({command: base argv}, {command: {flag: rng -> a value it refuses}}, the output folder)."""
    ws = str(ROOT / "hetplan" / "topologies" / "workstation-gtx1650.json")
    out = tmp_path / "out"
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"model": {"spec": "mlp", "args": {"hidden": 16, "depth": 1}}, "global_batch": 8,
                                "replicas": [{"batch_fraction": 1.0, "stages": [{"device": "cpu:0", "layers": [0, 3]}]}]}))
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(LOADERS["measured"][1]))
    folder, text, garbage, fifo = tmp_path / "folder", tmp_path / "a.txt", tmp_path / "bytes.json", tmp_path / "fifo"
    folder.mkdir()
    text.write_text("not json")
    garbage.write_bytes(b"\xff\xfe{\x00")
    os.mkfifo(fifo)

    def in_path(rng):
        return rng.choice([str(tmp_path / "missing.json"), str(folder), str(fifo), "/dev/null", str(text),
                           str(garbage)])

    def out_file(rng):
        return str(folder)

    def one_of(*values):
        return lambda rng: rng.choice(values)
    base = {
        "plan": ["plan", "--model", "mlp", "--model-arg", "hidden=16", "--model-arg", "depth=1", "--batch", "8",
                 "--topology", ws, "--iterations", "5", "-o", str(out / "p.json")],
        "graph": ["graph", "--model", "mlp", "--model-arg", "hidden=16", "--batch", "4"],
        "simulate": ["simulate", str(plan), "--topology", ws, "--trace", str(out / "t.json")],
        "run": ["run", str(plan), "--iters", "2", "-o", str(out / "m.json")],
        "compare": ["compare", str(plan), str(measured), "--topology", ws, "--plot", str(out / "c.png")],
        "profile": ["profile", "--quick", "-o", str(out / "t.json")],
        "demo": ["demo", "--profile", ws, "--out", str(out / "demo"), "--batch", "8", "--iters", "2"],
    }
    model = one_of("", ":", ":f", "x:", "nosuch", "os:nosuch", "no.such.module:f", "\n")
    model_arg = one_of("", "=", "=1", "x", "hidden=x", "hidden=-5", "hidden=0", "hidden=1e400", "nosuch=1",
                       "depth=nan")
    layers = one_of("", " ", "nope.*", "[", "layers.99")
    flags = {
        "plan": {"--batch": _huge_int, "--topology": in_path, "--seed": one_of("x", "1.5", ""),
                 "--iterations": _bad_int, "--time-limit": _bad_float, "--chains": _huge_int, "--workers": _bad_int,
                 "--lr": _bad_float, "--clip-grad-norm": _bad_float, "--target-loss": _bad_float,
                 "--precision": one_of("", "x", "fp64", "fp32,fp32", "fp32,", ","),
                 "--objective": one_of("", "x", "time"), "-o": out_file, "--model": model, "--model-arg": model_arg,
                 "--layers": layers, "--optimizer": one_of("Nope", "x", "Optimizer"),
                 "--optimizer-arg": one_of("", "=", "lr=x", "nosuch=1", "lr=-1", "lr=1e400", "lr=nan")},
        "graph": {"--batch": _huge_int, "--model": model, "--model-arg": model_arg, "--layers": layers},
        "simulate": {"plan": in_path, "--topology": in_path, "--trace": out_file},
        "run": {"plan": in_path, "--topology": in_path, "--iters": _bad_int,
                "--warmup": one_of("-1", "2", "5", "x", "1e400"), "-o": out_file, "--trace": lambda rng: str(text),
                "--master-port": _huge_int, "--save-params": out_file, "--timeout": _bad_float,
                "--steps": _bad_int, "--epochs": _bad_int, "--log-every": one_of("0", "-1", "x"),
                "--metrics": out_file, "--eval-every": one_of("0", "x", "1"), "--checkpoint-every": one_of("0", "1"),
                "--lr-schedule": one_of("", "x", "cosine", "nope"), "--lr-schedule-arg": one_of("", "x", "a=1"),
                "--warmup-steps": one_of("-1", "x", "3"), "--min-lr-ratio": _bad_float, "--seed": one_of("1", "x")},
        "compare": {"plan": in_path, "measured": in_path, "--topology": in_path, "--plot": out_file},
        "profile": {"--cpu-workers": _huge_int, "-o": out_file},
        "demo": {"--batch": _huge_int, "--iters": one_of("0", "1", "-1", "x", ""), "--warmup": one_of("-1", "2", "9", "x"),
                 "--cpu-workers": one_of("0", "-1", "x", "-99999999999999999999"), "--out": lambda rng: str(text),
                 "--profile": one_of(str(folder), str(fifo), "/dev/null", str(text)), "--model": model,
                 "--model-arg": one_of("=", "hidden=x", "nosuch=1")},
    }
    return base, flags, out


def _with(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with `flag` set to `value` (a positional PLAN / MEASURED by its place; a repeatable
    KEY=VALUE flag added last, where it overrides the base's)."""
    argv = list(argv)
    if flag in ("plan", "measured"):
        argv[1 if flag == "plan" else 2] = value
        return argv
    for name in () if flag.endswith("-arg") else ((flag, "--output", "--out") if flag == "-o" else (flag,)):
        if name in argv:
            argv[argv.index(name) + 1] = value
            return argv
    return argv + [f"{flag}={value}"]     # `=`: a value starting with '-' is not taken for a flag


def test_fuzz_cli_flags(tmp_path, capsys):
    """Seeded random (command, flag, bad value) cases through the CLI's entry point in this
    process. Broken by: a flag read without a check (a traceback, or a refusal only after work
    began: a file left behind), a check printing several lines, or a flag silently ignored
    (exit 0)."""
    from hetplan.cli import main
    base, flags, out = _flag_tables(tmp_path)
    rng = random.Random(f"{SEED}:flags")
    cases = [(c, f) for c in sorted(flags) for f in sorted(flags[c])]
    for case in range(FLAG_CASES):
        command, flag = cases[case] if case < len(cases) else rng.choice(cases)   # every flag once, then at random
        argv = _with(base[command], flag, flags[command][flag](rng))
        if case >= len(cases) and rng.random() < 0.3:     # and a second bad flag: still one line
            other = rng.choice(sorted(flags[command]))
            argv = _with(argv, other, flags[command][other](rng))
        out.mkdir(exist_ok=True)
        try:
            rc = main(argv)
        except SystemExit as e:            # argparse: an ill-typed value
            rc = e.code
        except Exception as e:   # noqa: BLE001 - the point of the test
            raise AssertionError(f"case {case} {argv}: {type(e).__name__}: {e}") from None
        err = capsys.readouterr().err
        lines = [l for l in err.splitlines() if "error" in l]
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (case, argv, rc, err[-1500:])
        assert not any(out.iterdir()), (case, argv, sorted(out.rglob("*")))
