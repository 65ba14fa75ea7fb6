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


@pytest.fixture
def gptq_digest(run_cli):
    """gptq_digest(src, text, out, *extra, fmt="int4") -> sha256 of the checkpoint that
    `lowbit quantize SRC --format FMT -g 32 --method gptq --data TEXT` (4 × 32 tokens) writes."""
    import hashlib

    def run(src, text, out, *extra, fmt="int4"):
        code, _, err = run_cli(["quantize", str(src), "--format", fmt, "--group-size", "32", "--method", "gptq",
                                "--data", str(text), "--samples", "4", "--seqlen", "32", "-o", str(out), *extra])
        assert code == 0, err
        return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()

    return run
