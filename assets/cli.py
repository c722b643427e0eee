"""`dagster-rl`: train an experiment's steps, and what the Dagster CLI does not say directly, read
from the Dagster instance and the artifact store ($DAGSTER_HOME/artifacts unless `--artifacts`
names another fsspec URL); and the subcommands tasks add (`dagster-rl serve`: a model over vLLM's
OpenAI-compatible API).

`train` runs a range of steps as one run of the experiment's `<exp>_train` job of the workspace's
code location (in this process: no daemon needed; the UI shows it as a run it launched), after
checking the experiment, the range and DAGSTER_HOME, and prints the concise console
(`assets.console`). Artifacts are found by the key a materialization records, checked to be a
content key, under the store given here: metadata never becomes a path, and a moved DAGSTER_HOME
or store still works. `status`, `runs`, `lineage` and `verify` only read: a bad artifact is
reported, never moved; `verify --repair` moves the bad ones to the store's quarantine (as a run that
reads them would).

Dagster, torch and the task's heavy modules are imported by the commands that use them, so that
`--help` and `status` answer at once (`bench/cli_startup.py` measures it).
"""

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

from assets import REPO  # the child of `_in_own_group` imports `assets` from here
from assets.chain import CHAIN, step_assets
from assets.experiments import experiments_dir, missing_folder, problems, read
from assets.run_tags import RESUME, range_tags, run_range
from dagster_rl.core.errors import CorruptArtifactError, DagsterRLError, StoreLinkError
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.task import BUILTIN_TASKS, task_of

BASE_COLUMNS = ("step", "state", "cache", "trials", "mean_reward", "success")
LAST_COLUMNS = ("weights_v", "attempt")
NOT_MATERIALIZED = "not materialized"


def latest(instance, exp: Experiment, asset: str, step: str | None) -> dict | None:
    """The metadata values of the latest materialization of `<exp>/<asset>` for `step` (None: an
    unpartitioned asset, the warm-up), and its run id."""
    from dagster import AssetKey, AssetRecordsFilter

    key = AssetKey([exp.name, asset])
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=key, asset_partitions=[step]) if step is not None else key, limit=1
    ).records
    if not records:
        return None
    return {"run_id": records[0].run_id, **{k: v.value for k, v in records[0].asset_materialization.metadata.items()}}


def _shown(value: Any) -> str:
    """A number as the table shows it: 3 significant digits (`0.805`, `3.17`, `1`)."""
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def task_columns(exp: Experiment) -> dict[str, str]:
    """The columns the experiment's task adds to the table (column -> metadata key): the agentic
    task's `mean_turns`, a language model's held-out accuracy."""
    return dict(task_of(exp.kind).status_columns)


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
        if (foreign := _not_ours(md, f"{exp.name}/weights {step}", step)) is not None:
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
            **{c: _shown(v) for c, key in columns.items() if (v := next((m[key] for m in [md, *others] if key in m), None)) is not None},
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
                notes.append(f"its {', '.join(gone)} artifact(s) are not in the store (moved aside or deleted): re-run from step {step}")
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


def _not_ours(md: dict, what: str, step: str) -> str | None:
    from assets.predecessor import not_ours

    return not_ours(md, what, step or "0000")


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


def _experiment(name: str) -> Experiment:
    files = read()
    if (missing := missing_folder(files)) is not None:
        sys.exit(f"dagster-rl: {missing}")
    if name in files.experiments:
        if files.errors:
            print(f"dagster-rl: {problems(files)}", file=sys.stderr)
        return files.experiments[name]
    broken = [m for path, m in files.errors.items() if Path(path).stem == name]
    if broken:
        sys.exit("dagster-rl: " + "\n".join(broken))
    known = ", ".join(sorted(files.experiments)) or "none"
    more = f"\n{problems(files)}" if files.errors else ""
    sys.exit(f"dagster-rl: no experiment named {name!r} in {experiments_dir()}; known: {known}{more}")


def _store(args: argparse.Namespace, repair: bool = False):
    """The artifact store, read-only unless `repair` (verify --repair): nothing is moved aside."""
    from dagster_rl.store.artifact_store import ArtifactStore
    from resources.artifact_store import default_artifact_url

    return ArtifactStore(args.artifacts or default_artifact_url(), quarantine=repair)


