"""An experiment's own plugins load the same way in every process (finding 1 of issue 36): a text
environment registered by a file in the experiments folder, named in the experiment's `plugins`,
trains through `dagster-rl train` and `dagster asset materialize` (processes of their own) and is an
asset group of the code location a real webserver loads; an installed package's `dagster_rl.plugins`
entry points are imported once, at the first name not found; a plugin that fails is named with the
experiment file, its own file and line, and its exception."""

import importlib.metadata
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from assets.run_tags import range_tags
from dagster_rl.base import plugins
from dagster_rl.base.errors import ExperimentError
from dagster_rl.core.experiment_files import load_experiments, read_experiments
from dagster_rl.tasks.agent import environment
from dagster_rl.tasks.agent.environment import environment_of
from tests.cli_runs import BIN, CONSOLE, home_with, weights_steps
from tests.servers import running_servers
from tests.settings import write_experiments

# What a user writes in the experiments folder: one file that registers a text environment.
PARROT = textwrap.dedent(
    '''
    """A world that asks for one word, registered from the experiments folder."""
    import random
    from typing import Literal

    from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, Outcome, register_environment

    WORDS = ("apple", "river", "stone", "cloud")


    class ParrotSettings(EnvironmentSettings):
        name: Literal["parrot"] = "parrot"


    class Parrot:
        def __init__(self, settings, world, seed, sandbox):
            self.wanted, self.said = random.Random(world.seed).choice(WORDS), None

        def reset(self):
            return f"say {self.wanted}"

        def step(self, action):
            self.said = action.strip()
            return Outcome("", done=True, end_reason="said", tool="say", argument=action)

        def verdict(self):
            return {"success": self.said == self.wanted}

        def close(self):
            pass


    register_environment(EnvironmentSpec(name="parrot", settings=ParrotSettings, make=Parrot, code_version="parrot-1"))
    '''
)


def parrot_experiment(name: str, **overrides) -> dict:
    """One step of 2 worlds x 2 trials of one turn in the plugin's environment, on the tiny agent model."""
    return {
        "name": name,
        "plugins": ["parrot.py"],
        "n_steps": 1,
        "prompts_per_step": 2,
        "n_samples": 2,
        "min_trials_per_step": 2,
        "task": {
            "kind": "text_agent",
            "environment": {"name": "parrot"},
            "episode": {"max_turns": 1, "max_turn_tokens": 3},
            "n_eval": 2,
        },
        "policy": {
            "base_model": "builtin:tiny-qwen2-agent",
            "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"], "init_seed": 1},
        },
        **overrides,
    }


def plugin_folder(folder: Path, *raws: dict, plugin: str = PARROT) -> Path:
    write_experiments(folder, *raws)
    (folder / "parrot.py").write_text(plugin)
    return folder


def test_a_plugin_file_registers_its_environment_before_the_experiment_is_validated(tmp_path):
    folder = plugin_folder(tmp_path / "experiments", parrot_experiment("parrot_a"), {"name": "parrot_b", "fork_of": "parrot_a"})
    experiments = load_experiments(folder)
    assert experiments["parrot_a"].plugins == ["parrot.py"] and experiments["parrot_b"].plugins == ["parrot.py"]  # inherited
    assert experiments["parrot_a"].task.environment.name == "parrot"
    assert environment_of("parrot").code_version == "parrot-1"
    assert "plugins" not in experiments["parrot_a"].training_inputs()  # in no cache key (tests/test_cache_keys.py)


