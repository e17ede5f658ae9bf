"""ZenFlowAdamW: importance-aware offloaded AdamW (the ZenFlow step of DESIGN §2, top to bottom).

Every trainable parameter with two or more dimensions is a *column param* `W[out, in]` (higher ranks are viewed as
`[out, prod(rest)]`); everything else is a *dense param* updated on the device every step. Each `step()`:

    warm-up (t < W):     every column gradient to the host, host AdamW on all of it, all columns back
    selection (t == W, then every S steps; none if topk_ratio is 0): drain the host part, pick the top-k
                         columns by gradient norm, move values and moments of the columns that change owner
    host state:          built at a parameter's first offload, of its host-owned columns only (ownership.py)
    device:              AdamW on the selected columns and the dense params (fp32 master and moments)
    offload:             the unselected gradient columns to the host accumulator (only those bytes cross)
    boundary (every U):  host AdamW on the mean accumulated gradient, then those columns back to the device;
                         inline (sync) or in the background, applied at the next boundary (overlap_step)
"""

from __future__ import annotations

import functools
import math
import os
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from zenflow import checkpoint
from zenflow.adam import AdamWHyper, adamw_
from zenflow.auto_interval import MassReport, boundary_due
from zenflow.config import ZenFlowConfig, check_hyperparameters, check_params, load_deepspeed_config
from zenflow.distributed import DataParallel
from zenflow.hooks import Observer, Observers, RemovableHandle
from zenflow.host import GradCopy, HostColumns, HostWorker, HostWorkerError, accumulate_, host_adamw_, reserved_cores
from zenflow.link import Link, StagingArena
from zenflow.ownership import offloads, prepare_host_, reselect
from zenflow.selection import as_columns

# "auto" update interval: the boundary decision at a step reads the accumulated mass of the step this many steps
# earlier, the newest one a background worker is sure to have added under the backpressure bound (at most one
# accumulation queued behind the running one). Sync mode uses the same lag, so both fire at the same steps.
AUTO_LAG = 2