NEW_HOME = (
    "make demo creates one there; or:\n"
    "    mkdir -p $DAGSTER_HOME && cp deploy/dagster.local.yaml $DAGSTER_HOME/dagster.yaml && .venv/bin/dagster instance migrate"
)


def home_problem() -> str | None:
    """What is wrong with $DAGSTER_HOME for Dagster (unset, relative, not a folder), and what to do."""
    from resources.artifact_store import DAGSTER_HOME_UNSET

    home = os.environ.get("DAGSTER_HOME", "").strip()
    if not home:
        return DAGSTER_HOME_UNSET
    if not os.path.isabs(home):
        return f"DAGSTER_HOME={home} is a relative path, which Dagster refuses: set an absolute one, e.g.\n    export DAGSTER_HOME=$PWD/{home}"
    if not Path(home).is_dir():
        return f"DAGSTER_HOME={home} is not a folder: {NEW_HOME}"
    return None


def _instance():
    """The instance of $DAGSTER_HOME; exits saying what to set when it cannot be one (never a throwaway one)."""
    problem = home_problem()
    if problem:
        sys.exit(f"dagster-rl: {problem}")
    from dagster import DagsterInstance

    return DagsterInstance.get()


def cmd_status(args: argparse.Namespace) -> None:
    exp = _experiment(args.experiment)
    with _instance() as instance:
        rows = step_rows(instance, exp, _store(args))
    done = sum(r["state"] == "materialized" and r["step"].isdigit() for r in rows)
    print(f"experiment {exp.name}: {done} of {exp.n_steps} steps materialized")
    print(format_table(rows if args.all else spans_of_missing(rows)))


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


def parse_range(exp: Experiment, text: str | None) -> tuple[int, int]:
    """(first, last) of `FIRST...LAST` or one step (`7`, `0007`); every step when None. Exits
    with what to write instead when it is not a range of the experiment's steps."""
    if text is None:
        return 0, exp.n_steps - 1
    ends = text.split("...")
    every = f"{exp.name}'s steps are 0000...{step_key(exp.n_steps - 1)}"
    if len(ends) > 2 or not all(e.isdigit() for e in ends):
        sys.exit(f"dagster-rl: {text!r} is not a range of steps: give FIRST...LAST (e.g. 0008...0011) or one step (e.g. 8); {every}")
    first, last = int(ends[0]), int(ends[-1])
    if last >= exp.n_steps:
        sys.exit(
            f"dagster-rl: the range {text} goes past the last step of {exp.name}, {step_key(exp.n_steps - 1)} "
            f"(n_steps: {exp.n_steps} in its experiment file): give a range within 0000...{step_key(exp.n_steps - 1)}, or raise n_steps"
        )
    if first > last:
        sys.exit(f"dagster-rl: the range {text} starts after it ends: give it as {step_key(last)}...{step_key(first)}")
    return first, last


def cmd_train(args: argparse.Namespace) -> None:
    """Check the experiment, the range and DAGSTER_HOME; then, in a child process of a session of its
    own (`_in_own_group`), check that the steps before the range are materialized and run the range
    as one run of `<exp>_train` on the instance, in that process, with the concise console."""
    exp = _experiment(args.experiment)
    first, last = parse_range(exp, args.range)
    if (problem := home_problem()) is not None:
        sys.exit(f"dagster-rl: {problem}")
    if not args.run_here:
        sys.exit(_in_own_group(["train", exp.name, f"{step_key(first)}...{step_key(last)}", "--log-level", args.log_level], args))
    with _instance() as instance:
        from assets.predecessor import missing_before

        missing = missing_before(instance, exp, first)
        if missing:
            sys.exit(
                f"dagster-rl: step {step_key(first)} of {exp.name} starts from the weights of step {step_key(first - 1)}, which "
                f"are not materialized (missing: {', '.join(missing[:8])}{'...' if len(missing) > 8 else ''}). Run from step "
                f"{missing[0]}, e.g.\n    .venv/bin/dagster-rl train {exp.name} {missing[0]}...{step_key(last)}"
            )
        result = _execute(instance, exp, first, last, args.log_level)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the run has ended as it says: a late Ctrl-C changes nothing
        if not result.success:
            sys.exit(INTERRUPTED_EXIT if _was_interrupted(instance, result.run_id) else 1)  # the console said why


INTERRUPTED_EXIT = 130  # as a shell reports a command ended by Ctrl-C
PARENT_FD = "DAGSTER_RL_PARENT_FD"  # the child's end of a pipe to `dagster-rl train`: EOF when it is gone


