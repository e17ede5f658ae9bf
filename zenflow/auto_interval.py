"""The "auto" update interval: when has the unselected gradient caught up with the selected one?

Per step, for every *mixed* column param (some columns selected, some host-owned): the RMS per element of its
selected gradient columns (computed on the device, copied to the host without a wait) and the RMS per element of
the accumulated sum of its unselected columns after that step (computed by whoever accumulates: the worker in
overlap mode, so the training thread never reads the accumulators). The boundary fires when, for at least
`auto_ratio` of the mixed params, the accumulated mass as of `lag` steps ago is >= the mean selected mass over the
same steps; or at the cap. The lag makes the decision independent of the worker's timing: sync and overlap fire at
the same steps, on every run (docs/step-semantics.md).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from zenflow.layout import take_columns
from zenflow.link import Link
from zenflow.selection import as_columns
from zenflow.state import offloads

# The boundary decision at a step reads the accumulated mass of the step this many steps earlier, the newest one a
# background worker is sure to have added under the backpressure bound (at most one accumulation queued behind the
# running one). Sync mode uses the same lag, so both fire at the same steps.
AUTO_LAG = 2


@dataclass
class MassReport:
    """One step's masses, keyed by the column param's index in the optimizer's parameter order."""

    keys: list[int] = field(default_factory=list)       # the mixed column params of this step
    positions: list[int] = field(default_factory=list)  # each key's place in the accumulation's list of masses
    selected: torch.Tensor | None = None                # [len(keys)] fp64 on the host (CUDA: pinned, async copy)
    selected_ready: torch.cuda.Event | None = None      # CUDA: that copy's event
    # the accumulation's masses, or the future of them (host accumulation in the background), or a callable that
    # reads them (device accumulation: device_accumulation.DeviceMasses)
    accumulated: Future | list[float] | Callable[[], list[float]] | None = None
    combine: Callable[[list[float]], list[float]] | None = None  # data parallelism: this rank's block -> all ranks'
    # FSDP2: this rank's rows of the selected columns -> all ranks' (each key's elements here: selected_numels)
    combine_selected: Callable[[list[float]], list[float]] | None = None
    selected_numels: list[int] = field(default_factory=list)

    def selected_by_key(self) -> dict[int, float]:
        if self.selected_ready is not None:
            self.selected_ready.synchronize()  # long complete: the report is `lag` steps old when read
            self.selected_ready = None
        if not self.keys:
            return {}
        if self.combine_selected is not None:  # once: a collective, met at the same step on every rank
            combined = self.combine_selected(self.selected.tolist())
            self.selected, self.combine_selected = torch.tensor(combined, dtype=torch.float64), None
        return dict(zip(self.keys, self.selected.tolist()))

    def accumulated_by_key(self, wait: Callable[[Future], object]) -> dict[int, float]:
        masses = wait(self.accumulated) if isinstance(self.accumulated, Future) else self.accumulated
        if callable(masses):  # device accumulation: read once (a wait for a long-finished copy on CUDA)
            masses = self.accumulated = masses()
        if self.combine is not None:  # once: a collective, met at the same step on every rank
            masses, self.combine = self.combine(masses), None
            self.accumulated = masses
        return {key: masses[j] for key, j in zip(self.keys, self.positions)}

    def to_state(self, wait: Callable[[Future], object]) -> dict[str, dict[int, float]]:
        """Plain numbers for a checkpoint (waits for an unfinished accumulation)."""
        return {"selected": self.selected_by_key(), "accumulated": self.accumulated_by_key(wait)}

    @classmethod
    def from_state(cls, state: dict[str, dict[int, float]]) -> MassReport:
        keys = sorted(int(k) for k in state["selected"])
        selected = {int(k): v for k, v in state["selected"].items()}
        accumulated = {int(k): v for k, v in state["accumulated"].items()}
        return cls(keys=keys, positions=list(range(len(keys))),
                   selected=torch.tensor([selected[k] for k in keys], dtype=torch.float64),
                   accumulated=[accumulated[k] for k in keys])


def boundary_due(history: list[MassReport], since_boundary: int, lag: int, max_interval: int, auto_ratio: float,
                 wait: Callable[[Future], object]) -> bool:
    """The decision after the `since_boundary`-th accumulated step of an interval; `history` holds one report per
    step of the interval, oldest first."""
    if since_boundary >= max_interval or not history[-1].keys:
        return True  # the cap, or nothing mixed (pure offload, or nothing left to the host): every step
    if since_boundary <= lag:
        return False
    known = history[:since_boundary - lag]  # the steps whose masses are surely in
    accumulated = known[-1].accumulated_by_key(wait)
    if not accumulated:
        return True
    selected = [report.selected_by_key() for report in known]
    caught_up = 0
    for key, mass in accumulated.items():
        seen = [s[key] for s in selected if key in s]
        caught_up += int(mass >= sum(seen) / len(seen))
    return caught_up >= auto_ratio * len(accumulated)


def selected_mass(params: list[torch.Tensor], state: dict, link: Link, clip: torch.Tensor | None) -> MassReport:
    """This step's RMS per element of the selected gradient columns of every mixed column param, computed on the
    device and copied to the host without a wait (read AUTO_LAG steps later). `clip`: the step's clipping
    coefficient on the device, or None."""
    report, masses, position = MassReport(), [], 0
    for key, p in enumerate(params):
        st = state[p]
        if not offloads(p, st):
            continue  # no copy (and no accumulated mass) for this param this step
        if st.sel.numel():
            report.keys.append(key)
            report.positions.append(position)
            selected = take_columns(as_columns(p.grad), st.sel)
            masses.append(rms(selected))
            report.selected_numels.append(selected.numel())
        position += 1
    if masses:
        values = torch.stack(masses)
        if clip is not None:
            values = values * clip  # the host part accumulates clipped gradients too
        report.selected = link.host_empty((len(masses),), torch.float64)
        report.selected.copy_(values, non_blocking=link.cuda)
        report.selected_ready = link.compute_event()
    return report


def rms(t: torch.Tensor) -> torch.Tensor:
    """RMS per element, summed in fp64 so that the thread count (sync vs overlap) cannot flip a near tie."""
    return torch.linalg.vector_norm(t, dtype=torch.float64) / max(1, t.numel()) ** 0.5