@pytest.mark.parametrize(
    "plugin, said",
    [
        (
            "import random\n\nraise RuntimeError('no parrot today')\n",
            r"parrot\.py raised while it was imported \(line 3\): RuntimeError: no parrot today",
        ),
        ("def broken(:\n", r"parrot\.py raised while it was imported: SyntaxError: invalid syntax \(parrot\.py, line 1\)"),
    ],
)
def test_a_plugin_that_raises_is_named_with_the_experiment_file_its_line_and_its_exception(tmp_path, plugin, said):
    folder = plugin_folder(tmp_path / "experiments", parrot_experiment("parrot_bad"), plugin=plugin)
    files = read_experiments(folder)
    assert files.experiments == {}
    [error] = files.errors.values()
    assert error.startswith(f"{folder / 'parrot_bad.yaml'}: invalid experiment: field 'plugins': {folder / 'parrot.py'} ")
    assert re.search(said, error), error


def test_a_plugin_must_be_a_file_of_the_experiments_folder_or_a_module(tmp_path):
    outside = tmp_path / "outside.py"
    outside.write_text(PARROT)
    folder = plugin_folder(tmp_path / "experiments")
    (folder / "linked.py").symlink_to(outside)
    cases = {
        "up": (["../outside.py"], "is neither a file name in the experiments folder"),
        "linked": (["linked.py"], f"{folder / 'linked.py'} is a link to {outside}, outside the experiments folder"),
        "missing": (["nowhere.py"], f"{folder / 'nowhere.py'}: no such file"),
        "module": (["no_such_package.plugin"], "'no_such_package.plugin' cannot be imported: No module named 'no_such_package'"),
    }
    write_experiments(folder, *(parrot_experiment(f"p_{name}", plugins=refs) for name, (refs, _) in cases.items()))
    errors = read_experiments(folder).errors
    for name, (_, said) in cases.items():
        error = errors[str(folder / f"p_{name}.yaml")]
        assert "invalid experiment: field 'plugins': " in error and said in error, error


def test_whether_a_file_is_valid_does_not_depend_on_the_order_of_the_files(tmp_path):
    """`a_uses` names an environment that only `b_names`'s plugin registers: every plugin of the folder
    is imported before any file is validated, so `a_uses` reads the same whichever file comes first."""
    plugin = PARROT.replace('"parrot"', '"parrot_order"').replace("parrot-1", "parrot-order-1")
    uses = parrot_experiment("a_uses", plugins=[], task={"kind": "text_agent", "environment": {"name": "parrot_order"}})
    folder = plugin_folder(tmp_path / "experiments", uses, parrot_experiment("b_names"), plugin=plugin)
    try:
        assert set(load_experiments(folder)) == {"a_uses", "b_names"}
    finally:
        environment._REGISTERED.pop("parrot_order", None)


