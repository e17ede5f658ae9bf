"""What docs/step-semantics.md promises about reselection, each pinned directly.

- A column that changes owner keeps its bias-corrected moments m/(1-b1^s), v/(1-b2^s) exactly at the move, in
  both directions, also when the two sides have made different numbers of updates; nothing is zeroed.
- A reselection moves only the columns that change owner: leaving ones down (d2h), entering ones up (h2d).
- Selection first drains the host part ("forced boundary"), in sync and in overlap mode alike.

An observer sees the state at the edges of the "reselect" blocking section: after the drain, before and after the
columns move. betas are not (0, 0), so a wrong moment changes every number compared here.
"""

from __future__ import annotations

import pytest
import torch
from helpers import Interleaved, clone_model, column_params, feed, grad_stream, zenflow

BETAS = (0.9, 0.99)
# W=2, U=3, S=4: the first selection hands the warm-up state (host count 2 = device count 2) to the device; the
# next ones meet a host that has made fewer updates than the device (t=6: device 6, host 4; t=10: 10 vs 6).
BLOCK = dict(topk_ratio=0.25, full_warm_up_rounds=2, update_interval=3, select_interval=4)
STEPS = 12


def column_state(opt, p: torch.Tensor) -> dict:
    """Per column of `p` (`[out, in]`, fp64), wherever it lives: fp32 master, raw and bias-corrected moments,
    the owner's step count, and which columns the device owns. With ParamsAtReselection.on_block_start, the only
    code here that reads the optimizer's state layout (adapt them, not the tests, if the layout changes)."""
    st = opt.state[p]
    part = st.host
    width = st.width
    sel, host_cols = st.sel.cpu(), part.offloaded_cols  # whole rows: not the shadows of the selected columns
    out: dict = {"sel": sel.clone(), "d_step": st.d_step, "h_step": part.step}
    steps = torch.zeros(width, dtype=torch.float64)
    steps[host_cols], steps[sel] = float(part.step), float(st.d_step)
    out["steps"] = steps
    master = torch.zeros(p.shape[0], width, dtype=torch.float64)
    master[:, host_cols], master[:, sel] = part.offloaded(part.master).double(), st.d_master.double().cpu()
    out["master"] = master
    for name, beta in (("exp_avg", BETAS[0]), ("exp_avg_sq", BETAS[1])):
        raw = torch.zeros(p.shape[0], width, dtype=torch.float64)
        raw[:, host_cols], raw[:, sel] = (part.offloaded(getattr(part, name)).double(),
                                          getattr(st, f"d_{name}").double().cpu())
        # a zero count means a zero moment (nothing to correct); keep the raw value there
        correction = torch.where(steps > 0, 1 - beta ** steps, torch.ones_like(steps))
        out[name], out[f"{name}_hat"] = raw, raw / correction
    return out


class AtReselection:
    """Snapshots the column state of every column param on entering and leaving each reselection."""

    def __init__(self, opt, params: list[torch.Tensor]) -> None:
        self.opt, self.params = opt, params
        self.before: list[list[dict]] = []
        self.after: list[list[dict]] = []
        self.bytes: list[dict] = []
        self._inside = False

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        if self._inside:
            key = (direction, kind)
            self.bytes[-1][key] = self.bytes[-1].get(key, 0) + nbytes

    def on_block_start(self, what: str) -> None:
        if what == "reselect":
            self.before.append([column_state(self.opt, p) for p in self.params])
            self.bytes.append({})
            self._inside = True

    def on_block_end(self, what: str) -> None:
        if what == "reselect":
            self._inside = False
            self.after.append([column_state(self.opt, p) for p in self.params])


def run_with_observer(overlap: bool, dtype: torch.dtype = torch.float32, steps: int = STEPS,
                      block: dict = BLOCK) -> AtReselection:
    model = Interleaved([12, 10, 6], dtype=dtype, seed=2)
    opt = zenflow(model, betas=BETAS, overlap_step=overlap, **block)  # lr 1e-2, weight decay 0.1
    seen = AtReselection(opt, column_params(model))
    opt.add_observer(seen)
    try:
        feed(model, opt, grad_stream(model, steps, seed=4))
    finally:
        opt.close()
    assert len(seen.before) == len(seen.after) == 1 + (steps - 1 - block["full_warm_up_rounds"]) // \
        block["select_interval"]
    return seen


