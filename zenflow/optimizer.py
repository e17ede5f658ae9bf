"""ZenFlowAdamW: importance-aware offloaded AdamW (the ZenFlow step of docs/design.md §2, top to bottom).

Every trainable parameter with two or more dimensions is a *column param* `W[out, in]` (higher ranks are viewed as
`[out, prod(rest)]`); everything else is a *dense param* updated on the device every step. Each `step()`:

    warm-up (t < W):     every column gradient to the host, host AdamW on all of it, all columns back
    selection (t == W, then every S steps; none if topk_ratio is 0): drain the host part, pick the top-k
                         columns by gradient norm, move values and moments of the columns that change owner
    host state:          built at a parameter's first offload, of its host-owned columns only (ownership.py)
    device:              AdamW on the selected columns and the dense params (fp32 master and moments)
    offload:             the unselected gradient columns to the host accumulator (only those bytes cross); or,
                         with accumulate_on="device", into an fp32 sum on the device that crosses at the boundary
    boundary (every U):  host AdamW on the mean accumulated gradient, then those columns back to the device;
                         inline (sync) or in the background, applied at the next boundary (overlap_step)

The class holds state and order; functions compute: state.py (what is held), device.py and host.py (each side's
work), ownership.py (selection and moves), clip.py, auto_interval.py, distributed.py and fsdp.py (what ranks exchange),
device_accumulation.py (where the unselected columns are summed: HostSums or DeviceSums, chosen once from
accumulate_on), layout.py (which columns a host part spans: compact, or whole rows with shadows, chosen once from
host_layout and the device) and worker.py (the background thread, its cores and jobs).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from zenflow import checkpoint
from zenflow.adam import AdamWHyper
from zenflow.auto_interval import AUTO_LAG, MassReport, boundary_due, selected_mass
from zenflow.clip import Clip, check_gradients
from zenflow.config import (
    ZenFlowConfig,
    check_accumulate_on,
    check_hyperparameters,
    check_params,
    load_deepspeed_config,
)
from zenflow.device import device_update_, upload_
from zenflow.device_accumulation import accumulation, land_, landed_then
from zenflow.fsdp import local_of, ranks_for
from zenflow.hooks import Observed, Observers
from zenflow.host import GradCopy, host_adamw_
from zenflow.layout import check_host_layout, whole_rows
from zenflow.link import Link, StagingArena
from zenflow.ownership import prepare_host_, reselect
from zenflow.selection import as_columns
from zenflow.state import Clock, ColumnState, DenseState, StepView, column_states, host_groups
from zenflow.worker import HostWorker


class ZenFlowAdamW(Observed, torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 zenflow: ZenFlowConfig | dict[str, Any] | None = None, *, gradient_clipping: float = 0.0,
                 skip_nonfinite: bool = False, process_group: Any = None, accumulate_on: str = "host",
                 host_layout: str = "auto") -> None:
        self.config = ZenFlowConfig.coerce(zenflow)
        check_hyperparameters(lr, betas, eps, weight_decay, gradient_clipping)
        # where the unselected gradient columns are summed between boundaries: "host" (they cross every step) or
        # "device" (an fp32 sum crosses once per interval; device_accumulation.py); ours, not a DeepSpeed field
        self.accumulate_on = check_accumulate_on(accumulate_on)
        host_layout = check_host_layout(host_layout)
        self._built = False  # torch's __init__ adds the first groups itself, before the state below exists
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.device = check_params(self.param_groups)
        # which columns a host part spans, decided once: the unselected ones (CUDA) or whole rows with the selected
        # ones as shadows (the CPU device, where no torch kernel moves columns at copy speed); layout.py; ours
        self.whole_rows = whole_rows(host_layout, self.device)
        self.gradient_clipping = float(gradient_clipping)
        self.skip_nonfinite = skip_nonfinite or self.gradient_clipping > 0
        self.select_interval = self.config.resolved_select_interval()
        self.observers = Observers()
        self.link = Link(self.device, self.observers)
        self.arena = StagingArena(self.link)  # every host part's staging buffers: one allocation
        # how ranks share the work, decided once: FSDP2's row shards (fsdp.py) when the parameters are its DTensors,
        # else data parallelism (distributed.py) over the default group when initialized, else a SingleProcess
        self.ranks = ranks_for(self._params(), process_group, self.observers)
        self.ranks.broadcast_from_first_(self._params())  # every rank starts from rank 0's weights
        self.clock = Clock()
        self.worker = HostWorker(self.config.pt_reserved_cores_perc, self.observers)
        # host or device accumulation, decided here once: it owns every step's difference (device_accumulation.py)
        self.accumulation = accumulation(self.accumulate_on, self.link, self.worker, self.config.overlap_step)
        self.pending: Future | None = None  # the host update of the last boundary, not uploaded yet (overlap_step)
        self.auto_history: list[MassReport] = []  # "auto" update_interval: one report per step of the interval
        self.clip = Clip()  # this step's clipping coefficients (none yet)
        self._upload_events: list = []  # CUDA events of the last upload's copies
        for param in self._params():
            self._init_state(param)
        if self.config.overlap_step:
            self.worker.start()  # last: binds cores once, so the whole run computes with the same threads
        self._built = True

    @classmethod
    def from_deepspeed_config(cls, params: Iterable, config: str | Path | dict[str, Any], *,
                              accumulate_on: str = "host") -> ZenFlowAdamW:
        """Build from a whole DeepSpeed JSON file (or dict): optimizer.params, gradient_clipping, zenflow block;
        `accumulate_on` is ours (the zenflow block refuses it)."""
        s = load_deepspeed_config(config)
        return cls(params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay, zenflow=s.zenflow,
                   gradient_clipping=s.gradient_clipping, skip_nonfinite=s.dtype == "fp16", accumulate_on=accumulate_on)

    # ---- state ----------------------------------------------------------------------------------------------
    @property
    def t(self) -> int:
        """Applied steps (skipped overflow steps do not count)."""
        return self.clock.t

    @property
    def skipped_steps(self) -> int:
        return self.clock.skipped_steps

    @property
    def host_updates(self) -> int:
        """Boundaries so far (host AdamW updates)."""
        return self.clock.host_updates

    @property
    def selections(self) -> int:
        """Top-k selections made so far (DeepSpeed's default never re-selects: records log this)."""
        return self.clock.selections

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, and the new parameters join ZenFlow at once (progressive unfreezing): their state is made
        now (host part pending), their columns start on the host like everyone's before a first selection and are
        ranked at the next one. With data parallelism every rank adds the same group."""
        super().add_param_group(param_group)
        if self._built:
            self.device = check_params(self.param_groups)
            self._adopt_new_params()

    def _adopt_new_params(self) -> None:
        """State for trainable parameters that have none: added by add_param_group, or unfrozen
        (`requires_grad_(True)`) after construction. Without it they would never be updated."""
        new = [p for p in self._params() if not self.state.get(p)]
        if new:
            self.ranks.broadcast_from_first_(new)
        for p in new:
            self._init_state(p)
        if new and self.t >= self.config.full_warm_up_rounds:
            self.clock.select_next = True  # rank them on their first gradient (a reselection: the host part drains)

    def _init_state(self, p: torch.Tensor) -> None:
        rows = local_of(p)  # FSDP2: this rank's rows; otherwise the parameter itself
        if p.dim() < 2:
            self.state[p] = DenseState.new(rows)
            return
        width = as_columns(rows).shape[1]
        mine = self.ranks.owned(torch.arange(width), width)  # this host's columns: every one, or this rank's block
        overlap = self.config.overlap_step  # two accumulators: the worker reads one while steps fill the other
        self.state[p] = ColumnState.new(rows, mine, n_accumulators=2 if overlap else 1,
                                        n_staging=self.accumulation.n_staging,  # device accumulation: none
                                        whole_rows=self.whole_rows)

    @property
    def host_state_bytes(self) -> int:
        """Host memory held now: fp32 master, moments and accumulators of the built host parts (host-owned columns
        only) plus the staging arena's capacity (host.host_bytes is the formula; docs/host-worker.md)."""
        parts = [st.host for st in self.state.values() if isinstance(st, ColumnState)]
        return sum(part.state_bytes for part in parts) + self.host_staging_bytes

    @property
    def host_staging_bytes(self) -> int:
        """The staging arena's capacity: the part of host_state_bytes that is pinned on CUDA."""
        return self.arena.capacity

    @property
    def device_accumulator_bytes(self) -> int:
        """Device memory of the fp32 accumulators (accumulate_on="device"; 0 otherwise): 4 bytes per host-owned
        element of every column param that has accumulated so far."""
        sums = [st.d_acc for st in self.state.values() if isinstance(st, ColumnState) and st.d_acc is not None]
        return sum(s.numel() * s.element_size() for s in sums)

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.worker.check()  # a failed background job raises here, never hangs
        self._adopt_new_params()  # unfrozen since the last step
        v = self.ranks.view(self.param_groups, self.state)  # the tensors this rank updates (FSDP2: its rows)
        params = v.params()
        self.ranks.average_gradients_(params, v.state)  # collectives: every rank, every step
        usable, self.clip = check_gradients(params, v.state, self.ranks, self.observers, self.skip_nonfinite,
                                            self.gradient_clipping)
        if not usable:
            self.clock.skipped_steps += 1  # overflow: skipped on both parts, nothing accumulated
            return loss
        warm_up = self.t < self.config.full_warm_up_rounds
        if not warm_up and self._selection_due():
            if self.config.topk_ratio > 0:  # topk 0 selects nothing: no drain, no index syncs
                self.drain()  # the host part must be current before columns change owner
                with self.observers.blocking("reselect"):
                    hypers = {id(p): AdamWHyper.of(g) for g in v.groups for p in g["params"]}
                    reselect(params, v.state, self.config, self.link, self.ranks, hypers)
                self.clock.selections += 1
                self.observers.decided("selection")
            self.clock.select_next = False
        prepare_host_(self.arena, column_states(v.groups, v.state), self.link, self.settle)  # lazy build, staging
        self.arena.pin()  # after a close(): training again
        in_background = self.config.overlap_step and not warm_up
        # host accumulation: the copies start now (CUDA: beside the update); device: nothing crosses before the boundary
        copies = self.accumulation.start_offload(params, v.state, in_background)
        device_update_(v.groups, v.state, self.clip.device)
        self._accumulate(v, copies, in_background)
        self.clock.since_boundary += 1
        if warm_up:
            self._boundary(v, overlap=False)  # warm-up: a full synchronous offload step
        elif self._boundary_due():
            self._boundary(v, overlap=self.config.overlap_step)
        self.clock.t += 1
        return loss

    def _selection_due(self) -> bool:
        since = self.t - self.config.full_warm_up_rounds
        return since == 0 or since % self.select_interval == 0 or self.clock.select_next

    def _boundary_due(self) -> bool:
        if not self.config.auto_update:
            return self.clock.since_boundary >= self.config.update_interval
        return boundary_due(self.auto_history, self.clock.since_boundary, AUTO_LAG, self.config.max_update_interval,
                            self.config.auto_ratio, self.worker.result)

    def _accumulate(self, v: StepView, copies: list[GradCopy], in_background: bool) -> None:
        """Add the step's unselected gradient columns into the fp32 sums (the copies on the host, inline or as a
        worker job with overlap_step; the gradients themselves on the device), and keep the "auto" report."""
        auto, params = self.config.auto_update, v.params()
        report = selected_mass(params, v.state, self.link, self.clip.device) if auto else None
        result, numels = self.accumulation.accumulate(params, v.state, copies, self.clock.slot,
                                                      self.clip.host, auto, in_background)
        if report is not None:
            report.accumulated = result  # the worker's list of masses, the future of it, or the device's masses
            # each rank accumulates its block: the mass of the whole is summed when it is read
            report.combine = functools.partial(self.ranks.whole_rms, numels)
            # FSDP2: each rank holds its rows of the selected columns too (data parallelism: all of them, averaged)
            report.combine_selected = self.ranks.selected_rms(report.selected_numels)
            self.auto_history.append(report)

    def _boundary(self, v: StepView, overlap: bool) -> None:
        """Host AdamW on the accumulated unselected gradients; upload now (sync) or at the next boundary."""
        self.clock.host_updates += 1
        self.observers.decided("host_update")
        self.clock.since_boundary = 0
        self.auto_history.clear()
        # device accumulation: the interval's sums cross now, once (host: they crossed every step, none ship)
        shipped = self.accumulation.ship(column_states(v.groups, v.state), self.clock.slot)
        if not overlap:
            land_(self.link, shipped)  # CUDA sync point: the host update reads them
            with self.observers.blocking("host_update"):
                _after_uploads(self._upload_events, host_groups(v.groups, v.state), self.clock.slot)
            self._upload(v)
            return
        if self.pending is not None:
            self._finish_pending(v)  # boundary b+1 applies the result of boundary b
        # built after _finish_pending: the job must wait for *that* upload's copies
        job = functools.partial(_after_uploads, self._upload_events, host_groups(v.groups, v.state),
                                self.clock.slot)
        if shipped:
            job = functools.partial(landed_then, self.link, shipped, job)  # the worker waits for the sums first
        self.pending = self.worker.submit("host_update", job)  # queued after this interval's accumulations (FIFO)
        self.clock.slot = 1 - self.clock.slot  # double buffer: keep accumulating while the worker reads the other

    def _finish_pending(self, v: StepView) -> None:
        self.worker.wait(self.pending)  # sync point: ideally already done
        self.pending = None
        self._upload(v)

    def _upload(self, v: StepView) -> None:
        # CUDA: the next host job must not overwrite a staging buffer still being read by these copies
        self._upload_events = upload_(v.params(), v.state, self.link, self.ranks)

    def settle(self) -> None:
        """Nothing may read or write a staging buffer any more: the worker's jobs and the last upload's copies are
        waited for (sync point; only when staging moves)."""
        self.worker.quiesce()
        if self._upload_events:  # CUDA
            with self.observers.blocking("host_wait"):
                for event in self._upload_events:
                    event.synchronize()

    @torch.no_grad()
    def drain(self) -> None:
        """Apply every outstanding host update now (a forced boundary), so the device params are current.

        Call it before evaluating or saving the model; reselection calls it too.
        """
        v = self.ranks.view(self.param_groups, self.state)
        if self.pending is not None:
            self._finish_pending(v)
        self.worker.quiesce()  # accumulations still queued on the worker
        if self.clock.since_boundary > 0:
            self._boundary(v, overlap=False)

    # ---- lifecycle ------------------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            self.worker.quiesce()  # the worker may still be reading this step's gradient tensors
        super().zero_grad(set_to_none)

    def close(self, flush: bool = True) -> None:
        """Apply outstanding host updates (flush=True), stop the worker and give the compute cores back."""
        if flush and not self.worker.dead:  # sync mode too: apply what is accumulated
            self.drain()
        self.pending = None  # a later step starts a new worker (a Trainer that trains again after train end)
        self.worker.close()
        self.link.synchronize()  # every copy into or out of the staging has landed: then it may be unpinned
        self._upload_events = []
        self.arena.unpin()

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything for a bit-exact resume (checkpoint.py); torch's state-dict hooks run as for any optimizer."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self.worker.quiesce()  # host state must be complete; a finished overlapped result stays pending its upload
        state_dict = checkpoint.pack(self)
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        checkpoint.unpack(self, state_dict)
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)


def _after_uploads(events: list, groups: list, slot: int) -> None:
    """A host update job: first wait (CUDA) until the previous upload has read the staging buffers."""
    for event in events:
        event.synchronize()
    host_adamw_(groups, slot)
