"""The Dagster asset graph: one driver multi-asset per experiment, jobs, Definitions; and the
`dagster-rl` command line.

    definitions         the code location: groups, `<name>_train` jobs, resources, executor
    driver              the per-experiment driver multi-asset and warm-up asset
    chain               the per-step asset names
    metadata            what the driver's materializations record
    weights_checks      the blocking checks of `<exp>/weights`, evaluated per step
    console_lines       the driver's lines for the console
    progress_reporting  the thread that logs the running steps' progress
    console             the code location's console logger
    predecessor         where a range of steps starts from
    concurrency         one run of an experiment at a time; runs left by dead processes failed
    run_tags            the range of steps a run's tags name
    workspace_run       a `dagster-rl train` run, executed in this process
    deployment          where the code location runs, from its environment
    experiments         the experiment files
    experiment_errors   the code location that shows the invalid experiment files
    cli                 `dagster-rl`: the parser, the entry point, the train run's child process
    cli_inputs          what every command reads: experiment, instance, store, materializations
    cli_train           `dagster-rl train`
    cli_status          `dagster-rl status` and `runs`
    cli_verify          `dagster-rl verify` and `lineage`
"""

from pathlib import Path

REPO = (
    Path(__file__).resolve().parent.parent
)  # the repository root: workspace.yaml, experiments/, and `assets` for a child's PYTHONPATH
