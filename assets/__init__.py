"""The Dagster asset graph: one driver multi-asset per experiment, jobs, Definitions."""

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent  # the repository root: workspace.yaml, experiments/, and `assets` for a child's PYTHONPATH
