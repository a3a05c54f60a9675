"""``python benchmarks/bench.py``: run with the parsed options, print the table, write the
JSON and the plot."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from harness.config import Config, add_arguments, config_from_args
from harness.environment import environment
from harness.measure import Run
from harness.report import format_table, plot

__all__ = ["run", "run_from_args", "main"]


def run(cfg: Config) -> dict[str, Any]:
    """Run the benchmark, print the table, write the JSON and the plot.

    Returns
    -------
    dict
        Everything measured (what the JSON holds).
    """
    if cfg.runs_measurements:
        data = Run(cfg).run()
    else:
        meta = environment(cfg.is_cuda, cfg.index)
        data = {"meta": meta, "config": asdict(cfg), "skipped": {}}
    if "dask" not in cfg.skip:
        from harness.dask import format_dask, measure

        data["dask"] = measure(cfg)
        if cfg.json_path:
            Path(cfg.json_path).write_text(json.dumps(data, indent=1))
    print()
    if cfg.runs_measurements:
        print(format_table(data), flush=True)
    if "dask" in data:
        print(format_dask(data["dask"]), flush=True)
    if cfg.plot_path and ("results" in data or "overhead" in data):  # (what the plot draws)
        try:
            plot(data, cfg.plot_path)
            print(f"\nplot: {cfg.plot_path}")
        except Exception as e:  # a missing matplotlib must not lose the numbers
            print(f"\nno plot: {type(e).__name__}: {e}", file=sys.stderr)
    if cfg.json_path:
        print(f"json: {cfg.json_path}")
    return data


def run_from_args(args: argparse.Namespace) -> int:
    """Run once the options are parsed (2: a usage error)."""
    try:
        cfg = config_from_args(args)
    except argparse.ArgumentTypeError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    run(cfg)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``bench`` options (as :func:`add_arguments`) and run."""
    parser = argparse.ArgumentParser(prog="python benchmarks/bench.py")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))