class ZenFlowAdamW(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0,
                 zenflow: ZenFlowConfig | dict[str, Any] | None = None, *, gradient_clipping: float = 0.0,
                 skip_nonfinite: bool = False, process_group: Any = None) -> None:
        self.config = ZenFlowConfig.coerce(zenflow)
        check_hyperparameters(lr, betas, eps, weight_decay, gradient_clipping)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.device = check_params(self.param_groups)
        self.gradient_clipping = float(gradient_clipping)
        self.skip_nonfinite = skip_nonfinite or self.gradient_clipping > 0
        self.select_interval = self.config.resolved_select_interval()
        self.observers = Observers()
        self.link = Link(self.device, self.observers)
        self._arena = StagingArena(self.link)  # every host part's staging buffers: one allocation
        # data parallelism (zenflow/distributed.py): the default group when initialized, else none
        self.dp = DataParallel.resolve(process_group, self.observers)
        if self.dp:
            self.dp.broadcast_from_first_(self._params())  # every rank starts from rank 0's weights
        self.t = 0  # applied steps (skipped overflow steps do not count)
        self._select_next = False  # parameters joined since the last selection: select at the next step
        self.skipped_steps = 0
        self.host_updates = 0  # boundaries so far
        self._since_boundary = 0  # steps accumulated since the last boundary
        self._slot = 0  # accumulator being filled (two alternate when overlap_step)
        self._auto_history: list[MassReport] = []  # "auto" update_interval: one report per step of the interval
        self._upload_events: list = []  # CUDA events of the last upload's copies
        self._clip_coef: torch.Tensor | None = None  # this step's clipping coefficient on the device (None: none)
        self._clip_coef_host: torch.Tensor | None = None  # the same value on the host, for the host part
        self._pending: Future | None = None  # the host update of the last boundary (overlap_step)
        self._jobs: list[Future] = []  # every worker job not yet known to be finished, in submission order
        self._accumulations: list[Future] = []  # background accumulations maybe still running (backpressure)
        self._staging_turn = 0  # which gradient staging buffer the next copy lands in (CUDA overlap: two)
        self._worker: HostWorker | None = None
        self._saved_compute_layout: tuple[set[int], int] | None = None
        for param in self._params():
            self._init_state(param)
        if self.config.overlap_step:
            self._start_worker()  # last: binds cores once, so the whole run computes with the same threads

    @classmethod
    def from_deepspeed_config(cls, params: Iterable, config: str | Path | dict[str, Any]) -> ZenFlowAdamW:
        """Build from a whole DeepSpeed JSON file (or dict): optimizer.params, gradient_clipping, zenflow block."""
        s = load_deepspeed_config(config)
        return cls(params, lr=s.lr, betas=s.betas, eps=s.eps, weight_decay=s.weight_decay, zenflow=s.zenflow,
                   gradient_clipping=s.gradient_clipping, skip_nonfinite=s.dtype == "fp16")

    # ---- state ----------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.param_groups for p in g["params"] if p.requires_grad]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim's, and the new parameters join ZenFlow at once (progressive unfreezing): their state is made
        now (host part pending), their columns start on the host like everyone's before a first selection and are
        ranked at the next one. With data parallelism every rank adds the same group."""
        super().add_param_group(param_group)
        if hasattr(self, "link"):  # after construction (torch's __init__ adds the first groups itself)
            self.device = check_params(self.param_groups)
            self._adopt_new_params()

    def _adopt_new_params(self) -> None:
        """State for trainable parameters that have none: added by add_param_group, or unfrozen
        (`requires_grad_(True)`) after construction. Without it they would never be updated."""
        new = [p for p in self._params() if not self.state.get(p)]
        if self.dp and new:
            self.dp.broadcast_from_first_(new)
        for p in new:
            self._init_state(p)
        if new and self.t >= self.config.full_warm_up_rounds:
            self._select_next = True  # rank them on their first gradient (a reselection: the host part drains)

    def _init_state(self, p: torch.Tensor) -> None:
        st = self.state[p]
        if p.dim() >= 2:
            w = as_columns(p)
            mine = torch.arange(w.shape[1])  # this host's columns: every one, or this rank's block of them
            mine = self.dp.owned(mine, w.shape[1]) if self.dp else mine
            # no host buffer yet: built at its first offload (ownership.prepare_host_), of the host's columns only
            st["host"] = HostColumns.pending(w.shape[0], mine, p.dtype, self._n_accumulators, self._n_staging)
            st["sel"] = torch.empty(0, dtype=torch.long, device=p.device)  # device-owned columns (none yet)
            st["unsel"] = mine.to(p.device)  # this host's columns (device copy of its cols)
            st["width"] = w.shape[1]
            empty = torch.zeros(w.shape[0], 0, dtype=torch.float32, device=p.device)
            st.update(d_master=empty, d_exp_avg=empty.clone(), d_exp_avg_sq=empty.clone(), d_step=0)
        else:
            # fp32 params are their own master; lower precision ones get an fp32 master (small updates survive)
            st["master"] = p.detach().float().clone() if p.dtype != torch.float32 else None
            st.update(exp_avg=torch.zeros_like(p, dtype=torch.float32),
                      exp_avg_sq=torch.zeros_like(p, dtype=torch.float32), step=0)

    @property
    def _n_accumulators(self) -> int:
        return 2 if self.config.overlap_step else 1  # overlap: the worker reads one while steps fill the other

    @property
    def _n_staging(self) -> int:  # CUDA overlap: step t's copy lands while the worker reads t-1's; else one job
        return 2 if self.config.overlap_step and self.link.cuda else 1

    def add_observer(self, observer: Observer) -> RemovableHandle:
        """Attach telemetry: it sees every transfer (direction, kind, bytes) and every blocking section."""
        return self.observers.add(observer)

    @property
    def transfer_bytes(self) -> dict[tuple[str, str], int]:
        return dict(self.observers.bytes)

    @property
    def host_state_bytes(self) -> int:
        """Host memory held now: fp32 master, moments and accumulators of the built host parts (host-owned columns
        only) plus the staging arena's capacity (host.host_bytes is the formula; docs/host-worker.md)."""
        return sum(st["host"].state_bytes for st in self.state.values() if "host" in st) + self.host_staging_bytes

    @property
    def host_staging_bytes(self) -> int:
        """The staging arena's capacity: the part of host_state_bytes that is pinned on CUDA."""
        return self._arena.capacity

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_worker_jobs()
        self._adopt_new_params()  # unfrozen since the last step
        if self.dp:
            self.dp.average_gradients_(self._params(), self.state)  # collectives: every rank, every step
        if not self._gradients_usable():
            self.skipped_steps += 1  # overflow: skipped on both parts, nothing accumulated
            return loss
        warm_up = self.t < self.config.full_warm_up_rounds
        if not warm_up and self._selection_due():
            if self.config.topk_ratio > 0:  # topk 0 selects nothing: no drain, no index syncs (audit F9)
                self.drain()  # the host part must be current before columns change owner
                with self.observers.blocking("reselect"):
                    hypers = {id(p): _hyper(g) for g in self.param_groups for p in g["params"]}
                    reselect(self._params(), self.state, self.config, self.link, self.dp, hypers)
            self._select_next = False
        prepare_host_(self._arena, self._column_states(), self.link, self._settle)  # lazy build, staging
        in_background = self.config.overlap_step and not warm_up
        copies = self._start_offload(in_background)  # CUDA: copies start now, beside the device update
        self._device_update()
        self._accumulate(copies, in_background)
        self._since_boundary += 1
        if warm_up:
            self._boundary(overlap=False)  # warm-up: a full synchronous offload step
        elif self._boundary_due():
            self._boundary(overlap=self.config.overlap_step)
        self.t += 1
        return loss

    def _gradients_usable(self) -> bool:
        """Global norm of the whole gradient (before the device/host split); False if it is not finite.

        Clipping keeps one coefficient for both parts, exactly torch's clip_grad_norm_ rule, but instead of
        rewriting every gradient on the training thread it is applied where each part reads its gradient:
        the device to its selected columns, the host (worker) to the columns it accumulates. `p.grad` itself
        is left as backward produced it.
        """
        self._clip_coef = self._clip_coef_host = None
        if not self.skip_nonfinite:
            return True
        grads = [p.grad for p in self._params() if p.grad is not None]
        if not grads:
            return True
        total = self.dp.total_norm(self._params(), self.state) if self.dp else torch.nn.utils.get_total_norm(grads)
        with self.observers.blocking("clip_sync"):
            total_value = total.item()  # device->host sync point (the step's only one)
        finite = math.isfinite(total_value)
        if finite and self.gradient_clipping > 0:
            # torch's clip_grad_norm_ rule, once on the device (no sync) and once on the host from the value
            # just read (so the host part needs no second sync); the same expression, in the norm's dtype
            host_total = torch.tensor(total_value, dtype=total.dtype)  # exact: .item() of that dtype
            self._clip_coef = _clip_coefficient(self.gradient_clipping, total)
            self._clip_coef_host = _clip_coefficient(self.gradient_clipping, host_total)
        return finite

    def _selection_due(self) -> bool:
        since = self.t - self.config.full_warm_up_rounds
        return since == 0 or since % self.select_interval == 0 or self._select_next

    def _column_states(self) -> list[tuple[torch.Tensor, dict]]:
        """(param, state) of every column param, frozen ones too, in parameter order."""
        return [(p, st) for g in self.param_groups for p in g["params"] if "host" in (st := self.state.get(p, {}))]

    def _settle(self) -> None:
        """Nothing may read or write a staging buffer any more: the worker's jobs and the last upload's copies are
        waited for (sync point; only when staging moves)."""
        self._quiesce()
        if self._upload_events:  # CUDA
            with self.observers.blocking("host_wait"):
                for event in self._upload_events:
                    event.synchronize()

    def _boundary_due(self) -> bool:
        if not self.config.auto_update:
            return self._since_boundary >= self.config.update_interval
        return self._auto_boundary_due()

    def _device_update(self) -> None:
        """AdamW on the device for the selected columns and the dense params, from fp32 masters."""
        for group in self.param_groups:
            masters, grads, exp_avgs, exp_avg_sqs, steps, writebacks = [], [], [], [], [], []
            for p in group["params"]:
                st = self.state.get(p)
                if p.grad is None or not st:
                    continue
                if "host" in st:
                    if st["sel"].numel() == 0:
                        continue
                    st["d_step"] += 1
                    masters.append(st["d_master"])
                    grads.append(as_columns(p.grad).index_select(1, st["sel"]).float())  # a fresh tensor
                    exp_avgs.append(st["d_exp_avg"])
                    exp_avg_sqs.append(st["d_exp_avg_sq"])
                    steps.append(st["d_step"])
                    writebacks.append((p, st))
                else:
                    st["step"] += 1
                    master = st["master"] if st["master"] is not None else p
                    masters.append(master)
                    fresh = self._clip_coef is None or p.grad.dtype != torch.float32  # .float() aliases fp32
                    grads.append(p.grad.float() if fresh else p.grad.clone())
                    exp_avgs.append(st["exp_avg"])
                    exp_avg_sqs.append(st["exp_avg_sq"])
                    steps.append(st["step"])
                    if st["master"] is not None:
                        writebacks.append((p, st))
            if self._clip_coef is not None and grads:
                torch._foreach_mul_(grads, self._clip_coef)  # on copies: p.grad stays as backward produced it
            adamw_(masters, grads, exp_avgs, exp_avg_sqs, steps, _hyper(group))
            for p, st in writebacks:
                if "host" in st:
                    as_columns(p).index_copy_(1, st["sel"], st["d_master"].to(p.dtype))
                else:
                    p.copy_(st["master"])

    def _start_offload(self, in_background: bool) -> list[GradCopy]:
        """Only the unselected gradient columns cross to the host. Count their bytes and start their copies.

        CUDA: the unselected columns are gathered now on the compute stream (before the device update is queued)
        and their copies into pinned staging start on the d2h stream; nothing here waits, and no job keeps a
        device tensor, so `zero_grad()` frees the gradients at once: only the gathered columns wait for the link.
        CPU device: the copy is done by whoever accumulates (the worker in overlap mode), from the gradient tensor
        the job holds.
        """
        if in_background:
            self._backpressure()  # the staging buffer about to be written must have been read
        turn = self._staging_turn % self._n_staging
        self._staging_turn += 1
        copies = []
        for p in self._params():
            st = self.state[p]
            if not offloads(p, st):
                continue
            part: HostColumns = st["host"]
            staging = part.grad_staging[turn]
            self.observers.transfer("d2h", "grads", staging.numel() * p.grad.element_size())
            grad = as_columns(p.grad)
            if self.link.cuda:
                done = self.link.gather_to_host(grad, st["unsel"], staging)  # gathers now, copies later
                copies.append(GradCopy(part, staging, done=done))
            else:
                copies.append(GradCopy(part, staging, grad=grad, columns=st["unsel"]))
        return copies

    def _accumulate(self, copies: list[GradCopy], in_background: bool) -> None:
        """Add the copies into the fp32 accumulators: inline, or as a worker job (overlap_step)."""
        report = self._selected_mass() if self.config.auto_update else None
        job = functools.partial(accumulate_, self.link, copies, self._slot, self._clip_coef_host,
                                report is not None)
        if in_background:
            result = self._submit(job)
            self._accumulations.append(result)
        else:
            result = job()
        if report is not None:
            report.accumulated = result  # the worker's list of masses, or the future of it
            if self.dp:  # each rank accumulates its block: the mass of the whole is summed when it is read
                report.combine = functools.partial(self.dp.whole_rms, [c.staging.numel() for c in copies])
            self._auto_history.append(report)

    def _backpressure(self) -> None:
        """At most one accumulation queued behind the running one: wait (a stall) for older ones. This bounds
        the gradient sets background work holds (CPU device) and frees the staging buffer about to be reused."""
        while len(self._accumulations) > 1:
            oldest = self._accumulations.pop(0)
            if not oldest.done():
                with self.observers.blocking("host_wait"):
                    self._worker.wait(oldest)  # sync point: the host part is slower than a step

    def _boundary(self, overlap: bool) -> None:
        """Host AdamW on the accumulated unselected gradients; upload now (sync) or at the next boundary."""
        self.host_updates += 1
        self._since_boundary = 0
        self._auto_history.clear()
        if not overlap:
            with self.observers.blocking("host_update"):
                _after_uploads(self._upload_events, self._host_groups(), self._slot)
            self._upload()
            return
        if self._pending is not None:
            self._finish_pending()  # boundary b+1 applies the result of boundary b
        # built after _finish_pending: the job must wait for *that* upload's copies (audit item 5)
        job = functools.partial(_after_uploads, self._upload_events, self._host_groups(), self._slot)
        self._pending = self._submit(job)  # queued after this interval's accumulations (FIFO)
        self._slot = 1 - self._slot  # double buffer: keep accumulating while the worker reads the other one

    def _finish_pending(self) -> None:
        with self.observers.blocking("host_wait"):
            self._worker.wait(self._pending)  # sync point: ideally already done
        self._pending = None
        self._upload()

    def _upload(self) -> None:
        """Host-owned columns go back to the device in the model dtype."""
        self._upload_events = []  # CUDA: the next host job must not overwrite a staging buffer still being read
        shared = []  # every weight whose host columns were updated here
        for p in self._params():
            st = self.state[p]
            part: HostColumns | None = st.get("host")
            if part is None or not part.staged:
                continue
            part.staged = False
            done = self.link.scatter_to_device(part.param_staging, st["unsel"], as_columns(p), "params")
            if done is not None:
                self._upload_events.append(done)
            shared.append(as_columns(p))
        if self.dp:  # every rank gets the columns the other ranks' hosts updated
            self.dp.share_blocks_(shared)

    @torch.no_grad()
    def drain(self) -> None:
        """Apply every outstanding host update now (a forced boundary), so the device params are current.

        Call it before evaluating or saving the model; reselection calls it too.
        """
        if self._pending is not None:
            self._finish_pending()
        self._quiesce()  # accumulations still queued on the worker
        if self._since_boundary > 0:
            self._boundary(overlap=False)

    def _host_groups(self) -> list[tuple[list[HostColumns], AdamWHyper]]:
        return [([self.state[p]["host"] for p in g["params"] if "host" in self.state.get(p, {})], _hyper(g))
                for g in self.param_groups]

    # ---- "auto" update interval (zenflow/auto_interval.py) --------------------------------------------------
    def _selected_mass(self) -> MassReport:
        """This step's RMS per element of the selected gradient columns of every mixed column param, computed on
        the device and copied to the host without a wait (read AUTO_LAG steps later)."""
        report, masses, position = MassReport(), [], 0
        for key, p in enumerate(self._params()):
            st = self.state[p]
            if not offloads(p, st):
                continue  # no copy (and no accumulated mass) for this param this step
            if st["sel"].numel():
                report.keys.append(key)
                report.positions.append(position)
                masses.append(_rms(as_columns(p.grad).index_select(1, st["sel"])))
            position += 1
        if masses:
            values = torch.stack(masses)
            if self._clip_coef is not None:
                values = values * self._clip_coef  # the host part accumulates clipped gradients too
            report.selected = self.link.host_empty((len(masses),), torch.float64)
            report.selected.copy_(values, non_blocking=self.link.cuda)
            report.selected_ready = self.link.compute_event()
        return report

    def _auto_boundary_due(self) -> bool:
        return boundary_due(self._auto_history, self._since_boundary, AUTO_LAG, self.config.max_update_interval,
                            self.config.auto_ratio, self._wait_for)

    def _wait_for(self, future: Future) -> object:
        if future.done():
            return self._worker.wait(future)
        with self.observers.blocking("host_wait"):
            return self._worker.wait(future)  # sync point: only if the worker is behind the backpressure bound

    # ---- worker lifecycle ------------------------------------------------------------------------------------
    def _start_worker(self) -> HostWorker:
        if self._worker is None:
            split = reserved_cores(self.config.pt_reserved_cores_perc)
            if split is not None:  # the worker gets its own cores; compute keeps the rest
                worker_cores, compute_cores = split
                self._saved_compute_layout = (os.sched_getaffinity(0), torch.get_num_threads())
                os.sched_setaffinity(0, compute_cores)
                torch.set_num_threads(len(compute_cores))
            self._worker = HostWorker(split[0] if split else None)
            self._finalizer = weakref.finalize(self, self._worker.close)
        return self._worker

    def _submit(self, job: Any) -> Future:
        future = self._start_worker().submit(job)
        self._jobs.append(future)
        return future

    def _quiesce(self) -> None:
        """Wait until the worker has finished every job submitted so far (a sync point)."""
        if self._jobs:
            with self.observers.blocking("host_wait"):
                for future in self._jobs:
                    self._worker.wait(future)
            self._jobs.clear()
        self._accumulations.clear()

    def _check_worker_jobs(self) -> None:
        """Raise now if a background job failed or the worker died with work in flight (never hang)."""
        for future in [f for f in self._jobs if f.done()]:
            self._jobs.remove(future)
            if future.exception() is not None:
                raise HostWorkerError(f"zenflow host worker job failed: {future.exception()!r}") \
                    from future.exception()
        if self._jobs and not self._worker.alive:
            raise HostWorkerError("zenflow host worker died with host work in flight; restart from a checkpoint")

    def zero_grad(self, set_to_none: bool = True) -> None:
        if not set_to_none:
            self._quiesce()  # the worker may still be reading this step's gradient tensors
        super().zero_grad(set_to_none)

    def close(self, flush: bool = True) -> None:
        """Apply outstanding host updates (flush=True), stop the worker and give the compute cores back."""
        if flush and (self._worker is None or self._worker.alive):  # sync mode too: apply what is accumulated
            self.drain()
        if self._worker is not None:
            self._worker.close()
            self._worker = None  # a later step starts a new one (a Trainer that trains again after train end)
            self._pending = None
            self._jobs.clear()
            self._accumulations.clear()
        if self._saved_compute_layout is not None:
            cores, threads = self._saved_compute_layout
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
            self._saved_compute_layout = None

    def __enter__(self) -> ZenFlowAdamW:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(flush=exc_type is None)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything for a bit-exact resume (checkpoint.py); torch's state-dict hooks run as for any optimizer."""
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        self._quiesce()  # host state must be complete; a finished overlapped result stays pending its upload
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


def _clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """torch's clip_grad_norm_ rule, computed in the norm's dtype, as fp32."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0).to(torch.float32)


def _rms(t: torch.Tensor) -> torch.Tensor:
    """RMS per element, summed in fp64 so that the thread count (sync vs overlap) cannot flip a near tie."""
    return torch.linalg.vector_norm(t, dtype=torch.float64) / max(1, t.numel()) ** 0.5


def _hyper(group: dict) -> AdamWHyper:
    beta1, beta2 = group["betas"]
    return AdamWHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                      weight_decay=group["weight_decay"])
