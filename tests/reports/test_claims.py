"""The claims table of results/README.md is generated from the committed tables (zenflow/reports/claims.py): it
regenerates byte for byte, every entry reads only the files it names, and a missing file fails loudly."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zenflow.reports import claims
from zenflow.reports.claims import CLAIMS, RESULTS, ClaimError

README = RESULTS / "README.md"


def _declared_only(root: Path, claim: claims.Claim, leave_out: str | None = None) -> None:
    """`root` holding links to the claim's own files only (less `leave_out`)."""
    for name in claim.files:
        if name != leave_out:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).symlink_to(RESULTS / name)


def test_claims_table_regenerates_byte_identical() -> None:
    text = README.read_text()
    assert text.count(claims.BEGIN) == 1 and text.count(claims.END) == 1
    assert claims.replace_block(text, claims.block()) == text, \
        "results/README.md's claims table differs from the committed tables: python -m zenflow.reports.claims"
    assert claims.main(["--check"]) == 0


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.claim[:40])
def test_each_claim_reads_only_its_files_and_uses_every_number(claim: claims.Claim, tmp_path: Path) -> None:
    _declared_only(tmp_path, claim)
    assert claim.cells(tmp_path) == claim.cells(RESULTS)  # nothing read outside `files`
    numbers = claim.numbers(claims.Files(RESULTS, claim.files))
    assert set(numbers) == claim.fields(), "a number is extracted but not shown, or shown but not extracted"
    assert all(v is not None for v in numbers.values()), numbers


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: c.claim[:40])
def test_a_missing_committed_file_fails_the_claim(claim: claims.Claim, tmp_path: Path) -> None:
    for name in claim.files:
        root = tmp_path / name.replace("/", "_")
        _declared_only(root, claim, leave_out=name)
        with pytest.raises(ClaimError, match="is missing"):
            claim.cells(root)


def test_a_file_not_declared_cannot_be_read(tmp_path: Path) -> None:
    with pytest.raises(ClaimError, match="not among the claim's files"):
        claims.Files(RESULTS, ("llama7b/x/table.csv",)).csv("glue/x/table.csv")


def test_every_link_in_the_claims_table_exists() -> None:
    links = re.findall(r"\]\(([^)]+)\)", claims.table())
    assert links
    for link in links:
        assert (RESULTS / link).resolve().exists(), link


def test_without_markers_the_readme_is_refused() -> None:
    with pytest.raises(ClaimError, match="no"):
        claims.replace_block("# no table here\n", claims.block())
