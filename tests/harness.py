"""Running ranges of steps through the real driver, in-process, against a real Dagster instance."""

from dataclasses import dataclass
from pathlib import Path

from dagster import AssetKey, DagsterInstance, Definitions

from assets.definitions import build_definitions
from dagster_rl.core.experiment import Experiment
from dagster_rl.core.experiment_files import load_experiments
from dagster_rl.core.records import Rollouts
from dagster_rl.tasks.lm.records import LMRollout
from resources import ArtifactStoreResource, RolloutEnvironment
from tests import REPO

CHAIN = ("rollouts", "rewards", "weights")
LM_CHAIN = (*CHAIN, "evaluation")  # a language-model experiment evaluates each step's weights too


@dataclass
class Lab:
    """One Dagster instance, one artifact store, the experiments of one folder."""

    home: Path
    experiments: dict[str, Experiment]
    defs: Definitions
    instance: DagsterInstance

    def run(self, name: str, first: str, last: str, raise_on_error: bool = True):
        job = self.defs.resolve_job_def(f"{name}_train")
        return job.execute_in_process(
            instance=self.instance,
            tags={"dagster/asset_partition_range_start": first, "dagster/asset_partition_range_end": last},
            raise_on_error=raise_on_error,
        )

    def events(self, name: str, asset: str) -> list:
        """Materialization records of one asset, oldest first."""
        return list(self.instance.fetch_materializations(AssetKey([name, asset]), limit=10_000, ascending=True).records)

    def events_by_partition(self, name: str, asset: str) -> dict[str, list]:
        """partition -> materialization records, oldest first."""
        out: dict[str, list] = {}
        for r in self.events(name, asset):
            out.setdefault(r.asset_materialization.partition, []).append(r)
        return out

    def metadata(self, name: str, asset: str) -> dict[str, list[dict]]:
        """partition -> metadata values of each materialization, oldest first."""
        out: dict[str, list[dict]] = {}
        for r in self.events(name, asset):
            m = r.asset_materialization
            out.setdefault(m.partition, []).append({k: v.value for k, v in m.metadata.items()})
        return out

    def latest(self, name: str, asset: str, partition: str) -> dict:
        return self.metadata(name, asset)[partition][-1]

    def check_evaluations(self, name: str, check: str) -> list:
        """Evaluations of one check of `<name>/weights`, newest first."""
        from dagster import AssetCheckKey

        history = self.instance.event_log_storage.get_asset_check_execution_history(
            AssetCheckKey(AssetKey([name, "weights"]), check), limit=1000
        )
        return [h.event.asset_check_evaluation for h in history if h.event and h.event.asset_check_evaluation]

    def check_partition_statuses(self, name: str, check: str) -> dict[str, list[str]]:
        """status -> partitions of one check of `<name>/weights`, as the UI's Partitions tab of the
        check reads them (`get_asset_check_state`, the storage call behind its GraphQL resolver)."""
        from dagster import AssetCheckKey, StaticPartitionsDefinition

        key = AssetCheckKey(AssetKey([name, "weights"]), check)
        partitions = StaticPartitionsDefinition(self.experiments[name].step_keys)
        state = self.instance.event_log_storage.get_asset_check_state([(key, partitions)])[key]
        return {
            status.value: sorted(subset.subset_value.get_partition_keys())
            for status, subset in state.subsets.items()
            if not subset.is_empty
        }

    def store(self):
        return self.defs.resources["artifact_store"].get_store()

    def rollouts(self, name: str, step: str) -> Rollouts[LMRollout]:
        """The language-model rollouts stored for `<name>/rollouts` at `step` (its latest materialization)."""
        return self.store().get_model("rollouts", self.latest(name, "rollouts", step)["artifact_key"], Rollouts[LMRollout])

    def reopen(self, **resources) -> "Lab":
        """The same home, store and experiments with other resources (a healthy environment, say)."""
        resources.setdefault("artifact_store", self.defs.resources["artifact_store"])
        return open_lab(self.home, self.home / "experiments", **resources)

    def close(self) -> None:
        self.instance.dispose()


def new_dagster_home(path: Path) -> Path:
    """A fresh DAGSTER_HOME at `path` with the local instance's dagster.yaml."""
    path.mkdir(parents=True)
    (path / "dagster.yaml").write_text((REPO / "deploy" / "dagster.local.yaml").read_text())
    return path


def open_lab(home: Path, experiments_dir: Path, **resources) -> Lab:
    """A lab over `home`. A resource given as a function is called with the lab's artifact store
    resource (a judge journals into it: `judge=lambda store: JudgeEnvironment(artifact_store=store, ...)`)."""
    experiments = load_experiments(experiments_dir)
    store = resources.pop("artifact_store", None) or ArtifactStoreResource(url=f"file://{home}/artifacts")
    defaults = {"artifact_store": store, "rollout": RolloutEnvironment(sandbox_root=str(home / "sandboxes"))}
    given = {k: r(store) if callable(r) and not hasattr(r, "get_resource_definition") else r for k, r in resources.items()}
    defs = build_definitions(experiments, {**defaults, **given})
    return Lab(home, experiments, defs, DagsterInstance.from_config(str(home)))


def failure_message(result) -> str:
    """The failed step's error (the driver's, or the warm-up's) and every cause, joined: what the run's page shows."""
    failed = [f for node in result.job_def.nodes if (f := result.failure_data_for_node(node.name)) is not None]
    error = failed[0].error if failed else None
    parts = []
    while error is not None:
        parts.append(error.message)
        error = error.cause
    return "\n".join(parts)