def _in_own_group(argv: list[str], args: argparse.Namespace) -> int:
    """Run `dagster-rl <argv>` (the run itself) in a child process in a session of its own, and
    relay Ctrl-C, SIGTERM and SIGHUP to it as one SIGINT each; return its exit status.

    A terminal's Ctrl-C goes to every process of its foreground group: Dagster's log tails and a
    trainer's torchrun would each print their own traceback or warning. Relayed to the run's process
    alone, it is Dagster's interruption: it interrupts its step processes, which stop their
    workers, and the console says `interrupted; re-run the same range to resume`, and nothing else.
    The child interrupts itself the same way when this process dies (its end of a pipe closes)."""
    import subprocess

    read_end, write_end = os.pipe()
    flags = [*(["--debug"] if args.debug else []), *(["--artifacts", args.artifacts] if args.artifacts else [])]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    child = subprocess.Popen(
        [sys.executable, "-m", "assets.cli", *flags, *argv, "--run-here"],
        env={**os.environ, PARENT_FD: str(read_end), "PYTHONPATH": path},  # the same folder and settings as this one
        pass_fds=(read_end,),
        start_new_session=True,
    )
    os.close(read_end)

    def relay(signum, frame) -> None:
        child.send_signal(signal.SIGINT)

    relayed = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {s: signal.signal(s, relay) for s in relayed}
    try:
        code = child.wait()
        return code if code >= 0 else 128 - code  # ended by a signal: as a shell reports it
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        os.close(write_end)


def _interrupt_when_parent_goes() -> None:
    """In the child of `_in_own_group`: a SIGINT to this process (Dagster's interruption) when the
    `dagster-rl train` that started it is gone, whatever ended it."""
    import threading

    fd = os.environ.pop(PARENT_FD, "")
    if not fd.isdigit():
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        except OSError:
            pass
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=watch, name="dagster-rl-parent", daemon=True).start()


def _was_interrupted(instance, run_id: str) -> bool:
    """Whether the run ended because it was interrupted (Ctrl-C, SIGTERM): canceled by it here, or
    failed with the interruption, as its log records."""
    from dagster import DagsterEventType

    from assets.console import interrupted

    from assets.workspace_run import interrupted_here

    if interrupted_here(run_id):  # Ctrl-C here canceled it
        return True
    records = instance.get_records_for_run(run_id, of_type=DagsterEventType.RUN_FAILURE, limit=1).records
    error = getattr(records[0].event_log_entry.dagster_event.event_specific_data, "error", None) if records else None
    return interrupted(error)


def _execute(instance, exp: Experiment, first: int, last: int, log_level: str):
    """One run of `<exp>_train` over first...last, a run of the workspace's code location (the UI's
    job page, timeline and Re-execute see it), executed in this process as `execute_job` executes
    one: each step in a child process of the code location's executor (`assets.workspace_run`)."""
    import warnings

    from assets.workspace_run import execute_here

    with warnings.catch_warnings():  # Dagster's notices about its own API, not about this run
        warnings.simplefilter("ignore", FutureWarning)
        config = {"loggers": {"console": {"config": {"log_level": log_level}}}}
        # a DagsterRLError (the workspace names no code location of this repository, the location refuses
        # to load): nothing ran; `main` prints it as one message, its traceback too with --debug
        return execute_here(instance, f"{exp.name}_train", config, range_tags(first, last))


def cmd_runs(args: argparse.Namespace) -> None:
    """The experiment's latest runs, newest first: id, status, steps, start, and a failed run's error."""
    from dagster import RunsFilter

    from assets.run_tags import EXPERIMENT_TAG

    exp = _experiment(args.experiment)
    with _instance() as instance:
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


def parse_step(exp: Experiment, text: str) -> str:
    """A step number (`7` or `0007`) of the experiment, as its partition key; exits with a message otherwise."""
    if not text.isdigit() or not 0 <= int(text) < exp.n_steps:
        sys.exit(f"dagster-rl: {text!r} is not a step of {exp.name}; give a number from 0 to {exp.n_steps - 1} (e.g. 7 or 0007)")
    return step_key(int(text))


