"""`dagster-rl status` and `dagster-rl runs`: an experiment's steps, and its latest runs, as tables
read from the instance (and the artifact store: a step whose artifacts are gone reads `missing`).
"""

import argparse
import os
from typing import Any

from assets.chain import CHAIN, step_assets
from assets.cli_inputs import find_experiment, latest, not_ours_message, open_instance, open_store
from assets.run_tags import run_range
from dagster_rl.base.errors import DagsterRLError
from dagster_rl.core.experiment import Experiment
from dagster_rl.core.task import task_of

BASE_COLUMNS = ("step", "state", "cache", "trials", "mean_reward", "success")
LAST_COLUMNS = ("weights_v", "attempt")
NOT_MATERIALIZED = "not materialized"


def cmd_status(args: argparse.Namespace) -> None:
    exp = find_experiment(args.experiment)
    with open_instance() as instance:
        rows = step_rows(instance, exp, open_store(args))
    done = sum(r["state"] == "materialized" and r["step"].isdigit() for r in rows)
    print(f"experiment {exp.name}: {done} of {exp.n_steps} steps materialized")
    print(format_table(rows if args.all else spans_of_missing(rows)))


def step_rows(instance, exp: Experiment, store=None) -> list[dict[str, str]]:
    """One row per step (after a warm-up row when the experiment has one); with a store, a step
    whose artifacts are gone from it reads `missing`."""
    columns, extra = task_columns(exp), [a for a in step_assets(exp) if a not in CHAIN]
    rows = [row] if (row := warmup_row(instance, exp, columns)) else []
    for step in exp.step_keys:
        md = latest(instance, exp, "weights", step)
        if md is None:
            rows.append({"step": step, "state": NOT_MATERIALIZED})
            continue
        if (foreign := not_ours_message(md, f"{exp.name}/weights {step}", step)) is not None:
            rows.append({"step": step, "state": "foreign", "notes": [foreign]})  # type: ignore[dict-item]
            continue
        others = [m for a in extra if (m := latest(instance, exp, a, step)) is not None]  # e.g. its held-out evaluation
        row = {
            "step": step,
            "state": "materialized",
            "cache": str(md.get("cache", "")),
            "trials": f"{md.get('n_trials')}/{md.get('n_trials_planned')}",
            "mean_reward": f"{md.get('mean_reward', float('nan')):.3f}",
            "success": f"{md.get('success_rate', float('nan')):.2f}",
            **{
                c: _shown(v)
                for c, key in columns.items()
                if (v := next((m[key] for m in [md, *others] if key in m), None)) is not None
            },
            "weights_v": str(md.get("weights_version", "")),
            "attempt": str(md.get("attempt", "")),
        }
        notes = []
        if md.get("skipped_trials"):
            notes.append(f"{md['skipped_trials']} trials failed after their retries; a re-run of the step attempts them again")
        if md.get("supersedes"):
            notes.append(f"supersedes the materialization of {md['supersedes']}: {md.get('supersedes_reason', '')}")
        if store is not None:
            gone = [a for a in CHAIN if not _artifact_present(instance, exp, a, step, store)]
            if gone:
                row["state"] = "missing"
                notes.append(
                    f"its {', '.join(gone)} artifact(s) are not in the store (moved aside or deleted): re-run from step {step}"
                )
        row["notes"] = notes  # type: ignore[assignment]
        rows.append(row)
    return rows


