"""The user's dataset as the plan's global batches, read ahead of the step that needs them.

Step s is the s-th global batch of a sequence of epochs; each epoch is one permutation of the
dataset drawn from `seed + epoch` (every rank derives the same one, like one DistributedSampler),
and its last partial batch is dropped. Replica r reads only its samples [offset_r, offset_r + b_r)
of a step, and only on ranks whose stage takes inputs (first) or targets (last). A `Prefetcher`
thread prepares the next steps' microbatches while the current one trains (pinned memory when
the stage is on an accelerator: its copy to the device does not block).
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable

import torch

from hetplan.planner.files.io import InputError


def collate(samples: list, collate_fn: Callable | None = None) -> tuple:
    """Samples [(inputs, target), ...] -> (inputs, target) batched; tuples stay tuples."""
    from torch.utils.data import default_collate
    out = collate_fn(samples) if collate_fn is not None else default_collate(samples)
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise InputError(f"collate_fn: expected (inputs, target), got {type(out).__name__}")
    x, y = out
    return (tuple(x) if isinstance(x, list) else x), y


class DataFeed:
    """A map-style dataset read as global batches of `global_batch` samples; `__call__(G, step)`
    stands in for make_batch (the whole global batch), `read(step, a, b)` reads samples [a, b)."""

    def __init__(self, dataset: Any, global_batch: int, seed: int = 0, collate_fn: Callable | None = None,
                 name: str = "train_data", check_items: bool = True):
        self.dataset, self.global_batch, self.seed, self.collate_fn = dataset, global_batch, seed, collate_fn
        self.name = name
        n = check_dataset(dataset, name) if check_items else len(dataset)
        if global_batch > n:
            raise InputError(f"{name}: holds {n} samples, fewer than the plan's global_batch {global_batch}; "
                             "expected at least one global batch")
        self.size = n
        self.steps_per_epoch = n // global_batch
        self._perm: tuple[int, list[int]] | None = None

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of global step `step`."""
        return divmod(step, self.steps_per_epoch)

    def indices(self, step: int) -> list[int]:
        epoch, k = self.position(step)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm = (epoch, torch.randperm(self.size, generator=g).tolist())
        return self._perm[1][k * self.global_batch:(k + 1) * self.global_batch]

    def read(self, step: int, a: int, b: int) -> tuple:
        idx = self.indices(step)[a:b]
        getitems = getattr(self.dataset, "__getitems__", None)    # torch's batched fetch, where defined
        samples = getitems(idx) if getitems is not None else [self.dataset[i] for i in idx]
        return collate(samples, self.collate_fn)

    def __call__(self, global_batch: int, step: int) -> tuple:
        return self.read(step, 0, global_batch)


def check_dataset(dataset: Any, name: str) -> int:
    """The dataset's length; map-style with at least one sample whose item is (inputs, target)."""
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise InputError(f"{name}: expected a map-style dataset (__len__ and __getitem__), got "
                         f"{type(dataset).__name__}")
    n = len(dataset)
    if n < 1:
        raise InputError(f"{name}: the dataset is empty; expected at least one sample")
    item = dataset[0]
    if not (isinstance(item, (tuple, list)) and len(item) == 2):
        raise InputError(f"{name}[0]: expected one sample's (inputs, target), got {type(item).__name__}"
                         + (f" of {len(item)}" if isinstance(item, (tuple, list)) else ""))
    return n


def eval_batches(dataset: Any, global_batch: int, collate_fn: Callable | None = None):
    """Every sample once, in order, as global batches (the last one partial): (batch, (inputs, target))."""
    n = len(dataset)
    for start in range(0, n, global_batch):
        idx = range(start, min(start + global_batch, n))
        yield collate([dataset[i] for i in idx], collate_fn)


def pin(batch):
    """Microbatches (ins, tgts) with every tensor in pinned memory."""
    from torch.utils._pytree import tree_map
    return tree_map(lambda t: t.pin_memory() if isinstance(t, torch.Tensor) else t, batch)


class Prefetcher:
    """Runs `make(step)` for `steps` in order on a thread, `depth` steps ahead; `get()` returns
    the next one (an exception in `make` is raised by `get`)."""

    def __init__(self, make: Callable[[int], Any], steps: Iterable[int], depth: int = 2):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(make, iter(steps)), daemon=True,
                                        name="hetplan-prefetch")
        self._thread.start()

    def _run(self, make, steps) -> None:
        for s in steps:
            try:
                item = (make(s), None)
            except BaseException as e:  # noqa: BLE001 - handed to the training thread
                item = (None, e)
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[1] is not None:
                return

    def get(self):
        item, err = self._q.get()
        if err is not None:
            raise err
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