def cmd_lineage(args: argparse.Namespace) -> None:
    """The chain of a step's weights back to step 0, read from the store; each step's artifacts are
    checked against the experiment's materializations of that step as `verify` checks them, and a
    mismatch is flagged under the step (exit 1)."""
    from dagster_rl.core.lineage import trace
    from dagster_rl.store.artifact_store import check_key

    exp = _experiment(args.experiment)
    step = parse_step(exp, args.step)
    store = _store(args)
    with _instance() as instance:
        md = latest(instance, exp, "weights", step)
        if md is None:
            sys.exit(f"dagster-rl: {exp.name}/weights has no materialization for step {step}; run it first")
        if (foreign := _not_ours(md, f"{exp.name}/weights {step}", step)) is not None:
            sys.exit(f"dagster-rl: {foreign}.")
        try:
            chain = trace(store, check_key(md.get("artifact_key"), f"artifact key of {exp.name}/weights {step}"))
        except DagsterRLError as e:
            sys.exit(f"dagster-rl: {e}")
        flags = {s.step: _lineage_flags(instance, exp, store, s) for s in chain}
        moved = bool(chain) and step_key(chain[0].step) != step  # e.g. step 1's artifact under step 3's name
        named = artifact_problem(store, md, "weights", step, exp)[0] if moved else None  # else `flags` checked it
    top = [f"weights {step}: {named}"] if named is not None and not any(flags.values()) else []
    bad = sorted(k for k, f in flags.items() if f)
    try:  # a reader that closes the pipe early (`| head`) still leaves the summary and the exit status
        if args.json:
            print(json.dumps([dict(s.model_dump(), seeds_hash=s.seeds_hash, problems=flags[s.step] + (top if i == 0 else [])) for i, s in enumerate(chain)], indent=2))
        else:
            print(f"lineage of {exp.name}/weights {step} (artifacts in {store.url}, experiment seed {exp.seed})")
            for problem in top:
                print(f"  MISMATCH {problem}")
            for s in chain:
                b = s.behavior_policy
                print(f"step {step_key(s.step)}  weights v{s.weights_version} {s.weights_hash[:16]} (key {s.weights_key[:16]})")
                print(f"  <- rewards  {s.rewards_hash[:16]}  rubric {s.rubric.get('name')} {_rubric_weights(s.rubric)}")
                print(f"  <- rollouts {s.rollouts_hash[:16]}  {s.n_trajectories} trajectories, {len(s.skipped)} skipped, "
                      f"seeds {s.seeds_hash[:16]} ({_seed_span(s.seeds)})")
                print(f"  <- behavior policy: weights {b['partition']} v{b['version']} {str(b['content_hash'])[:16]}")
                for problem in flags[s.step]:
                    print(f"  MISMATCH {problem}")
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_closed_stdout()
    if bad or top:
        print(
            f"{sum(len(flags[k]) for k in bad) + len(top)} mismatch(es) with what Dagster recorded: `dagster-rl verify {exp.name}` lists "
            f"every bad artifact; re-run from step {step_key(bad[0]) if bad else step}.",
            file=sys.stderr,
        )
        sys.exit(1)


def _lineage_flags(instance, exp: Experiment, store, s) -> list[str]:
    """What is wrong with one step of a lineage: each of its artifacts against the latest
    materialization of this experiment's step (as `verify` checks it), and that materialization
    names the artifact the chain went through."""
    partition, flags = step_key(s.step), []
    hashes = {"rollouts": (s.rollouts_key, s.rollouts_hash), "rewards": (s.rewards_key, s.rewards_hash), "weights": (s.weights_key, s.weights_hash)}
    for asset in CHAIN:
        md = latest(instance, exp, asset, partition)
        if md is None:
            continue  # another experiment's step (a fork's parent), or not materialized here
        problem, _ = artifact_problem(store, md, asset, partition, exp)
        if problem is not None:
            flags.append(f"{asset} {partition}: {problem}")
            continue
        key, recorded = hashes[asset]
        if md.get("artifact_key") != key:
            flags.append(
                f"{asset} {partition}: the chain goes through {asset}/{key[:16]}, but the latest materialization of "
                f"{exp.name}/{asset} {partition} names {asset}/{str(md.get('artifact_key'))[:16]} (a later run superseded it)"
            )
        elif md.get("content_hash") != recorded:
            flags.append(
                f"{asset} {partition}: the step after it recorded content hash {recorded[:16]}, the materialization "
                f"{str(md.get('content_hash'))[:16]}"
            )
    return flags


