"""How a stage's weights change under PipeDream and PipeDream-2BW (plan field sync.mode): weight
versions, stashing, per-stage updates and the SWA average. One rule, used by the runtime
(hetplan.runtime.pipedream) and by the one-process emulation (hetplan.planner.search.pipeline_emulation).

- Stashing: a forward runs with the stage's weights of that moment (its *version*) and the
  backward of the same microbatch with the same values, though updates happened in between:
  the version is copied once when a forward first uses it and kept until the last
  microbatch that used it has run its backward.
- PipeDream: the stage steps its optimizer after every backward, on that microbatch's gradient
  (of its mean loss: the runner scales each microbatch's loss by 1/m, undone here).
- PipeDream-2BW: the gradients of an iteration's m microbatches are summed (each at the version
  its forward used) and the stage steps once, after the iteration's last backward; a
  microbatch whose forward ran before that step keeps the previous version: at most 2.
- "average": "swa" (PipeDream only): after the iteration's last update the stage's weights become
  the mean of the m versions its updates made in that iteration (stochastic weight averaging
  over the iteration, restarted every iteration); the optimizer state carries on.
"""
from __future__ import annotations

import torch

from hetplan.planner.files.plan import Sync


class WeightVersions:
    """A stage's live parameters (`named`, updated by `optimizer`, a torch optimizer or
    hetplan.runtime.optim.StageOptimizer) and the stashed versions its in-flight microbatches use."""

    def __init__(self, named: list[tuple[str, torch.nn.Parameter]], optimizer, sync: Sync, microbatches: int):
        self.named, self.optimizer, self.m = named, optimizer, microbatches
        self.per_microbatch = sync.mode == "pipedream"     # else 2BW: one step per iteration
        self.swa = sync.average == "swa"
        self.version = 0                                   # updates so far (SWA's average counts)
        self.stash: dict[int, dict[str, torch.Tensor]] = {}
        self.users: dict[int, int] = {}                    # version -> microbatches in flight
        self.used: dict[int, int] = {}                     # microbatch -> its version
        self.backwards = 0
        self.sum: list[torch.Tensor] | None = None         # SWA: this iteration's versions summed
        self.peak_bytes = 0                                # the most stashed (and summed) at once

    def for_forward(self, mb: int) -> dict[str, torch.Tensor]:
        """The weights microbatch `mb`'s forward uses (and later its backward): the current
        version, stashed on its first use."""
        v = self.version
        if v not in self.stash:
            self.stash[v] = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in self.named}
            self.users[v] = 0
        self.users[v] += 1
        self.used[mb] = v
        self.peak_bytes = max(self.peak_bytes, self.held_bytes())
        return self.stash[v]

    @torch.no_grad()
    def after_backward(self, mb: int) -> None:
        """Move `mb`'s gradients from its stashed version to the live parameters, drop a version
        no microbatch uses any more, and update as the mode says."""
        v = self.used.pop(mb)
        weights = self.stash[v]
        factor = self.m if self.per_microbatch else 1
        for n, p in self.named:
            g = weights[n].grad
            weights[n].grad = None
            if g is None:
                continue
            g = g * factor if factor != 1 else g
            p.grad = g if p.grad is None else p.grad.add_(g)
        self.users[v] -= 1
        self._drop_unused()
        self.backwards += 1
        end_of_iteration = self.backwards % self.m == 0
        if self.per_microbatch or end_of_iteration:
            self._update(end_of_iteration)

    def _update(self, end_of_iteration: bool) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.version += 1
        if self.swa:
            live = [p.detach() for _, p in self.named]
            self.sum = [x.clone() for x in live] if self.sum is None else [s.add_(x) for s, x in zip(self.sum, live)]
            self.peak_bytes = max(self.peak_bytes, self.held_bytes())
            if end_of_iteration:
                for x, s in zip(live, self.sum):
                    x.copy_(s.div_(self.m))
                self.sum = None
        self._drop_unused()

    def _drop_unused(self) -> None:
        for v in [v for v, n in self.users.items() if n == 0 and v != self.version]:
            del self.stash[v], self.users[v]

    def held_bytes(self) -> int:
        """Bytes of the stashed versions and of SWA's running sum."""
        return (sum(t.numel() * t.element_size() for w in self.stash.values() for t in w.values())
                + sum(t.numel() * t.element_size() for t in self.sum or ()))


__all__ = ["WeightVersions"]
