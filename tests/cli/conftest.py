"""The one way the CLI tests run `lowbit`: in process, with exit code, stdout and stderr."""

from __future__ import annotations

import pytest

from lowbit.cli.main import main


@pytest.fixture
def run_cli(capsys):
    """run_cli(args) -> (exit code, stdout, stderr) of `lowbit ARGS`, without what fixtures printed before."""

    def run(args):
        capsys.readouterr()
        with pytest.raises(SystemExit) as info:
            main(args)
            raise SystemExit(0)
        captured = capsys.readouterr()
        return info.value.code or 0, captured.out, captured.err

    return run
