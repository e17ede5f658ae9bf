"""The claims page of results/README.md is generated from the committed tables (zenflow/reports/claims.py,
claim_list.py): it regenerates byte for byte, every claim reads only the files it names, a missing file fails
loudly, every cell is a headline, every verdict comes from the claim's rule, and no number is typed by hand outside
the generated block."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zenflow.reports import claim_analog, claim_list, claims
from zenflow.reports.claim import CELL_LIMIT, VERDICTS, Files
from zenflow.reports.claims import CLAIMS, RESULTS, ClaimError

README = RESULTS / "README.md"
# References that are not data: a figure's or section's number, a model's name, a placeholder in a path.
REFERENCES = re.compile(r"Fig(ure|\.) \d+|§\d+|Llama-2-\d+B")


def _declared_only(root: Path, claim: claims.Claim, leave_out: str | None = None) -> None:
    """`root` holding links to the claim's own files (less `leave_out`), and to their folders' run records, which
    the rerun times read."""
    for name in claim.files:
        if name != leave_out:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).symlink_to(RESULTS / name)
    for _, timed_by in claim.rerun:
        if timed_by and timed_by != leave_out:
            for record in (RESULTS / timed_by).parent.glob("*.json"):
                link = (root / timed_by).parent / record.name
                if record.relative_to(RESULTS).as_posix() != leave_out and not link.is_symlink():
                    link.symlink_to(record)


class _Reads(dict):
    """The numbers, recording which ones a verdict rule reads."""

    def __init__(self, numbers: dict) -> None:
        super().__init__(numbers)
        self.keys_read: set[str] = set()

    def __getitem__(self, key: str) -> object:
        self.keys_read.add(key)
        return super().__getitem__(key)


def test_claims_page_regenerates_byte_identical() -> None:
    text = README.read_text()
    assert text.count(claims.BEGIN) == 1 and text.count(claims.END) == 1
    assert claims.replace_block(text, claims.block()) == text, \
        "results/README.md's claims page differs from the committed tables: python -m zenflow.reports.claims"
    assert claims.main(["--check"]) == 0


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.key)
def test_each_claim_reads_only_its_files_and_uses_every_number(claim: claims.Claim, tmp_path: Path) -> None:
    _declared_only(tmp_path, claim)
    assert claim.cells(tmp_path) == claim.cells(RESULTS)  # nothing read outside `files`
    assert claim.section(tmp_path) == claim.section(RESULTS)
    numbers = claim.numbers(Files(RESULTS, claim.files))
    read = _Reads(numbers)
    claim.verdict(read)
    assert set(numbers) == claim.fields() | read.keys_read, \
        "a number is extracted but neither shown nor judged by, or shown but not extracted"
    assert all(v is not None for v in numbers.values()), numbers


@pytest.mark.parametrize("claim", [c for c in CLAIMS if c.files], ids=lambda c: c.key)
def test_a_missing_committed_file_fails_the_claim(claim: claims.Claim, tmp_path: Path) -> None:
    for name in claim.files:
        root = tmp_path / name.replace("/", "_")
        _declared_only(root, claim, leave_out=name)
        with pytest.raises(ClaimError, match="is missing"):
            claim.cells(root) + [claim.section(root)]  # the row and its section: each file is read by one of them


def test_a_file_not_declared_cannot_be_read() -> None:
    with pytest.raises(ClaimError, match="not among the claim's files"):
        Files(RESULTS, ("llama7b/x/table.csv",)).csv("glue/x/table.csv")


def test_every_cell_is_a_headline_and_every_verdict_one_of_the_vocabulary() -> None:
    for claim in CLAIMS:
        cells = claim.cells(RESULTS)
        assert all(len(cell) <= CELL_LIMIT for cell in cells), [(claim.key, len(c), c) for c in cells
                                                                 if len(c) > CELL_LIMIT]
        assert cells[5].strip("*") in VERDICTS
    assert len({c.key for c in CLAIMS}) == len(CLAIMS)


def test_a_cell_over_the_limit_is_caught_by_the_same_check() -> None:
    long = claim_list.CLAIMS[0].__class__(**{**vars(claim_list.CLAIMS[0]), "headline": "ref-zenflow {zf} " + "x" * 120})
    assert max(len(cell) for cell in long.cells(RESULTS)) > CELL_LIMIT


def test_a_verdict_outside_the_vocabulary_is_refused() -> None:
    odd = claim_list.CLAIMS[0].__class__(**{**vars(claim_list.CLAIMS[0]), "verdict": lambda n: "mostly"})
    with pytest.raises(ClaimError, match="not one of"):
        odd.cells(RESULTS)


@pytest.mark.parametrize("low, high, verdict", [(1.1, 1.3, "holds"), (0.9, 1.2, "no difference"),
                                                (0.6, 0.8, "does not hold"), (None, None, "not measured here"),
                                                (1.0, 1.3, "no difference"), (0.8, 1.0, "no difference")])
def test_a_speedup_is_judged_by_its_interval(low: float | None, high: float | None, verdict: str) -> None:
    assert claim_list.faster(low, high) == verdict


@pytest.mark.parametrize("low, verdict", [(3.3, "holds"), (2.3, "partly"), (0.9, "no difference")])
def test_the_end_to_end_speedup_must_reach_the_papers_lowest_to_hold(low: float, verdict: str) -> None:
    assert claim_list.speedup_verdict({"zf_low": low, "zf_high": 4.0, "paper_low": 3.2}) == verdict


@pytest.mark.parametrize("zf, off, verdict", [(1.12, 2.0, "holds"), (1.5, 2.0, "partly"), (2.0, 2.0, "does not hold")])
def test_pcie_bytes_hold_within_five_percent_of_the_papers(zf: float, off: float, verdict: str) -> None:
    assert claim_list.pcie_verdict({"zf_bytes": zf, "off_bytes": off, "paper_zf": 1.13, "paper_off": 2.0}) == verdict


@pytest.mark.parametrize("reduction, verdict", [(85.0, "holds"), (84.9, "partly"), (0.0, "does not hold")])
def test_stalls_hold_from_eighty_five_percent(reduction: float, verdict: str) -> None:
    assert claim_list.stall_verdict({"zf_red": reduction}) == verdict


@pytest.mark.parametrize("llama, glue, verdict", [(True, True, "holds"), (False, True, "partly"),
                                                  (False, False, "does not hold")])
def test_time_to_target_needs_both_workloads_to_hold(llama: bool, glue: bool, verdict: str) -> None:
    assert claim_list.time_to_target_verdict({"llama_held": llama, "glue_held": glue}) == verdict


@pytest.mark.parametrize("fp32, verdict", [(4000, "holds"), (2938, "partly"), (1500, "does not hold")])
def test_selection_holds_only_as_sent(fp32: float, verdict: str) -> None:
    assert claim_list.selection_verdict({"l7_ratio": fp32, "l7_bf16": 2 * fp32, "blog_ratio": 4000}) == verdict


def test_every_link_on_the_claims_page_exists() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", claims.block())
    assert links
    for link in links:
        assert (RESULTS / link).resolve().exists(), link
    anchors = re.findall(r"\]\(#([^)]+)\)", claims.table())
    assert anchors == [c.anchor() for c in CLAIMS] and len(set(anchors)) == len(CLAIMS)


def hand_typed_numbers(readme: str) -> list[str]:
    """Numbers outside the generated block: what is left of each line once the block, code spans, link targets and
    references (a figure's or section's number, a model's name) are taken out."""
    outside = readme[:readme.index(claims.BEGIN)] + readme[readme.index(claims.END):]
    found = []
    for line in outside.splitlines():
        text = REFERENCES.sub("", re.sub(r"\]\([^)]*\)", "]", re.sub(r"`[^`]*`", "", line)))
        found += [line.strip() for _ in re.findall(r"\d", text)[:1]]
    return found


def test_no_number_is_typed_by_hand_outside_the_generated_block() -> None:
    assert hand_typed_numbers(README.read_text()) == []


def test_a_hand_typed_number_outside_the_block_is_found() -> None:
    readme = README.read_text() + "\nTelemetry overhead: 0.017% of the step.\n"
    assert hand_typed_numbers(readme) == ["Telemetry overhead: 0.017% of the step."]
    assert hand_typed_numbers("See Fig. 1 and `make reproduce-llama7b` and [x](a/b2.md).\n" + claims.BEGIN
                              + "\n12 ms\n" + claims.END) == []


def test_without_markers_the_readme_is_refused() -> None:
    with pytest.raises(ClaimError, match="no"):
        claims.replace_block("# no table here\n", claims.block())


@pytest.mark.parametrize("low, verdict", [(0.4, "holds"), (0.1, "partly"), (-1.7, "does not hold"),
                                          (None, "not measured here")])
def test_the_hidden_share_holds_from_four_tenths(low: float | None, verdict: str) -> None:
    high = None if low is None else low + 0.3
    assert claim_list.hidden_verdict({"zf_hidden_low": low, "zf_hidden_high": high}) == verdict


@pytest.mark.parametrize("llama, glue, verdict", [("holds", "holds", "holds"), ("undecided", "holds", "partly"),
                                                  ("fails", "undecided", "does not hold"),
                                                  ("undecided", "undecided", "not measured here")])
def test_auto_holds_where_the_knobs_study_could_decide(llama: str, glue: str, verdict: str) -> None:
    assert claim_list.auto_verdict({"llama_verdict": llama, "glue_verdict": glue}) == verdict


@pytest.mark.parametrize("reached, low, high, verdict", [(5, 1.1, 1.5, "holds"), (5, 0.9, 1.3, "no difference"),
                                                         (5, 0.6, 0.9, "does not hold"), (4, None, None,
                                                                                          "does not hold")])
def test_the_analog_time_to_loss_holds_only_reached_every_round_and_faster(reached, low, high, verdict) -> None:
    n = {"reached": reached, "compared": 5, "loss_low": low, "loss_high": high}
    assert claim_analog.time_to_loss_verdict(n) == verdict


def test_each_analog_verdict_sits_right_under_the_claim_it_judges_again() -> None:
    keys = [c.key for c in CLAIMS]
    assert [k for k in keys if not k.endswith("-GA")] == [c.key for c in claim_list.CLAIMS]
    for analog in claim_analog.CLAIMS:
        assert keys[keys.index(analog.key) - 1] == claim_analog.PARENT[analog.key]
        assert analog.headline.startswith(claim_analog.ANALOG)  # every such cell says where it was measured


def test_the_analog_point_is_the_one_regime_csv_marks(tmp_path: Path) -> None:
    sweep = tmp_path / claim_analog.SWEEP
    sweep.parent.mkdir(parents=True)
    sweep.write_text("tokens,rho,analog_point\n2,0.37,True\n4,0.22,False\n")
    files = Files(tmp_path, (claim_analog.SWEEP,))
    assert claim_analog.analog_point(files)["tokens"] == 2.0
    sweep.write_text("tokens,rho,analog_point\n2,0.37,False\n4,0.22,False\n")  # none marked: refused, never guessed
    with pytest.raises(ClaimError, match="analog point"):
        claim_analog.analog_point(files)
