"""``python -m bench`` from the repository root."""

import typer

from bench.cli import bench

if __name__ == "__main__":
    typer.run(bench)