def cmd_verify(args: argparse.Namespace) -> None:
    """Re-hash every artifact the experiment's latest materializations name and compare its content
    hash with the one the materialization recorded; report each bad one (`--repair`: move it aside)."""
    exp = _experiment(args.experiment)
    store = _store(args, repair=args.repair)
    checked, bad = 0, []  # bad: (step, what is wrong, what --repair did)
    with _instance() as instance:
        for step, asset, md in _materializations(instance, exp):
            checked += 1
            problem, fix = artifact_problem(store, md, asset, step, exp)
            if problem is not None:
                repaired = fix() if args.repair and fix is not None else None
                bad.append((step, f"{asset} {step}".rstrip(), problem, repaired))
    print(f"verified {checked} artifacts of {exp.name} in {store.url}: {len(bad)} bad")
    for _, where, problem, repaired in bad:
        print(f"  BAD {where}: {problem}")
        if repaired:
            print(f"    repaired: {repaired}")
    if not bad:
        return
    first = min(step or "0000" for step, *_ in bad)  # the warm-up ('') comes before step 0000
    if args.repair:
        print(f"Re-run from step {first}: what was moved aside is computed again (the same bytes: everything is seeded).")
    else:
        print(
            f"`dagster-rl verify {exp.name} --repair` moves the bad artifacts aside (so does the next run that reads one, "
            f"and computes it again); then re-run from step {first}."
        )
    sys.exit(1)


def _materializations(instance, exp: Experiment):
    """(step, asset, metadata) of the latest materialization of every step asset of every step, and
    of the warm-up (`<exp>/sft`, step ''), when there is one."""
    spec = task_of(exp.kind).warmup_of(exp)
    if spec is not None:
        md = latest(instance, exp, spec.name, None)
        if md is not None:
            yield "", spec.name, {"artifact_path": f"weights/{md.get('artifact_key')}", **md}  # a warm-up is weights
    for step in exp.step_keys:
        for asset in step_assets(exp):
            md = latest(instance, exp, asset, step)
            if md is not None:
                yield step, asset, md


def artifact_problem(store, md: dict, asset: str, step: str, exp: Experiment) -> tuple[str | None, Any]:
    """What is wrong with the artifact the materialization of `<exp>/<asset> <step>` names (step ''
    for the warm-up): a materialization dagster-rl did not write, the artifact's files, a link, a
    content hash other than the one the materialization recorded, or an artifact that another step
    made (a copied materialization); and how `--repair` fixes it (or None)."""
    from assets.predecessor import artifact_of

    what = f"{exp.name}/{asset} {step}".rstrip()
    if (foreign := _not_ours(md, what, step)) is not None:
        return foreign, None
    try:
        kind, key = artifact_of(md, asset)
    except DagsterRLError as e:
        return str(e), None
    error = store.problem(kind, key)
    if isinstance(error, StoreLinkError):
        return str(error), lambda: store.move_link_aside(error)
    if isinstance(error, CorruptArtifactError):
        return str(error), lambda: store.move_aside(kind, key)
    if error is not None:
        return str(error), None
    recorded, stored = md.get("content_hash"), store.ref(kind, key).content_hash
    if recorded != stored:
        return (
            f"artifact {kind}/{key}: the materialization recorded content hash {recorded}, the store holds {stored} "
            "(its files and manifest were changed together after the step, or the materialization was not the "
            "step's own)"
        ), lambda: store.move_aside(kind, key, reason="mismatch")
    made_by = _made_by(store, kind, key, asset, step, exp)
    if made_by is not None:
        return (
            f"the materialization of {what} names artifact {kind}/{key}, which {made_by}: not the step's own (the "
            f"materialization was copied from another partition or experiment, or reported by hand). Re-run from step "
            f"{step or '0000'}, which materializes the step's own"
        ), None
    return None, None


def _made_by(store, kind: str, key: str, asset: str, step: str, exp: Experiment) -> str | None:
    """What the artifact's own record says made it, when that is not step `step` of the experiment's
    cache family (None: it is, or it records nothing to compare: the warm-up, a task's extra asset)."""
    from dagster_rl.core.records import STATS
    from dagster_rl.store.artifact_store import DATA

    if not step or asset not in CHAIN:
        return None
    try:
        if asset == "weights":
            record = json.loads(store.get(kind, key, STATS)) if STATS in store.names(kind, key) else {}
            made, family = record.get("step"), record.get("experiment", exp.family)
            if not record:
                return "holds no record of a training step (initial or warm-up weights)"
        else:
            made, family = json.loads(store.get(kind, key, DATA)).get("step"), exp.family
    except (DagsterRLError, ValueError, AttributeError):
        return None  # unreadable: reported by the checks above
    if made == int(step) and family == exp.family:
        return None
    return f"step {step_key(made) if isinstance(made, int) else made} of experiment {family} made"