def warmup_row(instance, exp: Experiment, columns: dict[str, str]) -> dict[str, str] | None:
    """The warm-up's row (`<exp>/sft`, computed once before step 0000), or None when it has none."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is None:
        return None
    md = latest(instance, exp, spec.name, None)
    if md is None:
        return {"step": spec.name, "state": NOT_MATERIALIZED}
    shown = {c: _shown(md[key]) for c, key in columns.items() if key in md}
    return {"step": spec.name, "state": "materialized", "cache": str(md.get("cache", "")), **shown, "weights_v": "0"}


def task_columns(exp: Experiment) -> dict[str, str]:
    """The columns the experiment's task adds to the table (column -> metadata key): the agentic
    task's `mean_turns`, a language model's held-out accuracy."""
    return dict(task_of(exp.kind).status_columns)


def _shown(value: Any) -> str:
    """A number as the table shows it: 3 significant digits (`0.805`, `3.17`, `1`)."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _artifact_present(instance, exp: Experiment, asset: str, step: str, store) -> bool:
    from assets.predecessor import artifact_of

    md = latest(instance, exp, asset, step)
    try:
        return md is not None and store.exists(*artifact_of(md, asset))
    except DagsterRLError:
        return False


def format_table(rows: list[dict[str, str]], columns: tuple[str, ...] | None = None) -> str:
    """The rows as a table: the base columns, the task's (only those some row fills), weights_v, attempt."""
    if columns is None:
        middle = {c for r in rows for c in r} - {*BASE_COLUMNS, *LAST_COLUMNS, "notes"}
        columns = (*BASE_COLUMNS, *sorted(middle), *LAST_COLUMNS)
    widths = {c: max(len(c), *(len(r.get(c, "")) for r in rows)) for c in columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in columns)]
    lines += ["  ".join(r.get(c, "").ljust(widths[c]) for c in columns).rstrip() for r in rows]
    notes = [f"{r['step']}: {note}" for r in rows for note in r.get("notes", [])]
    return "\n".join(lines + notes)


def spans_of_missing(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """The rows, with each run of consecutive steps not materialized as one row `FIRST...LAST`."""
    out: list[dict[str, str]] = []
    for row in rows:
        last = out[-1] if out else None
        missing = row["state"] == NOT_MATERIALIZED and row["step"].isdigit()  # a step, not the warm-up
        if missing and last is not None and last["state"] == NOT_MATERIALIZED and last["step"][:4].isdigit():
            out[-1] = {**last, "step": f"{last['step'][:4]}...{row['step']}"}
        else:
            out.append(row)
    return out


def cmd_runs(args: argparse.Namespace) -> None:
    """The experiment's latest runs, newest first: id, status, steps, start, and a failed run's error."""
    from dagster import RunsFilter

    from assets.run_tags import EXPERIMENT_TAG

    exp = find_experiment(args.experiment)
    with open_instance() as instance:
        runs = instance.get_run_records(RunsFilter(tags={EXPERIMENT_TAG: exp.name}), limit=args.limit)
        rows = [
            {
                "run": r.dagster_run.run_id,
                "status": r.dagster_run.status.value,
                "steps": r.dagster_run.tags.get("dagster_rl/range") or run_range(r.dagster_run.tags) or "-",
                "started": _when(r.start_time),
                "error": run_error(instance, r.dagster_run) if r.dagster_run.status.value == "FAILURE" else "",
            }
            for r in runs
        ]
    if not rows:
        print(f"no run of {exp.name} in {os.environ['DAGSTER_HOME']}")
        return
    columns = ("run", "status", "steps", "started")
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns).rstrip())
    for r in rows:
        print("  ".join(r[c].ljust(widths[c]) for c in columns).rstrip())
        if r["error"]:
            print("    " + r["error"].replace("\n", "\n    "))


def _when(timestamp: float | None) -> str:
    from datetime import datetime

    return datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S") if timestamp else "-"


def run_error(instance, run) -> str:
    """The error a failed run's log records: its failed step's, else the run's own."""
    from dagster import DagsterEventType

    from assets.console import user_error

    for event_type in (DagsterEventType.STEP_FAILURE, DagsterEventType.RUN_FAILURE):
        records = instance.get_records_for_run(run.run_id, of_type=event_type, limit=1).records
        error = getattr(records[0].event_log_entry.dagster_event.event_specific_data, "error", None) if records else None
        if error is not None:
            return user_error(error)
    return "(no error recorded: see the run's log in the UI)"
