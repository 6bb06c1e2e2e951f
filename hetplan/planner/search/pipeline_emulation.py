"""PipeDream, 2BW and PipeDream+SWA emulated in one process: the plan's stages run their 1F1B
actions over the stream of `iterations` x m microbatches (hetplan.runtime.pipedream) in the order of the
schedule's unit-time dry run, each stage with its own weight versions
(hetplan.planner.workload.weight_versions), activations and their gradients handed between stages as
the runtime sends them. A stage's results depend only on its own action order and what it
receives, so the losses are the runtime's (tested).
"""
from __future__ import annotations


def emulate_pipeline(workload, plan, iterations: int) -> list[float]:
    """The loss per iteration (the mean over its microbatches) of the plan's pipeline, trained
    from a copy of the workload's model, on one intra-op thread: its ops are of one microbatch,
    too small to gain from more, and on a shared host more threads made it 5x slower (measured)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _emulate(workload, plan, iterations)
    finally:
        torch.set_num_threads(threads)


def _emulate(workload, plan, iterations: int) -> list[float]:
    import copy

    import torch

    from hetplan.planner.files.schedule import dry_run, make_schedule
    from hetplan.planner.workload.inputs import call_args, slice_inputs
    from hetplan.planner.workload.optimizer import make_optimizer
    from hetplan.planner.workload.weight_versions import WeightVersions

    rep = plan.replicas[0]
    p, m = len(rep.stages), rep.microbatches
    micro = plan.global_batch // m
    workload = copy.copy(workload)
    workload.model = copy.deepcopy(workload.model)
    modules = _stages(workload, rep, micro)
    owners = [{id(q) for q in mod.parameters()} for mod in modules]
    if any(a & b for i, a in enumerate(owners) for b in owners[i + 1:]):
        raise ValueError("the model ties a weight across the pipeline's stages (hetplan.runtime.pipedream refuses it)")
    versions = [WeightVersions(list(mod.named_parameters()), make_optimizer(
        [q for q in mod.parameters() if q.requires_grad], plan.optimizer.name, plan.optimizer.lr), plan.sync, m)
        for mod in modules]
    whole = p == 1
    batches: dict[int, tuple] = {}
    sent: dict[tuple[int, int], list] = {}        # (stage, microbatch) -> its outputs
    grads: dict[tuple[int, int], list] = {}       # (stage, microbatch) -> gradients of its inputs
    saved: dict[tuple[int, int], tuple] = {}
    losses = [0.0] * iterations

    def batch(k: int):
        j = k // m
        if j not in batches:
            batches.clear()
            batches[j] = workload.make_batch(plan.global_batch, j)
        x, y = batches[j]
        a = (k % m) * micro
        return slice_inputs(x, a, a + micro), slice_inputs(y, a, a + micro)

    for row in dry_run(make_schedule("1f1b", p, m * iterations)):
        for act in row:
            if act is None:
                continue
            s, k = act.stage, act.microbatch
            if act.kind == "F":
                if s == 0:
                    x, _ = batch(k)
                    args, kwargs = call_args(x) if whole else (modules[0].flat_inputs(x), {})
                    args = list(args)
                else:
                    args, kwargs = [t.detach().requires_grad_(t.requires_grad) if t.is_floating_point()
                                    else t.detach() for t in sent.pop((s - 1, k))], {}
                w = versions[s].for_forward(k)
                out = torch.func.functional_call(modules[s], w, tuple(args), kwargs)
                out = (out,) if whole else out
                if s == p - 1:
                    loss = workload.loss_fn(out[0], batch(k)[1]) * (1.0 / m)
                    losses[k // m] += float(loss.detach())
                    saved[(s, k)] = (args, [loss], None)
                else:
                    sent[(s, k)] = list(out)
                    saved[(s, k)] = (args, [o for o in out if o.requires_grad], True)
            else:
                args, outs, needs = saved.pop((s, k))
                if needs is None:
                    outs[0].backward()
                elif outs:
                    torch.autograd.backward(outs, grads.pop((s, k)))
                else:
                    grads.pop((s, k))
                if s > 0:
                    grads[(s - 1, k)] = [a.grad if a.grad is not None else torch.zeros_like(a)
                                         for a in args if a.requires_grad]
                versions[s].after_backward(k)
    return losses


def _stages(workload, rep, micro: int):
    """The stage modules the runtime builds: the whole model, or the plan's cut."""
    if len(rep.stages) == 1:
        return [workload.model]
    from hetplan.planner.workload.partition import build_stages
    return build_stages(workload, [st.layers for st in rep.stages], micro)


__all__ = ["emulate_pipeline"]
