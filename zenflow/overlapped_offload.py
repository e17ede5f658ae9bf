"""OverlappedOffloadAdamW: ZeRO-Offload whose host AdamW starts during backward, with exact AdamW semantics.

The control a reviewer asks for beside ZenFlow (DeepSpeed issue #6834, prime-rl's offloaded optimizer):
nothing is stale and nothing is selected. Every parameter lives as an fp32 master copy with its AdamW moments in
host memory, as in ZeRO-Offload; what changes is *when* the host works:

1. backward produces a parameter's gradient -> a post-accumulate-grad hook starts its copy to the host (CUDA: on
   the d2h stream, after the compute stream's work so far; the device gradient is dropped at once) and queues that
   parameter's host step on the worker thread, which runs while backward goes on with the earlier layers;
2. `step()` waits for the queued steps and uploads every parameter (CUDA: on the h2d stream; the compute stream
   waits for it, so the next forward reads updated weights).

Each parameter's update is torch's AdamW on its fp32 master copy with the gradient upcast exactly, so in fp32 the
parameters equal `torch.optim.AdamW`'s (tests/core/test_overlapped_offload.py). With `gradient_clipping > 0` the
global norm must be known before any update: the copies still overlap backward and each gradient's norm is taken as
it lands, but the host steps start in `step()`, once the coefficient is known (torch's clip_grad_norm_ coefficient,
computed in the gradients' dtype). The clipped gradient is formed in fp32, the gradient upcast exactly and scaled with
one rounding, never rounded back to its own dtype as torch's in-place clipping writes it: the rule of ZenFlow's host
path (zenflow/host.py accumulate_into_). In fp32 the two agree; for bf16 they differ, and the tests pin
this one. Hyperparameters are read when a parameter's gradient lands (set the learning rate before backward). One
backward per step: gradient accumulation across backward passes is refused (the hook would step twice).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from zenflow.adam import AdamWHyper, adamw_
from zenflow.clip import coefficient
from zenflow.config import ZenFlowConfig
from zenflow.hooks import Observed, Observers
from zenflow.host import accumulate_into_
from zenflow.link import Link
from zenflow.worker import HostWorker


@dataclass
class HostParam:
    """One parameter's host side: fp32 master and moments, the landed gradient and the upload staging."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor            # the gradient as it landed (the parameter's dtype; pinned on CUDA)
    grad32: torch.Tensor          # fp32 scratch: the gradient (clipped) the update reads
    upload: torch.Tensor          # the updated parameter in its dtype (pinned on CUDA)
    step: int = 0
    landed: Any = None            # CUDA: the gradient copy's event; the worker waits for it
    norm: torch.Tensor | None = None  # this step's gradient norm on the device (clipping only)


