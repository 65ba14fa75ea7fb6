"""The `lowbit` command: one typer app, one module per subcommand, one error policy.

Errors: a LowbitError prints `lowbit: error: MESSAGE` (one line) and exits with its code;
click's usage errors exit 2 the same way; anything else is a bug and prints one line too,
unless `--debug` (or LOWBIT_DEBUG=1) asks for the traceback.
"""

from __future__ import annotations

import importlib
import os
import sys

import click
import typer

from lowbit.errors import LowbitError

app = typer.Typer(
    name="lowbit",
    help="Quantize LLMs into low-bit formats, convert checkpoints, and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)

# Each subcommand lives in its own module and registers itself on `app` when imported.
COMMAND_MODULES = [
    "assets",
    "convert",
    "eval",
    "quantize",
    "inspect",
    "calibrate",
    "generate",
    "bench",
    "serve",
    "plan",
]


def _register_commands() -> None:
    for name in COMMAND_MODULES:
        try:
            importlib.import_module(f"lowbit.cli.{name}_cmd")
        except ModuleNotFoundError as exc:
            # A command whose module is not written yet is simply absent.
            if exc.name != f"lowbit.cli.{name}_cmd":
                raise


def _fail(message: str, code: int) -> None:
    message = " ".join(str(message).split()) or "failed"
    print(f"lowbit: error: {message}", file=sys.stderr)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get("LOWBIT_DEBUG") == "1"
    if "--debug" in args:
        args.remove("--debug")
        debug = True
    _register_commands()
    command = typer.main.get_command(app)
    try:
        command.main(args=args, prog_name="lowbit", standalone_mode=False)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        _fail("interrupted", 130)
    except click.exceptions.UsageError as exc:
        _fail(exc.format_message(), 2)
    except click.exceptions.ClickException as exc:
        _fail(exc.format_message(), exc.exit_code)
    except LowbitError as exc:
        if debug:
            raise
        _fail(str(exc), exc.exit_code)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    except BrokenPipeError:
        # `lowbit ... | head` closing the pipe is not a failure of ours.
        sys.exit(0)
    except Exception as exc:  # noqa: BLE001 - the last line of defence for the CLI
        if debug:
            raise
        _fail(f"{type(exc).__name__}: {exc} (run with --debug for the traceback)", 1)


if __name__ == "__main__":
    main()
