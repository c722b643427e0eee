"""The Dagster asset graph: one driver multi-asset per experiment, jobs, Definitions."""
