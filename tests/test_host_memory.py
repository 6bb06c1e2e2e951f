"""The runtime's allocator setting (hetplan.planner.hardware.host_memory): freed memory stays with the
process, so an iteration does not fault its tensors in again and costs what layer timing measured."""
import subprocess
import sys

import pytest

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

# In a fresh process: the bytes glibc maps outside its heap for one 8 MiB malloc (an unmapped
# block is faulted in afresh by the next allocation).
_MAPPED = """
import ctypes
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                               "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
from hetplan.planner.hardware.host_memory import keep_freed_memory
if {keep}:
    assert keep_freed_memory()
before = libc.mallinfo2().hblkhd
libc.malloc(8 << 20)
print(libc.mallinfo2().hblkhd - before)
"""

# In a fresh process: the page faults per training step of the built-in cnn (gradients set to
# None every step and Adam, as in the runtime): the median of ten steps after ten warm ones
# (a step that faults now and then, when the host reclaims pages under load, does not count).
_TRAIN = """
import resource, torch
from hetplan.planner.hardware.host_memory import keep_freed_memory
assert keep_freed_memory()
torch.set_num_threads(1)
from hetplan.planner.workload.load import load_workload
w = load_workload("cnn", {})
opt = torch.optim.Adam(w.model.parameters())
x, y = w.make_batch(128, 0)
def step():
    opt.zero_grad(set_to_none=True)
    w.loss_fn(w.model(x), y).backward()
    opt.step()
for _ in range(10):
    step()
faults = []
for _ in range(10):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(sorted(faults)[5])
"""


def _python(code: str) -> int:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


@linux_only
def test_large_blocks_come_from_the_heap_once_freed_memory_is_kept():
    assert _python(_MAPPED.format(keep=False)) >= 8 << 20    # glibc's default: mapped apart
    assert _python(_MAPPED.format(keep=True)) == 0


@linux_only
def test_training_steps_reuse_their_memory_without_page_faults():
    # without the setting, 0 to ~10,000 faults per step depending on the allocator's history
    assert _python(_TRAIN) < 50
