"""The device side of a step: AdamW on the selected columns and the dense params (fp32 masters and moments), the
start of the unselected gradient columns' way to the host, and the host-updated columns' way back.
"""

from __future__ import annotations

import torch

from zenflow.adam import AdamWHyper, adamw_
from zenflow.distributed import Ranks
from zenflow.host import GradCopy
from zenflow.layout import put_columns, take_columns
from zenflow.link import Link
from zenflow.selection import as_columns
from zenflow.state import ColumnState, offloads


def device_update_(param_groups: list[dict], state: dict, clip: torch.Tensor | None) -> None:
    """AdamW on the device for the selected columns and the dense params, from fp32 masters; `clip`: the step's
    clipping coefficient on the device, or None."""
    for group in param_groups:
        masters, grads, exp_avgs, exp_avg_sqs, steps, writebacks = [], [], [], [], [], []
        for p in group["params"]:
            st = state.get(p)
            if p.grad is None or not st:
                continue
            if isinstance(st, ColumnState):
                if st.sel.numel() == 0:
                    continue
                st.d_step += 1
                masters.append(st.d_master)
                grads.append(take_columns(as_columns(p.grad), st.sel).float())  # a fresh tensor
                exp_avgs.append(st.d_exp_avg)
                exp_avg_sqs.append(st.d_exp_avg_sq)
                steps.append(st.d_step)
                writebacks.append((p, st))
            else:
                st.step += 1
                masters.append(st.master if st.master is not None else p)
                fresh = clip is None or p.grad.dtype != torch.float32  # .float() aliases fp32
                grads.append(p.grad.float() if fresh else p.grad.clone())
                exp_avgs.append(st.exp_avg)
                exp_avg_sqs.append(st.exp_avg_sq)
                steps.append(st.step)
                if st.master is not None:
                    writebacks.append((p, st))
        if clip is not None and grads:
            torch._foreach_mul_(grads, clip)  # on copies: p.grad stays as backward produced it
        adamw_(masters, grads, exp_avgs, exp_avg_sqs, steps, AdamWHyper.of(group))
        for p, st in writebacks:
            if isinstance(st, ColumnState):
                put_columns(as_columns(p), st.sel, st.d_master.to(p.dtype))
            else:
                p.copy_(st.master)


def start_offload(params: list[torch.Tensor], state: dict, link: Link, turn: int) -> list[GradCopy]:
    """Only the unselected gradient columns cross to the host: count their bytes and start their copies into the
    staging buffers of `turn`.

    CUDA: the unselected columns are gathered now on the compute stream (before the device update is queued) and
    their copies into pinned staging start on the d2h stream; nothing here waits, and no job keeps a device tensor,
    so `zero_grad()` frees the gradients at once: only the gathered columns wait for the link. CPU device: the copy
    is done by whoever accumulates (the worker in overlap mode), from the gradient tensor the job holds.
    """
    copies = []
    for p in params:
        st = state[p]
        if not offloads(p, st):
            continue
        staging = st.host.grad_staging[turn]
        # what crosses a link: the unselected columns (whole rows on the CPU device copy the shadows too, uncounted)
        link.observers.transfer("d2h", "grads", st.host.offloaded_elements * p.grad.element_size())
        grad = as_columns(p.grad)
        if link.cuda:
            done = link.gather_to_host(grad, st.unsel, staging)  # gathers now, copies later
            copies.append(GradCopy(st.host, staging, done=done))
        else:
            copies.append(GradCopy(st.host, staging, grad=grad, columns=st.unsel))
    return copies


def upload_(params: list[torch.Tensor], state: dict, link: Link, ranks: Ranks) -> list[torch.cuda.Event]:
    """Host-owned columns with a staged update go back to the device in the model dtype; with data parallelism
    every rank then gets the columns the other ranks' hosts updated. Whole rows: the shadows went up with them, so
    the selected columns are written again from the device's masters (they are what the device holds). Returns the
    copies' events (CUDA): the next host job must not overwrite a staging buffer still being read."""
    events, shared = [], []  # shared: every (weight, state) whose host columns were updated here
    for p in params:
        st = state[p]
        if not isinstance(st, ColumnState) or not st.host.staged:
            continue
        st.host.staged = False
        part = st.host
        counted = part.offloaded_elements * part.param_staging.element_size()  # the shadows cross no link
        done = link.scatter_to_device(part.param_staging, st.unsel, as_columns(p), "params", counted)
        if done is not None:
            events.append(done)
        shared.append((as_columns(p), st))
    ranks.share_blocks_([w for w, _ in shared])
    for weight, st in shared:  # every rank: another rank's block may have brought shadows this one has none of
        if st.host.whole_rows and st.sel.numel():
            put_columns(weight, st.sel, st.d_master.to(weight.dtype))  # the device's own values, exactly
    return events