def test_an_unknown_environment_says_how_to_name_its_plugin(tmp_path):
    folder = write_experiments(
        tmp_path / "experiments",
        parrot_experiment("boom", plugins=[], task={"kind": "text_agent", "environment": {"name": "boom"}}),
    )
    with pytest.raises(
        ExperimentError,
        match=r"'boom' is not a text environment; .*name the file that registers yours .* in the experiment's `plugins`",
    ):
        load_experiments(folder)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package installed on sys.path (a `.dist-info` with entry points), and a fresh process's state
    of the installed plugins (none imported yet)."""

    def install(entry_points: dict[str, str], modules: dict[str, str]) -> Path:
        site = tmp_path / "site"
        info = site / "parrot_plugins-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: parrot-plugins\nVersion: 1.0\n")
        lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
        (info / "entry_points.txt").write_text(f"[{plugins.ENTRY_POINTS}]\n{lines}")
        for name, source in modules.items():
            (site / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(site))
        return site

    monkeypatch.setattr(plugins, "_installed", None)
    listed = []  # each time the entry points are listed
    entry_points = importlib.metadata.entry_points
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: listed.append(kw) or entry_points(**kw))
    install.listed = listed  # type: ignore[attr-defined]
    yield install
    for name in ("parrot", "ep_parrot"):
        environment._REGISTERED.pop(name, None)
    for name in [m for m in sys.modules if m.startswith(("ep_parrot", "ep_broken"))]:
        del sys.modules[name]


def test_installed_entry_points_are_imported_once_at_the_first_name_not_found(installed, tmp_path):
    world = PARROT.replace('"parrot"', '"ep_parrot"').replace("parrot-1", "ep-parrot-1")
    installed(
        {"parrot": "ep_parrot_world", "broken": "ep_broken_world"},
        {"ep_parrot_world": world, "ep_broken_world": "raise ImportError('needs a GPU')\n"},
    )
    assert "ep_parrot_world" not in sys.modules  # nothing imported before a lookup misses
    environment_of("secret_search")  # a built-in: no miss
    assert "ep_parrot_world" not in sys.modules
    assert environment_of("ep_parrot").code_version == "ep-parrot-1"
    with pytest.raises(ValueError) as missing:
        environment_of("still_missing")
    assert installed.listed == [{"group": "dagster_rl.plugins"}]  # loaded once per process, however many lookups miss
    assert (
        "Installed plugins (entry points dagster_rl.plugins) that failed to import: broken = ep_broken_world "
        "(parrot-plugins 1.0): ImportError: needs a GPU"
    ) in str(missing.value)
    from dagster_rl.core.task import task_of

    with pytest.raises(ValueError, match=r"'bandit_x' is not a task kind; .*failed to import: broken = ep_broken_world"):
        task_of("bandit_x")
    folder = write_experiments(
        tmp_path / "experiments",
        parrot_experiment("ep", plugins=[], task={"kind": "text_agent", "environment": {"name": "ep_parrot"}}),
    )
    assert load_experiments(folder)["ep"].task.environment.name == "ep_parrot"  # an experiment names it, no `plugins`


# ---- in every process: `dagster-rl train`, `dagster asset materialize`, the webserver's code location ----------------


def test_dagster_rl_train_trains_an_experiment_whose_environment_a_plugin_file_registers(tmp_path):
    home, env = home_with(tmp_path, parrot_experiment("parrot_cli"))
    (home / "experiments" / "parrot.py").write_text(PARROT)
    done = subprocess.run(
        [str(BIN / "dagster-rl"), "train", "parrot_cli"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 0000  4/4 trials" in done.stderr, done.stderr
    assert [p for p, _ in weights_steps(home, "parrot_cli")] == ["0000"]


def test_dagster_asset_materialize_the_webserver_and_its_runs_load_the_plugin(tmp_path):
    folder = plugin_folder(tmp_path / "experiments", parrot_experiment("parrot_mat"), parrot_experiment("parrot_ui"))
    with running_servers(tmp_path / "home", folder) as servers:
        gql = servers.graphql
        for exp in ("parrot_mat", "parrot_ui"):  # the code server the webserver started imported the plugin file
            for asset in ("rollouts", "rewards", "weights", "evaluation"):
                assert gql.partition_statuses([exp, asset])["unmaterializedPartitions"] == ["0000"], (exp, asset)
        files = gql.code_location("invalid_experiment_files")
        assert files["loadStatus"] == "LOADED" and files["locationOrLoadError"]["__typename"] == "RepositoryLocation", files

        argv = [
            "asset",
            "materialize",
            "-m",
            "assets.definitions",
            "--select",
            "group:parrot_mat",
            "--partition-range",
            "0000...0000",
        ]
        out = servers.cli(*argv, "--config-json", CONSOLE, timeout_s=600)
        assert "step 0000  4/4 trials" in out.stdout + out.stderr, out.stdout + out.stderr
        assert gql.materialized_partitions(["parrot_mat", "weights"]) == ["0000"]

        run_id = gql.launch_run("parrot_ui_train", tags=range_tags(0, 0))  # the Launchpad: the daemon's run worker runs it
        [run] = gql.wait_for_runs(job_name="parrot_ui_train", count=1, timeout_s=300)
        assert (run["runId"], run["status"]) == (run_id, "SUCCESS"), servers.log("daemon")[-4000:]
        assert gql.materialized_partitions(["parrot_ui", "weights"]) == ["0000"]
