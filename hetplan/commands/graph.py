"""`hetplan graph`: the operator graph of a workload, grouped into layers."""
from __future__ import annotations

import json
import sys

HELP = "capture a model's operator graph and print its layers (FLOPs, bytes)"


def add_arguments(p):
    p.add_argument("--model", required=True, metavar="SPEC",
                   help="built-in (mlp, gpt, cnn) or package.module:function")
    p.add_argument("--model-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="argument for the model factory (repeatable)")
    p.add_argument("--layers", default=None, metavar="PATTERN",
                   help="layer boundaries: modules matching this dotted glob are layers, e.g. "
                        "'hf.model.layers.*' (comma-separated for several; default: every element "
                        "of the model's outermost module lists, see docs/guide.md)")
    p.add_argument("--batch", required=True, type=int, metavar="B", help="batch size (samples)")


def to_json(graph) -> dict:
    layers = [{"index": l.index, "name": l.name, "fwd_flops": l.fwd_flops, "bwd_flops": l.bwd_flops,
               "param_bytes": l.param_bytes, "activation_bytes": l.activation_bytes,
               "saved_bytes": l.saved_bytes, "fwd_bytes_moved": l.fwd_bytes_moved,
               "bwd_bytes_moved": l.bwd_bytes_moved, "n_ops": l.n_ops, "bwd_n_ops": l.bwd_n_ops,
               "cut_bytes_before": graph.cut_bytes[l.index], "signature": l.signature}
              for l in graph.layers]
    total = {"fwd_flops": sum(l.fwd_flops for l in graph.layers),
             "bwd_flops": sum(l.bwd_flops for l in graph.layers),
             "param_bytes": graph.param_bytes,
             "activation_bytes": sum(l.activation_bytes for l in graph.layers),
             "saved_bytes": sum(l.saved_bytes for l in graph.layers),
             "n_ops": sum(l.n_ops for l in graph.layers)}
    return {"batch": graph.batch, "layers": layers, "total": total,
            "cut_bytes": list(graph.cut_bytes), "method": graph.info.get("method"),
            "tied": [{"name": t.name, "bytes": t.bytes, "layers": list(t.layers)} for t in graph.tied],
            "warnings": graph.info.get("warnings", [])}


def main(args) -> int:
    from hetplan.planner.workload.capture import capture_graph
    from hetplan.planner.files.io import InputError
    from hetplan.planner.workload.load import load_workload, parse_model_args
    from hetplan.planner.workload.step_check import check_step

    from hetplan.planner.files.plan import check_batch
    check_batch(args.batch, "--batch")
    workload = load_workload(args.model, parse_model_args(args.model_arg), args.layers, weights=False)
    check_step(workload, args.batch, "--model", args.model)
    print(f"capturing {args.model} at batch {args.batch} ...", file=sys.stderr)
    try:
        graph = capture_graph(workload, args.batch)
    except ValueError as e:       # the model could not be captured or grouped into layers
        raise InputError(f"--model: {args.model}: {e}") from None
    data = to_json(graph)
    if args.json:
        print(json.dumps(data))
        return 0
    import pandas as pd

    df = pd.DataFrame([{"layer": l["index"], "name": l["name"], "fwd GFLOP": l["fwd_flops"] / 1e9,
                        "bwd GFLOP": l["bwd_flops"] / 1e9, "params MB": l["param_bytes"] / 1e6,
                        "act MB": l["activation_bytes"] / 1e6, "saved MB": l["saved_bytes"] / 1e6,
                        "cut in MB": l["cut_bytes_before"] / 1e6, "ops": l["n_ops"]}
                       for l in data["layers"]])
    with pd.option_context("display.max_rows", None, "display.width", 200,
                           "display.float_format", "{:.4g}".format):
        print(df.to_string(index=False))
    t = data["total"]
    print(f"total: {len(data['layers'])} layers, fwd {t['fwd_flops'] / 1e9:.4g} GFLOP, "
          f"bwd {t['bwd_flops'] / 1e9:.4g} GFLOP, params {t['param_bytes'] / 1e6:.4g} MB "
          f"at batch {graph.batch} (captured with {data['method']})")
    return 0
