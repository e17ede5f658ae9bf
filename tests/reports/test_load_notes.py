"""The scenario table's machine-load notes (reports/scenario.py): runs taken while other processes held
the CPU are named as BUSY, quiet ones are not, and records from before the counters say nothing."""

from __future__ import annotations

from zenflow.harness.records import RunRecord
from zenflow.reports.scenario import host_state_notes, load_notes


def run(engine: str, outside: float | None, steal: float = 0.0) -> RunRecord:
    load = None if outside is None else {"measured": True, "outside_cpu_fraction": outside,
                                         "steal_fraction": steal, "window_s": 10.0}
    return RunRecord(engine=engine, status="ok", protocol={} if load is None else {"machine_load": load})


def test_a_run_under_load_is_named_busy_and_a_quiet_one_is_not() -> None:
    notes = load_notes([run("no-offload", 0.01), run("ref-zenflow", 0.45), run("ref-offload", 0.02, steal=0.2)])
    assert notes[0].startswith("- Machine load") and "worst 45.0% (ref-zenflow)" in notes[0]
    busy = notes[1]
    assert busy.startswith("- BUSY MACHINE") and "ref-zenflow (45% other" in busy and "ref-offload (2% other" in busy
    assert "no-offload" not in busy


def test_quiet_runs_get_the_summary_only() -> None:
    """Runs up to 9% elsewhere are quiet: the summary names no run as BUSY, and counts the run that was not
    measured (a record from before the counters) in its "of"."""
    notes = load_notes([run("no-offload", 0.01), run("ref-zenflow", 0.03), run("ds-zenflow", 0.09),
                        run("ref-offload", None)])
    assert notes == ["- Machine load during the timed steps (other processes + hypervisor steal, from the kernel's "
                     "counters): median 3.0% of the CPU, worst 9.0% (ds-zenflow); 3 of 4 runs measured"]


def test_a_run_over_ten_percent_is_named_busy_and_the_note_says_so() -> None:
    """docs/records.md: every run above 10% is BUSY; 12% is a run the bound is there to catch."""
    notes = load_notes([run("no-offload", 0.01), run("ref-zenflow", 0.12)])
    assert len(notes) == 2, notes
    assert notes[1].startswith("- BUSY MACHINE (over 10% of the CPU elsewhere): ref-zenflow (12% other processes, "
                               "0% steal): these rows")


def test_records_before_the_counters_add_no_note() -> None:
    """Committed tables made from older records regenerate unchanged."""
    assert load_notes([run("no-offload", None), run("ref-zenflow", None)]) == []


def ranked(engine: str, world: int, host_state: int | None, rss: int | None = None) -> RunRecord:
    metrics = {k: v for k, v in (("host_state_bytes", host_state), ("peak_rss_bytes", rss)) if v is not None}
    return RunRecord(engine=engine, status="ok", protocol={"world_size": world}, metrics=metrics)


def test_several_ranks_give_each_engines_host_memory_per_rank() -> None:
    """The 2-rank table says what each rank holds on its host; an engine that does not count its host
    state says so rather than showing a number."""
    notes = host_state_notes([ranked("ref-zenflow-fsdp2", 2, 45_000_000, 595_000_000),
                              ranked("ref-zenflow", 2, 43_000_000, 566_000_000), ranked("ref-zenflow", 2, 41_000_000),
                              ranked("fsdp2-offload", 2, None, 592_000_000)])
    assert notes == ["- Host memory per rank (rank 0's records, medians): ref-zenflow host state 42 MB, peak RSS "
                     "566 MB; ref-zenflow-fsdp2 host state 45 MB, peak RSS 595 MB; fsdp2-offload host state not "
                     "counted, peak RSS 592 MB"]


def test_one_process_adds_no_host_memory_note() -> None:
    assert host_state_notes([ranked("ref-zenflow", 1, 43_000_000, 566_000_000)]) == []
