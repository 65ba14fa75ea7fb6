"""The file fuzzers of tests/fuzz/test_fuzz_files.py, run longer than CI runs them.

    python bench/fuzz_long.py --examples 2000              # every fuzz test, 2000 examples each (about 1-2 h on 2 cores)
    python bench/fuzz_long.py --examples 500 -k gguf       # only the GGUF tests
    python bench/fuzz_long.py --examples 2000 --seed 7     # a seeded random run: other examples than CI's fixed ones
    python bench/fuzz_long.py --atheris gguf --runs 20000  # coverage-guided, straight into the readers
    python bench/fuzz_long.py --atheris safetensors --runs 20000
    python bench/fuzz_long.py --atheris stats --runs 20000

Hypothesis mode runs the same strategies and the same contract as CI (one `lowbit: error:` line or a
valid result; tests/fuzz/conftest.py), through pytest, with LOWBIT_FUZZ_EXAMPLES examples per test;
failures shrink to a minimal example unless --no-shrink. Without --seed the examples are the
derandomized sequence CI starts with, extended.

Atheris mode (needs `pip install atheris`) mutates the tiny inputs the suite builds and feeds each
mutant to the readers in process, without the CLI around them: `gguf` opens the file, builds its
config, plans and checks every tensor and dequantizes each one, and builds the tokenizer; `safetensors`
loads a tiny float checkpoint whose model.safetensors is the mutant (runtime/loader.py), then reads it
as a lowbit checkpoint's weights (formats/native.py); `stats` opens a STATS file and checks it against
its model. A LowbitError with a one-line message is the expected end of a bad input; any other
exception, or a message of several lines, is a crash, which atheris reports with the input that
caused it (saved as crash-* in the current folder). Extra arguments go to libFuzzer (e.g.
-max_total_time=600 -jobs=2).
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `tests.fuzz.conftest` holds the builders both modes use

from lowbit.errors import LowbitError  # noqa: E402 - after the path; a leaf module, nothing to instrument


def run_hypothesis(args: argparse.Namespace) -> int:
    import pytest

    os.environ["LOWBIT_FUZZ_EXAMPLES"] = str(args.examples)
    if args.no_shrink:
        os.environ["LOWBIT_FUZZ_NO_SHRINK"] = "1"
    argv = [str(ROOT / "tests" / "fuzz" / "test_fuzz_files.py"), "-q", "-p", "no:randomly", "--timeout=0",
            "--durations=0", "-o", "addopts=--import-mode=importlib -p no:cacheprovider"]
    if args.seed is not None:
        os.environ["LOWBIT_FUZZ_SEED"] = str(args.seed)
        argv.append(f"--hypothesis-seed={args.seed}")
    if args.k:
        argv += ["-k", args.k]
    return int(pytest.main(argv))


# ---------------------------------------------------------------------------------------------
# atheris


def _one_line(exc: BaseException) -> None:
    """The expected end of a bad input: a LowbitError whose message is one line."""
    message = str(exc)
    if "\n" in message or not message.strip():
        raise AssertionError(f"LowbitError message is not one line: {message!r}")


def _gguf_target(work: Path):
    from lowbit.formats.gguf_arch import arch_spec
    from lowbit.formats.gguf_import import _embeddings_tied, _plan_tensors
    from lowbit.formats.gguf_reader import open_gguf
    from lowbit.formats.gguf_tokenizer import write_tokenizer_files

    path = work / "fuzz.gguf"
    tokenizer_dir = work / "tokenizer"
    tokenizer_dir.mkdir(exist_ok=True)

    def target(data: bytes) -> None:
        path.write_bytes(data)
        gguf = open_gguf(path)
        spec = arch_spec(gguf)
        config = spec.build_config(gguf)
        for name, _ in _plan_tensors(gguf, spec, _embeddings_tied(gguf), config):
            gguf.tensor(name)
        write_tokenizer_files(gguf, tokenizer_dir)

    return target


def _safetensors_target(work: Path, inputs):
    from lowbit.formats.native import load_native
    from lowbit.runtime.loader import load_model

    model = work / "model"
    quant = work / "quant"
    shutil.copytree(inputs.hf, model, dirs_exist_ok=True)
    shutil.copytree(inputs.quant, quant, dirs_exist_ok=True)

    def target(data: bytes) -> None:
        (model / "model.safetensors").write_bytes(data)
        (quant / "model.safetensors").write_bytes(data)
        errors = []
        for read in (lambda: load_model(model), lambda: load_native(quant)):
            try:
                read()
            except LowbitError as exc:
                errors.append(exc)
        for exc in errors:
            _one_line(exc)

    return target


def _stats_target(work: Path, inputs):
    from lowbit.compress.calibrate import LayerwiseModel
    from lowbit.compress.stats import StatsFile

    identity = LayerwiseModel(inputs.hf).identity()
    path = work / "stats.safetensors"

    def target(data: bytes) -> None:
        path.write_bytes(data)
        StatsFile(path).check(identity)

    return target


def run_atheris(args: argparse.Namespace, rest: list[str]) -> int:
    try:
        import atheris
    except ImportError:
        print("atheris is not installed (pip install atheris)", file=sys.stderr)
        return 2
    from tests.fuzz.conftest import build_inputs

    with atheris.instrument_imports():
        import lowbit.compress.stats  # noqa: F401 - instrumented for coverage
        import lowbit.formats.gguf_arch  # noqa: F401
        import lowbit.formats.gguf_import  # noqa: F401
        import lowbit.formats.gguf_reader  # noqa: F401
        import lowbit.formats.gguf_tokenizer  # noqa: F401
        import lowbit.formats.hf_files  # noqa: F401
        import lowbit.formats.native  # noqa: F401
        import lowbit.runtime.config  # noqa: F401
        import lowbit.runtime.loader  # noqa: F401

    work = Path(tempfile.mkdtemp(prefix="lowbit-atheris-"))
    atexit.register(shutil.rmtree, work, True)  # libFuzzer ends the process through exit()
    inputs = build_inputs(work / "inputs")
    seed_file = {"gguf": inputs.gguf, "safetensors": inputs.hf / "model.safetensors", "stats": inputs.stats}[args.atheris]
    target = {"gguf": lambda: _gguf_target(work), "safetensors": lambda: _safetensors_target(work, inputs),
              "stats": lambda: _stats_target(work, inputs)}[args.atheris]()
    corpus = work / f"corpus-{args.atheris}"
    corpus.mkdir()
    (corpus / "seed").write_bytes(seed_file.read_bytes())

    def one_input(data: bytes) -> None:
        try:
            target(data)
        except LowbitError as exc:
            _one_line(exc)

    libfuzzer = [sys.argv[0], str(corpus), f"-runs={args.runs}", f"-max_len={max(4096, 2 * seed_file.stat().st_size)}", *rest]
    print(f"atheris {args.atheris}: seed {seed_file.name} ({seed_file.stat().st_size} bytes), corpus {corpus}", file=sys.stderr)
    atheris.Setup(libfuzzer, one_input)
    atheris.Fuzz()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=2000, help="Hypothesis examples per test (CI runs 20-120).")
    parser.add_argument("--seed", type=int, default=None, help="A seeded random run instead of the derandomized sequence.")
    parser.add_argument("-k", default=None, help="Only the tests whose names match (pytest -k).")
    parser.add_argument("--no-shrink", action="store_true", help="Report failures as found, without shrinking them.")
    parser.add_argument("--atheris", choices=("gguf", "safetensors", "stats"), default=None,
                        help="Coverage-guided fuzzing of one reader with atheris instead of the Hypothesis suite.")
    parser.add_argument("--runs", type=int, default=20000, help="With --atheris: inputs to try (-1: until stopped).")
    args, rest = parser.parse_known_args()
    if args.atheris:
        return run_atheris(args, rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return run_hypothesis(args)


if __name__ == "__main__":
    sys.exit(main())
