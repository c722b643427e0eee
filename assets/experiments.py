"""Where the code location reads its experiment files, and what it says about the invalid ones.

One invalid file leaves every other experiment usable: the `dagster_rl` code location
(`assets.definitions`) serves the valid ones and warns about the others; the `invalid_experiment_files`
code location (`assets.experiment_errors`, in `workspace.yaml`) fails to load with every invalid
file's error, which the Dagster UI shows as a code location problem; `dagster-rl` prints them too.
"""

import os
from pathlib import Path

from dagster_rl.core.experiment_files import ExperimentFiles, read_experiments

DEFAULT_EXPERIMENTS = Path(__file__).resolve().parent.parent / "experiments"


def experiments_dir() -> Path:
    """$DAGSTER_RL_EXPERIMENTS, or the project's `experiments/`."""
    return Path(os.environ.get("DAGSTER_RL_EXPERIMENTS", DEFAULT_EXPERIMENTS))


def read() -> ExperimentFiles:
    directory = experiments_dir()
    files = read_experiments(directory)
    if str(directory) in files.errors and os.environ.get("DAGSTER_RL_EXPERIMENTS"):
        files.errors[str(directory)] += (
            f" (DAGSTER_RL_EXPERIMENTS={os.environ['DAGSTER_RL_EXPERIMENTS']} names it: set it to the folder that holds the "
            "experiment files, or unset it to read the project's experiments/)"
        )
    return files


def missing_folder(files: ExperimentFiles) -> str | None:
    """The error of an experiments folder that is not there (no file of it could be read), or None."""
    return files.errors.get(str(experiments_dir()))


def problems(files: ExperimentFiles) -> str:
    """Every invalid file's error, one per line, and that the valid experiments are unaffected."""
    n = len(files.errors)
    head = f"{n} invalid experiment file{'s' if n > 1 else ''} (skipped; the valid experiments are unaffected):"
    return "\n".join([head, *(f"  {message}" for message in files.errors.values())])
