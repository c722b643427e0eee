"""The `invalid_experiment_files` code location: it loads (empty: no file is invalid) when every
file in `experiments/` is valid, and otherwise fails with each invalid file's error, so that the
Dagster UI shows the problem where it shows every code location problem, while the `dagster_rl`
location serves the valid ones. Its name says what it holds: Dagster shows no description of a code
location, only its name, status and module."""

from dagster import Definitions

from assets.console import refuse_to_load
from assets.experiments import problems, read
from dagster_rl.base.errors import ExperimentError

_files = read()
if _files.errors:
    refuse_to_load(ExperimentError(problems(_files)))

defs = Definitions()
