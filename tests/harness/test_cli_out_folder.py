"""An output folder the user cannot write to is refused (zenflow/harness/cli.py, every reproduce
script's --out).

The promises: harness/cli.py's docstring, "an output folder is checked (a writable folder, or one that can be
created)"; `folder_problem`: "it must be a writable folder, or creatable", with the messages "is a folder this user
cannot write to" and "cannot be created: ... is not writable"; every bad input is one line on stderr with exit
status 2. The tests run as root, where `os.access(..., W_OK)` is true for every folder, so write permission is
faked: `os.access` answers False for the one folder under test and asks the real one for everything else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zenflow.harness import cli


@pytest.fixture
def unwritable(monkeypatch, tmp_path):
    """A folder this user may not write to (as a non-root user would see a read-only one)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    real_access = os.access

    def access(path, mode, *args, **kwargs):
        if Path(path) == folder and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "access", access)
    return folder


def test_the_fake_leaves_other_folders_writable(unwritable, tmp_path):
    assert cli.folder_problem(tmp_path) is None  # the control: a writable folder is accepted


def test_an_existing_folder_the_user_cannot_write_to_is_refused(unwritable):
    assert cli.folder_problem(unwritable) == "is a folder this user cannot write to"


def test_a_folder_that_would_be_created_inside_an_unwritable_one_is_refused(unwritable):
    assert cli.folder_problem(unwritable / "new" / "run") == f"cannot be created: {str(unwritable)!r} is not writable"


def test_out_refuses_an_unwritable_folder_in_one_line_with_exit_status_2(unwritable, capsys):
    parser = cli.ArgumentParser(prog="reproduce.py")
    parser.add_argument("--out", type=cli.out_folder)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--out", str(unwritable)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --out" in err and "cannot write to" in err, err