def _rubric_weights(rubric: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in rubric.items() if k != "name")


def _seed_span(seeds: dict[str, int]) -> str:
    ids = sorted(seeds)
    return f"{ids[0]}={seeds[ids[0]]} .. {ids[-1]}={seeds[ids[-1]]}" if ids else "none"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="dagster-rl", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifacts", default="", help="the artifact store's fsspec URL (default: $DAGSTER_HOME/artifacts)")
    parser.add_argument("--debug", action="store_true", help="on an error, print its traceback too (default: its message)")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="run a range of an experiment's steps as one run on $DAGSTER_HOME's instance, a line per step (checks first)",
    )
    train.add_argument("experiment")
    train.add_argument("range", nargs="?", help="FIRST...LAST (e.g. 0008...0011) or one step (e.g. 8); default: every step")
    train.add_argument("--log-level", default="INFO", help="the console's level: INFO (a line per step) or DEBUG (every event)")
    train.add_argument("--run-here", action="store_true", help=argparse.SUPPRESS)  # the child of `_in_own_group`
    train.set_defaults(fn=cmd_train)
    status = sub.add_parser("status", help="table of every step of an experiment, read from $DAGSTER_HOME")
    status.add_argument("experiment")
    status.add_argument("--all", action="store_true", help="a row for every step (default: one row for each span of steps not materialized)")
    status.set_defaults(fn=cmd_status)
    runs = sub.add_parser("runs", help="an experiment's latest runs: id, status, steps, start, and a failed run's error")
    runs.add_argument("experiment")
    runs.add_argument("--limit", type=int, default=10, help="how many runs, newest first (default 10)")
    runs.set_defaults(fn=cmd_runs)
    lineage = sub.add_parser("lineage", help="trace a step's weights back to step 0 through every behavior policy")
    lineage.add_argument("experiment")
    lineage.add_argument("step", help="step number, e.g. 7 or 0007")
    lineage.add_argument("--json", action="store_true", help="everything, every trial seed included, as JSON")
    lineage.set_defaults(fn=cmd_lineage)
    verify = sub.add_parser(
        "verify",
        help="re-hash every artifact of an experiment's steps, compare it with its materialization; report each bad one (exit 1)",
    )
    verify.add_argument("experiment")
    verify.add_argument("--repair", action="store_true", help="move each bad artifact to the store's quarantine (nothing is deleted)")
    verify.set_defaults(fn=cmd_verify)
    for kind in BUILTIN_TASKS:  # the tasks' own subcommands (the language models' `serve`)
        for name, command in task_of(kind).commands.items():
            cmd = sub.add_parser(name, help=command.help)
            if name in argv:  # its arguments only when it is asked for: defining them may import torch
                command.add_arguments(cmd)
            cmd.set_defaults(fn=command.run)
    args = parser.parse_args(argv)
    if getattr(args, "run_here", False):
        _interrupt_when_parent_goes()
    try:
        args.fn(args)
        sys.stdout.flush()  # here, not at exit: a reader that closed the pipe is one more case below
    except KeyboardInterrupt:
        print(RESUME if args.command == "train" else "interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except BrokenPipeError:  # `dagster-rl lineage demo 7 | head`: the reader has what it wanted
        _quiet_closed_stdout()
        sys.exit(0)
    except Exception as e:  # noqa: BLE001 - every error is one message; the traceback behind --debug
        if args.debug:
            sys.excepthook = sys.__excepthook__  # the whole traceback, whatever a code location that failed to load set
            raise
        sys.exit(one_message(e))


def one_message(error: BaseException) -> str:
    """What `dagster-rl` prints of an error: its message, which says what was wrong and what to do;
    for an error dagster-rl did not raise on purpose, its type too, and where its traceback is."""
    if isinstance(error, DagsterRLError):
        return f"dagster-rl: {error}"
    return f"dagster-rl: {type(error).__name__}: {error} (`dagster-rl --debug ...` shows the traceback)"


def _quiet_closed_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    main()