def moved(before: dict, after: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(columns leaving the device, columns entering it) at one reselection."""
    old, new = set(before["sel"].tolist()), set(after["sel"].tolist())
    return torch.tensor(sorted(old - new), dtype=torch.long), torch.tensor(sorted(new - old), dtype=torch.long)


def assert_corrected_moments_kept(before: dict, after: dict, cols: torch.Tensor) -> None:
    for name in ("exp_avg_hat", "exp_avg_sq_hat"):
        # exact up to the fp32 rounding of the rescaled moment (one multiply); skipping the rescale is off by
        # (1-b^s_new)/(1-b^s_old), tens of percent here
        torch.testing.assert_close(after[name][:, cols], before[name][:, cols], rtol=1e-6, atol=0,
                                   msg=lambda m, n=name: f"{n} of moved columns {cols.tolist()}: {m}")
    assert (after["exp_avg_sq"][:, cols] > 0).all(), "moved second moments are zero"


@pytest.mark.parametrize("overlap", [False, True])
def test_first_selection_hands_the_warm_up_moments_to_the_device_unchanged(overlap):
    seen = run_with_observer(overlap)
    for before, after in zip(seen.before[0], seen.after[0]):
        leaving, entering = moved(before, after)
        assert leaving.numel() == 0 and entering.numel() > 0  # nothing was on the device yet
        assert after["d_step"] == after["h_step"] == BLOCK["full_warm_up_rounds"]  # device continues the count
        for name in ("master", "exp_avg", "exp_avg_sq"):  # same count on both sides: bit for bit
            assert torch.equal(after[name][:, entering], before[name][:, entering]), name
        assert_corrected_moments_kept(before, after, entering)


@pytest.mark.parametrize("overlap", [False, True])
def test_columns_leaving_the_device_keep_their_bias_corrected_moments(overlap):
    seen = run_with_observer(overlap)
    checked = 0
    for at_before, at_after in zip(seen.before[1:], seen.after[1:]):
        for before, after in zip(at_before, at_after):
            leaving, _ = moved(before, after)
            assert before["d_step"] > before["h_step"] > 0  # the sides disagree on the count: a real rescale
            assert torch.equal(after["master"][:, leaving], before["master"][:, leaving])
            assert_corrected_moments_kept(before, after, leaving)
            assert (after["steps"][leaving] == before["h_step"]).all()  # now counted by the host
            checked += leaving.numel()
    assert checked > 0, "no column left the device: the test checks nothing"


@pytest.mark.parametrize("overlap", [False, True])
def test_columns_entering_the_device_keep_their_bias_corrected_moments(overlap):
    seen = run_with_observer(overlap)
    checked = 0
    for at_before, at_after in zip(seen.before[1:], seen.after[1:]):
        for before, after in zip(at_before, at_after):
            _, entering = moved(before, after)
            assert before["d_step"] > before["h_step"] > 0
            assert torch.equal(after["master"][:, entering], before["master"][:, entering])
            assert_corrected_moments_kept(before, after, entering)
            assert (after["steps"][entering] == before["d_step"]).all()  # now counted by the device
            checked += entering.numel()
    assert checked > 0, "no column entered the device: the test checks nothing"


def test_columns_that_keep_their_owner_are_untouched_by_a_reselection():
    seen = run_with_observer(False)
    for at_before, at_after in zip(seen.before, seen.after):
        for before, after in zip(at_before, at_after):
            leaving, entering = moved(before, after)
            stay = torch.ones(before["master"].shape[1], dtype=torch.bool)
            stay[leaving], stay[entering] = False, False
            for name in ("master", "exp_avg", "exp_avg_sq", "steps"):
                assert torch.equal(after[name][..., stay], before[name][..., stay]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reselection_bytes_are_leaving_columns_down_and_entering_columns_up(dtype):
    """fp32 master (4 bytes) and two fp32 moments per element of each moved column, whatever the model dtype."""
    seen = run_with_observer(False, dtype=dtype)
    for at_before, at_after, got in zip(seen.before, seen.after, seen.bytes):
        down = up = 0
        for before, after in zip(at_before, at_after):
            leaving, entering = moved(before, after)
            rows = before["master"].shape[0]
            down, up = down + leaving.numel() * rows * 4, up + entering.numel() * rows * 4
        assert up > 0
        assert got.get(("d2h", "master"), 0) == down and got.get(("d2h", "moments"), 0) == 2 * down, got
        assert got.get(("h2d", "master"), 0) == up and got.get(("h2d", "moments"), 0) == 2 * up, got
    assert any(b.get(("d2h", "master"), 0) > 0 for b in seen.bytes), "no column ever left the device"


# ---- overlap + reselection: selection drains first -------------------------------------------------------------
# W=1, U=2; S=4 reselects right after a boundary (the drain only waits for and uploads the overlapped result),
# S=5 in the middle of an interval (the drain also runs a forced host update on what has accumulated).
OVERLAP_BLOCK = dict(topk_ratio=0.3, full_warm_up_rounds=1, update_interval=2)
SELECT_INTERVALS = [4, 5]


class ParamsAtReselection:
    """Model parameters on entering each reselection (after the forced boundary), and whether the host part was
    drained: no host result pending, nothing accumulated, every host-owned column of the weight equal to its
    host master (uploaded)."""

    def __init__(self, opt, model: torch.nn.Module) -> None:
        self.opt, self.model = opt, model
        self.params: list[list[torch.Tensor]] = []
        self.drained: list[bool] = []

    def on_transfer(self, direction: str, kind: str, nbytes: int) -> None:
        pass

    def on_block_start(self, what: str) -> None:
        if what != "reselect":
            return
        self.params.append([p.detach().clone() for p in self.model.parameters()])
        ok = self.opt.pending is None
        for p in column_params(self.model):
            part = self.opt.state[p].host
            ok &= not any(part.counts) and not part.staged
            columns = part.offloaded_cols  # whole rows: the shadows hold stale values, the device the true ones
            ok &= torch.equal(p.detach().view(p.shape[0], -1)[:, columns].float(), part.offloaded(part.master))
        self.drained.append(bool(ok))

    def on_block_end(self, what: str) -> None:
        pass


def run_drained(model: torch.nn.Module, overlap: bool, select_interval: int, steps: int = 15) -> ParamsAtReselection:
    opt = zenflow(model, betas=BETAS, overlap_step=overlap, **OVERLAP_BLOCK, select_interval=select_interval)
    seen = ParamsAtReselection(opt, model)
    opt.add_observer(seen)
    try:
        feed(model, opt, grad_stream(model, steps, seed=9))
        opt.drain()
    finally:
        opt.close()
    return seen


@pytest.mark.parametrize("select_interval", SELECT_INTERVALS)
@pytest.mark.parametrize("overlap", [False, True])
def test_host_part_is_drained_whenever_columns_change_owner(overlap, select_interval):
    seen = run_drained(Interleaved([12, 10, 6], seed=3), overlap, select_interval)
    assert len(seen.drained) == 1 + 13 // select_interval  # t = 1, 1+S, ...
    assert all(seen.drained), seen.drained


@pytest.mark.parametrize("select_interval", SELECT_INTERVALS)
def test_overlap_with_reselection_equals_sync_where_the_docs_say_they_coincide(select_interval):
    """Fixed gradients: overlap only delays uploads, so after each forced boundary (every reselection) and after
    the final drain the parameters equal the sync run's bit for bit."""
    model = Interleaved([12, 10, 6], seed=3)
    sync, overlap = clone_model(model), clone_model(model)
    seen_sync = run_drained(sync, False, select_interval)
    seen_overlap = run_drained(overlap, True, select_interval)
    assert len(seen_sync.params) == len(seen_overlap.params) == 1 + 13 // select_interval
    for i, (a, b) in enumerate(zip(seen_sync.params, seen_overlap.params)):
        for p, q in zip(a, b):
            assert torch.equal(p, q), f"reselection {i}"
    for p, q in zip(sync.parameters(), overlap.parameters()):
        assert torch.equal(p, q)
