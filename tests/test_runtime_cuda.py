"""CUDA paths of the runtime: CUDA stages, CPU<->CUDA exchange through host memory over gloo,
NCCL between GPUs, CPU optimizer placement of a CUDA stage.

Each test runs twice: with the CPU standing in for the GPUs (hetplan.planner.hardware.device: `cuda:N` tensors
in host memory, the same host staging, side streams, events and offload code, gloo instead of
NCCL), on every machine; and on real GPUs (marked `cuda`, skipped without one), where kernels
round differently from the CPU reference, hence the looser tolerances there.
"""
from __future__ import annotations

import pytest
import torch

from hetplan.planner.hardware.device import STANDIN_ENV
from equivalence import assert_params_match
from test_runtime import ITERS, SKIP, plan, reference, run_plan


@pytest.fixture(params=["standin", pytest.param("real", marks=pytest.mark.cuda)])
def gpus(request, monkeypatch):
    """'standin': two CPU stand-ins for cuda:0 and cuda:1; 'real': this machine's GPUs."""
    if request.param == "standin":
        monkeypatch.setenv(STANDIN_ENV, "2")
    return request.param


def check_close(tmp_path, p, gpus):
    result, params = run_plan(tmp_path, p)
    ref = reference(p["model"], p["global_batch"], ITERS, p["optimizer"]["name"], p["optimizer"]["lr"])
    rel, atol = (1e-4, 1e-5) if gpus == "standin" else (1e-3, 1e-4)
    assert result["losses"] == pytest.approx(ref.losses, rel=rel)
    assert_params_match(params, ref, rtol=rel, atol=atol)
    return result


def test_cpu_to_cuda_pipeline(tmp_path, gpus):
    # stage 0 on the CPU, stage 1 on the GPU: activations and gradients cross through host memory
    r = check_close(tmp_path, plan([(1.0, 4, [("cpu:0", (0, 2)), ("cuda:0", (2, 4))])], model=SKIP), gpus)
    assert r["per_device"]["cuda:0"]["peak_memory_bytes"] > 0


def test_cuda_to_cpu_gpipe(tmp_path, gpus):
    # the GPU stage first: its activation sends are host copies queued behind the next forward
    check_close(tmp_path, plan([(1.0, 4, [("cuda:0", (0, 3)), ("cpu:0", (3, 4))])], model=SKIP,
                               schedule="gpipe"), gpus)


def test_cpu_cuda_hybrid_fine_cpu_optimizer(tmp_path, gpus):
    # a CPU replica and a GPU replica summed over gloo; the GPU stage's Adam runs on the host
    check_close(tmp_path, plan([(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cuda:0", (0, 4))])],
                               sync="fine", bucket_bytes=1024, placement="cpu"), gpus)


def _second(gpus) -> str:
    """A second GPU where there is one (always among the stand-ins), else the CPU."""
    return "cuda:1" if gpus == "standin" or torch.cuda.device_count() >= 2 else "cpu:0"


def test_split_optimizer_pipeline(tmp_path, gpus):
    # each GPU stage updates its last parameters (half the bytes) on the host, the rest on the GPU
    check_close(tmp_path, plan([(1.0, 2, [("cuda:0", (0, 2)), (_second(gpus), (2, 4))])], placement="split",
                               cpu_fraction=0.5), gpus)


def test_split_optimizer_puts_the_last_tensors_on_the_host(gpus):
    from hetplan.planner.files.plan import Optimizer
    from hetplan.planner.hardware.device import torch_device
    from hetplan.runtime.optim import StageOptimizer
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch_device("cuda:0").device)
    params = list(net.parameters())   # 256, 32, 64, 8 bytes
    opt = StageOptimizer(params, Optimizer("adam", 0.01, "split", 0.2), torch_device("cuda:0"))
    assert opt.on_host == params[2:] and opt.on_device == params[:2]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(m.device.type == "cpu" for m in opt.master)
    # Adam's two moments and step counter (4 B) of every tensor, master copies of the host's 72 B
    assert opt.state_bytes() == 2 * 360 + 4 * 4 + 72
    assert float(params[3].detach()[0]) == pytest.approx(float(opt.master[1].detach()[0]))


def test_offloaded_activations_pipeline(tmp_path, gpus):
    # the first GPU stage keeps its saved activations in host memory between F and B
    p = plan([(1.0, 4, [("cuda:0", (0, 2)), (_second(gpus), (2, 4))])], schedule="gpipe")
    p["replicas"][0]["stages"][0]["offload_activations"] = True
    check_close(tmp_path, p, gpus)


def test_offload_hooks_copy_what_backward_needs_and_not_the_weights(gpus):
    from hetplan.planner.hardware.device import torch_device
    from hetplan.runtime.offload import ActivationOffload
    dev = torch_device("cuda:0")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dev.device)
    x = torch.randn(4, 8, device=dev.device)
    net(x).sum().backward()
    ref = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    off = ActivationOffload(dev, net.parameters())
    with off.hooks():
        y = net(x).sum()
    y.backward()
    for p, r in zip(net.parameters(), ref):
        torch.testing.assert_close(p.grad, r, rtol=0, atol=0)
    # saved: the input x (4x8) for the first weight's gradient, tanh's output (4x16) for its
    # backward and for the second weight's gradient (copied once): 32 + 64 floats
    assert off.bytes_out == (32 + 64) * 4


def test_gpu_dp_and_pipeline(tmp_path, gpus):
    # two GPUs: NCCL between them on real GPUs, host-staged gloo for the stand-ins
    if gpus == "real" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    check_close(tmp_path, plan([(0.5, 2, [("cuda:0", (0, 2)), ("cuda:1", (2, 4))]),
                                (0.5, 1, [("cpu:0", (0, 4))])], sync="fine", bucket_bytes=1024), gpus)
    check_close(tmp_path, plan([(0.5, 1, [("cuda:0", (0, 4))]), (0.5, 1, [("cuda:1", (0, 4))])]), gpus)


def test_cpu_cuda_local_sgd_every_step_is_synchronous_training(tmp_path, gpus):
    # sync.mode local-sgd with period 1 and plain SGD: the parameter exchange (through host
    # memory for the GPU's parameters) gives synchronous data parallel's step
    p = plan([(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cuda:0", (0, 4))])], opt="sgd", lr=0.1)
    p["sync"].update({"mode": "local-sgd", "period": 1})
    check_close(tmp_path, p, gpus)
