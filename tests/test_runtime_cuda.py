"""CUDA paths of the runtime: CUDA stages, CPU<->CUDA exchange through host memory over gloo,
NCCL between GPUs, CPU optimizer placement of a CUDA stage. Skipped without a GPU.

Tolerances are looser than on CPU (CUDA kernels round differently from the CPU reference).
"""
from __future__ import annotations

import pytest
import torch

from test_runtime import ITERS, SKIP, plan, reference, run_plan

pytestmark = pytest.mark.cuda
two_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="needs two CUDA GPUs")


def check_close(tmp_path, p):
    result, params = run_plan(tmp_path, p)
    ref_losses, ref_params = reference(p["model"], p["global_batch"], ITERS,
                                       p["optimizer"]["name"], p["optimizer"]["lr"])
    assert result["losses"] == pytest.approx(ref_losses, rel=1e-3)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=1e-3, atol=1e-4, msg=name)
    return result


def test_cpu_to_cuda_pipeline(tmp_path):
    # stage 0 on the CPU, stage 1 on the GPU: activations and gradients cross through host memory
    r = check_close(tmp_path, plan([(1.0, 4, [("cpu:0", (0, 2)), ("cuda:0", (2, 4))])], model=SKIP))
    assert r["per_device"]["cuda:0"]["peak_memory_bytes"] > 0


def test_cpu_cuda_hybrid_fine_cpu_optimizer(tmp_path):
    # a CPU replica and a GPU replica summed over gloo; the GPU stage's Adam runs on the host
    check_close(tmp_path, plan([(0.25, 1, [("cpu:0", (0, 4))]), (0.75, 3, [("cuda:0", (0, 4))])],
                               sync="fine", bucket_bytes=1024, placement="cpu"))


@two_gpus
def test_nccl_dp_and_pipeline(tmp_path):
    check_close(tmp_path, plan([(0.5, 2, [("cuda:0", (0, 2)), ("cuda:1", (2, 4))]),
                                (0.5, 1, [("cpu:0", (0, 4))])], sync="fine", bucket_bytes=1024))
    check_close(tmp_path, plan([(0.5, 1, [("cuda:0", (0, 4))]), (0.5, 1, [("cuda:1", (0, 4))])]))