class OverlappedOffloadAdamW(Observed, torch.optim.Optimizer):
    """AdamW with its state in host memory, each parameter stepped on a worker thread as soon as backward has
    produced its gradient (module docstring). `pt_reserved_cores_perc`: the share of this process's cores kept for
    compute, the rest run the worker (DeepSpeed's meaning, as ZenFlowAdamW)."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, gradient_clipping: float = 0.0,
                 pt_reserved_cores_perc: float = ZenFlowConfig.pt_reserved_cores_perc) -> None:
        if gradient_clipping < 0:
            raise ValueError(f"gradient_clipping = {gradient_clipping!r} is not allowed: expected >= 0 (0: off)")
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.gradient_clipping = float(gradient_clipping)
        self.observers = Observers()
        device = next(p.device for g in self.param_groups for p in g["params"])
        self.link = Link(device, self.observers)
        self.worker = HostWorker(pt_reserved_cores_perc, self.observers)
        self.worker.start()  # here, on the training thread: on CUDA the hooks run on autograd's device thread, and
        #                      starting pins the calling thread to the compute cores
        self.host: dict[torch.Tensor, HostParam] = {}
        self.hyper: dict[torch.Tensor, AdamWHyper] = {}
        self.landed: list[torch.Tensor] = []  # this step's parameters, in the order their gradients landed
        self._hooks = []
        self._group: dict[torch.Tensor, dict[str, Any]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    self.host[p], self._group[p] = self._host_param(p), group
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._gradient_landed))

    def _host_param(self, p: torch.Tensor) -> HostParam:
        master = p.detach().to("cpu", torch.float32, copy=True)
        return HostParam(master=master, exp_avg=torch.zeros_like(master), exp_avg_sq=torch.zeros_like(master),
                         grad=self.link.host_empty(tuple(p.shape), p.dtype), grad32=torch.empty_like(master),
                         upload=self.link.host_empty(tuple(p.shape), p.dtype))

    @property
    def host_state_bytes(self) -> int:
        return sum(sum(t.numel() * t.element_size() for t in (h.master, h.exp_avg, h.exp_avg_sq, h.grad, h.grad32,
                                                             h.upload)) for h in self.host.values())

    # ---- during backward ---------------------------------------------------------------------------------------
    def _gradient_landed(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook (training thread, inside backward): copy out, and step now unless clipping."""
        if p in self.hyper:
            raise RuntimeError("OverlappedOffloadAdamW steps each parameter once per backward: call step() after "
                               "every backward (gradient accumulation across backward passes is not supported)")
        h = self.host[p]
        self.hyper[p] = AdamWHyper.of(self._group[p])
        if self.gradient_clipping:
            h.norm = torch.linalg.vector_norm(p.grad)  # on the device, no sync
        h.landed = self.link.to_host(p.grad, h.grad, "grads")  # CUDA: on the d2h stream; CPU: copied now
        p.grad = None  # the device gradient is no longer needed (CUDA: record_stream keeps it for the copy)
        self.landed.append(p)
        if not self.gradient_clipping:
            self.worker.submit("host_update", lambda: self._host_step(p, None))  # the worker keeps its jobs

    def _host_step(self, p: torch.Tensor, clip: torch.Tensor | None) -> None:
        """On the worker: the parameter's AdamW on its fp32 master copy, cast into the upload buffer."""
        h = self.host[p]
        if h.landed is not None:
            h.landed.synchronize()  # CUDA: this parameter's copy only
        accumulate_into_(h.grad32, h.grad, clip, first=True)  # exact upcast, clipped in fp32
        h.step += 1
        adamw_([h.master], [h.grad32], [h.exp_avg], [h.exp_avg_sq], [h.step], self.hyper[p])
        h.upload.copy_(h.master)

    # ---- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.worker.check()
            if self.gradient_clipping and self.landed:
                clip = self._clip_coefficient()
                for p in self.landed:
                    self.worker.submit("host_update", lambda p=p: self._host_step(p, clip))
            self.worker.quiesce()  # sync point: every host step of this backward (booked as host_wait)
            for p in self.landed:
                self.link.to_device(self.host[p].upload, p.data, "params")  # CUDA: the compute stream waits for it
        finally:  # a failed host step raises here once; the next backward starts a clean step
            self.worker.jobs.clear()
            self.landed.clear()
            self.hyper.clear()
        return loss

    def _clip_coefficient(self) -> torch.Tensor:
        """torch's clip_grad_norm_ coefficient from the norms taken as gradients landed (one device->host sync)."""
        total = torch.linalg.vector_norm(torch.stack([self.host[p].norm for p in self.landed]))
        with self.observers.blocking("clip_sync"):
            value = total.item()  # device->host sync point
        return coefficient(self.gradient_clipping, torch.tensor(value, dtype=total.dtype))

    def close(self) -> None:
        """Finish queued host steps, stop the worker and remove the hooks."""
        self.worker.quiesce()
        self.worker.close()
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def __enter__(self) -> OverlappedOffloadAdamW:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
