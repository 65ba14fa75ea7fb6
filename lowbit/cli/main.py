"""The `lowbit` command: one typer app, one module per subcommand, one error policy.

Errors: a LowbitError prints `lowbit: error: MESSAGE` (one line) and exits with its code;
click's usage errors exit 2 the same way; anything else is a bug and prints one line too,
unless `--debug` (or LOWBIT_DEBUG=1) asks for the traceback.

Signals, for shell pipelines (`lowbit quantize … && lowbit eval …`): Ctrl-C (SIGINT) exits 130 and
SIGTERM 143, each with one line. Outputs are written to a temporary sibling and renamed only when
complete (formats/atomic.py), so an interrupted command has written nothing; calibrated quantize
and calibrate runs resume from their work folder when rerun. `lowbit serve` replaces the SIGTERM
handler with its own graceful shutdown (exit 0) once the server runs.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys

import click
import typer

try:  # typer >= 0.29 ships its own copy of click; its commands raise that copy's exceptions
    from typer import exceptions as _typer_exc
    from typer._click import exceptions as _typer_click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    _typer_exc = _typer_click_exc = click.exceptions

from lowbit.cli import help_format
from lowbit.errors import LowbitError

app = typer.Typer(
    name="lowbit",
    help="Quantize LLMs into low-bit formats, convert checkpoints, and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            number = version("lowbit")
        except PackageNotFoundError:  # run from a source tree that was never installed
            number = "unknown"
        print(f"lowbit {number}")
        raise typer.Exit(0)


@app.callback()
def _root(
    _version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                  help="Print lowbit's version and exit."),
    _debug: bool = typer.Option(False, "--debug",
                                help="Print the full traceback of an error instead of its one line (also "
                                "LOWBIT_DEBUG=1); may stand anywhere on the command line."),
) -> None:
    """Quantize LLMs into low-bit formats, convert checkpoints, and run them."""


# Each subcommand lives in its own module and registers itself on `app` when imported.
COMMAND_MODULES = [
    "assets",
    "convert",
    "eval",
    "quantize",
    "inspect",
    "calibrate",
    "distill",
    "generate",
    "bench",
    "serve",
    "plan",
    "doctor",
]


def _register_commands() -> None:
    help_format.install()
    for name in COMMAND_MODULES:
        try:
            importlib.import_module(f"lowbit.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            # A command whose module is not written yet is simply absent.
            if exc.name != f"lowbit.cli.{name}_cmd":
                raise
    help_format.set_short_helps(app.registered_commands)


_EXIT = (click.exceptions.Exit, _typer_exc.Exit)
_ABORT = (click.exceptions.Abort, _typer_exc.Abort)
_USAGE = (click.exceptions.UsageError, _typer_click_exc.UsageError)
_CLICK = (click.exceptions.ClickException, _typer_click_exc.ClickException)


def _fail(message: str, code: int) -> None:
    message = " ".join(str(message).split()) or "failed"
    print(f"lowbit: error: {message}", file=sys.stderr)
    sys.exit(code)


INTERRUPTED = ("interrupted (SIGINT): no output was written; a calibrated quantize or calibrate run resumes "
               "when rerun")
TERMINATED = ("terminated (SIGTERM): no output was written; a calibrated quantize or calibrate run resumes "
              "when rerun")


class Terminated(BaseException):
    """Raised by the SIGTERM handler; a BaseException so that no `except Exception` swallows it."""


def _on_sigterm(signum, frame) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("LOWBIT_DEBUG") == "1"
    if "--debug" in args:
        args.remove("--debug")
        debug = True
    _register_commands()
    command = typer.main.get_command(app)
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        # Under standalone_mode=False click returns the exit code of an abort (130 for Ctrl-C)
        # instead of raising it: it must not be dropped.
        code = command.main(args=args, prog_name="lowbit", standalone_mode=False)
    except _EXIT as exc:
        sys.exit(exc.exit_code)
    except _ABORT:
        _fail(INTERRUPTED, 130)
    except Terminated:
        _fail(TERMINATED, 143)
    except _USAGE as exc:
        if not args:  # `lowbit` alone: the help was the answer; no error line after it
            sys.exit(2)
        _fail(exc.format_message(), 2)
    except _CLICK as exc:
        _fail(exc.format_message(), exc.exit_code)
    except LowbitError as exc:
        if debug:
            raise
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail(INTERRUPTED, 130)
    except BrokenPipeError:
        # `lowbit ... | head` closing the pipe is not a failure of ours.
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - the last line of defence for the CLI
        if debug:
            raise
        _fail(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)", 1)
    if code == 130:
        _fail(INTERRUPTED, 130)
    if isinstance(code, int) and code != 0:
        sys.exit(code)


if __name__ == "__main__":
    main()
