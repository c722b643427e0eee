"""Experiment files: bad input fails at definition load, naming the file, the field and the reason."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dagster_rl.base.errors import ExperimentError
from dagster_rl.core.experiment_files import load_experiments, read_experiments
from tests import REPO
from tests.settings import demo_settings, shipped_settings, write_experiments


def load(tmp_path, *raws):
    return load_experiments(write_experiments(tmp_path / "exp", *raws))


@pytest.mark.parametrize(
    ("override", "field", "reason"),
    [
        ({"name": "my-exp"}, "name", "should match pattern"),
        ({"n_samples": 1}, "n_samples", "GRPO normalizes rewards within a group"),
        ({"prompts_per_step": 0}, "prompts_per_step", "greater than or equal to 1"),
        ({"rubric": {"tidiness": -1}}, "rubric.tidiness", "greater than or equal to 0"),
        ({"task": {"kind": "chess"}}, "task.kind", "'chess' is not a task kind"),
        ({"temprature": 0.7}, "temprature", "Extra inputs are not permitted"),
        # finding 6 of issue 10: numbers and sizes are checked at load, not at run time
        ({"grpo": {"learning_rate": float("inf")}}, "grpo.learning_rate", "Input should be a finite number"),
        ({"rubric": {"tidiness": float("nan")}}, "rubric.tidiness", "Input should be a finite number"),
        # numbers are numbers (base/strict.py), with the fix in the message: what pydantic's strict mode does not say
        ({"seed": True}, "seed", "a number is required, not the boolean True"),
        (
            {"grpo": {"learning_rate": "0.01"}},
            "grpo.learning_rate",
            "a number is required, not the text '0.01': write it without quotes",
        ),
        ({"prompts_per_step": 1_000_000_000}, "prompts_per_step", "less than or equal to 32768"),
        ({"prompts_per_step": 20_000, "n_samples": 4}, "<root>", "= 80000 trials per step, more than the 65536 a step may plan"),
        ({"min_trials_per_step": 25}, "<root>", "min_trials_per_step=25 is more than the 24 trials a step plans"),
        ({"prompts_per_step": 200, "task": {"n_worlds": 1000, "n_docs": 1000}}, "<root>", "200000 documents, more than 100000"),
    ],
)
def test_invalid_settings_name_file_field_and_reason(tmp_path, override, field, reason):
    raw = demo_settings(**override)
    with pytest.raises(ExperimentError) as err:
        load(tmp_path, raw)
    message = str(err.value)
    assert f"{raw['name']}.yaml" in message
    assert f"field '{field}" in message
    assert reason in message


def test_not_yaml_is_refused_with_the_file_name(tmp_path):
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "broken.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ExperimentError, match=r"broken\.yaml: not valid YAML"):
        load_experiments(folder)


def test_one_bad_file_leaves_the_others_usable_and_its_error_visible(tmp_path):
    folder = write_experiments(tmp_path / "exp", demo_settings(), demo_settings(name="broken", n_samples=1))
    (folder / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1"))
    env = {"DAGSTER_RL_EXPERIMENTS": str(folder), "PATH": "/usr/bin:/bin", "DAGSTER_HOME": str(tmp_path)}

    def python(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)

    # the dagster_rl code location serves the valid experiment, and warns about the others
    loaded = python("import assets.definitions as d; print(d.defs.resolve_job_def('demo_train').name)")
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "demo_train"
    assert "broken.yaml: invalid experiment: field 'n_samples'" in loaded.stderr
    assert "latin1.yaml: not UTF-8 text" in loaded.stderr
    # the invalid_experiment_files code location fails with both errors: the UI shows it as a location problem
    failed = python("import assets.experiment_errors")
    assert failed.returncode != 0
    assert "2 invalid experiment files" in failed.stderr and "GRPO normalizes rewards within a group" in failed.stderr
    assert "latin1.yaml: not UTF-8 text (byte 9: invalid continuation byte)" in failed.stderr


def test_the_invalid_experiment_files_location_loads_empty_when_every_file_is_valid():
    proc = subprocess.run([sys.executable, "-c", "import assets.experiment_errors"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_a_fork_inherits_its_parent_and_overrides_what_it_names(tmp_path):
    fork = {"name": "demo_strict", "fork_of": "demo", "rubric": {"name": "strict", "tidiness": 1.0}}
    exps = load(tmp_path, demo_settings(), fork)
    parent, child = exps["demo"], exps["demo_strict"]
    assert child.rubric.tidiness == 1.0 and child.rubric.efficiency == parent.rubric.efficiency
    assert child.task == parent.task and child.seed == parent.seed
    assert child.training_hash() != parent.training_hash()


def test_the_cache_family_of_a_chain_of_forks_is_its_root(tmp_path):
    forks = [{"name": "demo_a", "fork_of": "demo"}, {"name": "demo_b", "fork_of": "demo_a"}]
    exps = load(tmp_path, demo_settings(), *forks, demo_settings(name="copy"))
    assert {n: e.family for n, e in exps.items()} == {"demo": "demo", "demo_a": "demo", "demo_b": "demo", "copy": "copy"}


def test_a_fork_of_an_unknown_parent_is_refused(tmp_path):
    with pytest.raises(ExperimentError, match="field 'fork_of': no experiment named 'nope'"):
        load(tmp_path, demo_settings(name="orphan", fork_of="nope"))


def test_two_files_with_one_name_are_both_refused_naming_both_and_the_others_stay_usable(tmp_path):
    """Issue 24: a copy of demo.yaml that kept `name: demo` (a_demo.yaml, another learning rate) was
    read first and won; demo.yaml was the one reported, and `train demo` trained the copy."""
    folder = write_experiments(tmp_path / "exp", demo_settings(), demo_settings(name="other"))
    (folder / "a_demo.yaml").write_text(yaml.safe_dump(demo_settings(grpo={"learning_rate": 5.0})))
    files = read_experiments(folder)
    assert sorted(files.experiments) == ["other"]
    both = f"experiment name 'demo' is declared by 2 files, {folder / 'a_demo.yaml'} and {folder / 'demo.yaml'}"
    assert files.errors == {
        str(
            folder / f
        ): f"{folder / f}: {both}; a name is declared by one file only: give the other a name of its own (its `name:` field), or remove it"
        for f in ("a_demo.yaml", "demo.yaml")
    }


def _read_in_a_thread(folder, timeout_s: float = 30.0):
    """read_experiments(folder), failing the test instead of hanging when a read blocks."""
    import threading

    out = {}
    reader = threading.Thread(target=lambda: out.update(files=read_experiments(folder)), daemon=True)
    reader.start()
    reader.join(timeout_s)
    assert "files" in out, f"reading {folder} did not return within {timeout_s} s"
    return out["files"]


def test_only_regular_files_under_a_size_bound_are_read_and_the_others_stay_usable(tmp_path):
    """Issue 24: `experiments/fifo.yaml` (a FIFO) hung every command and the code location;
    `zero.yaml -> /dev/zero` ended every one in MemoryError."""
    import os

    folder = write_experiments(tmp_path / "exp", demo_settings())
    os.mkfifo(folder / "fifo.yaml")
    (folder / "zero.yaml").symlink_to("/dev/zero")
    (folder / "big.yaml").write_text("name: big\n" + "# " + "x" * (1 << 20) + "\n")
    (folder / "sub.yaml").mkdir()
    files = _read_in_a_thread(folder)
    assert sorted(files.experiments) == ["demo"]
    assert (
        files.errors[str(folder / "fifo.yaml")]
        == f"{folder / 'fifo.yaml'}: not a regular file (it is a FIFO); an experiment file is a plain YAML file"
    )
    assert files.errors[str(folder / "zero.yaml")].endswith(
        "zero.yaml: not a regular file (it is a character device); an experiment file is a plain YAML file"
    )
    assert (
        files.errors[str(folder / "big.yaml")]
        == f"{folder / 'big.yaml'}: {(folder / 'big.yaml').stat().st_size} bytes, more than the 1048576 an experiment file may hold"
    )
    assert "not a regular file (it is a folder)" in files.errors[str(folder / "sub.yaml")]


@pytest.mark.parametrize(
    "text, said",
    [
        (
            "name: demo\nn_steps: 4\nseed: 0\nn_steps: 8\n",
            "the key 'n_steps' is given twice in one mapping (lines 2 and 4); keep one",
        ),
        (
            "name: demo\ngrpo:\n  learning_rate: 1.0\n  learning_rate: 2.0\n",
            "the key 'learning_rate' is given twice in one mapping (lines 3 and 4); keep one",
        ),
    ],
)
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path, text, said):
    """Issue 24: the last value of a key given twice silently won."""
    folder = tmp_path / "exp"
    folder.mkdir()
    (folder / "twice.yaml").write_text(text)
    assert read_experiments(folder).errors == {str(folder / "twice.yaml"): f"{folder / 'twice.yaml'}: {said}"}


def test_a_merge_key_may_be_overridden(tmp_path):
    folder = write_experiments(tmp_path / "exp")
    raw = yaml.safe_dump(demo_settings()).replace(
        "grpo:\n  learning_rate: 2.0", "grpo:\n  <<: {learning_rate: 1.0}\n  learning_rate: 2.0"
    )
    assert "<<:" in raw
    (folder / "demo.yaml").write_text(raw)
    assert read_experiments(folder).experiments["demo"].grpo.learning_rate == 2.0


def test_a_missing_experiments_folder_is_named_by_every_reader(tmp_path):
    """Issue 24: DAGSTER_RL_EXPERIMENTS naming a missing folder said "known: none", and the code
    location loaded empty (`dagster asset materialize` then: "Could not find job '__ASSET_JOB'")."""
    missing = tmp_path / "nowhere"
    env = {"DAGSTER_RL_EXPERIMENTS": str(missing), "PATH": "/usr/bin:/bin", "DAGSTER_HOME": str(tmp_path)}
    named = f"{missing}: the experiments folder does not exist; experiments are read from a folder of YAML files (DAGSTER_RL_EXPERIMENTS={missing} names it"
    for argv in (
        [str(Path(sys.executable).parent / "dagster-rl"), "status", "demo"],
        [sys.executable, "-c", "import assets.definitions"],
    ):
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and named in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith(f"dagster_rl code location: {named}"), done.stderr


def test_shipped_experiments_load():
    assert "demo" in load_experiments(REPO / "experiments")


def test_a_step_makes_only_the_worlds_it_uses(tmp_path):
    """finding 6: 1000 worlds of 1000 documents load, and a step makes the 6 its 6 prompts play."""
    from dagster_rl.store.artifact_store import ArtifactStore
    from dagster_rl.tasks.secret_search.loop import ensure_worlds, initial_weights

    exp = load(tmp_path, demo_settings(task={"n_worlds": 1000, "n_docs": 1000}))["demo"]
    store = ArtifactStore(f"file://{tmp_path}/store")
    assert sorted(ensure_worlds(exp, store)) == ["w0", "w1", "w2", "w3", "w4", "w5"]
    assert len(list((tmp_path / "store" / "worlds").iterdir())) == 6
    assert sorted(initial_weights(exp, store).payload.doc_prior) == ["w0", "w1", "w2", "w3", "w4", "w5"]


# ---- issue 20, finding 5: an upper bound on every setting, products included ------------------

TINY = "tiny_grpo"


@pytest.mark.parametrize(
    ("experiment", "override", "field", "reason"),
    [
        ("demo", {"grpo": {"learning_rate": 1e308}}, "grpo.learning_rate", "less than or equal to 1000 (got 1e+308)"),
        ("demo", {"rubric": {"correctness": 1e308}}, "rubric.correctness", "less than or equal to 1000000 (got 1e+308)"),
        ("demo", {"task": {"max_turns": 10**9}}, "task.max_turns", "less than or equal to 1000 (got 1000000000)"),
        ("demo", {"seed": 10**30}, "seed", "less than or equal to 9223372036854775807"),
        (TINY, {"grpo": {"learning_rate": 1e308}}, "grpo.learning_rate", "less than or equal to 1 (got 1e+308)"),
        (TINY, {"rubric": {"accuracy": 1e308}}, "rubric.accuracy", "less than or equal to 1000000 (got 1e+308)"),
        (TINY, {"policy": {"lora": {"alpha": 1e308}}}, "policy.lora", "alpha / rank = 1e+308 / 8"),
        (TINY, {"policy": {"lora": {"rank": 10**9}}}, "policy.lora.rank", "less than or equal to 16384 (got 1000000000)"),
        (TINY, {"generation_threads": 10**9}, "generation_threads", "less than or equal to 1024 (got 1000000000)"),
        (
            TINY,
            {"task": {"eval_max_new_tokens": 10**9}},
            "task.eval_max_new_tokens",
            "less than or equal to 32768 (got 1000000000)",
        ),
        (TINY, {"grpo": {"betas": [0.9, 1e308]}}, "grpo.betas.1", "less than 1"),
        (TINY, {"grpo": {"betas": [0.9, "0.99"]}}, "grpo.betas.1", "a number is required, not the text '0.99'"),
        (TINY, {"grpo": {"kl_beta": 1e308}}, "grpo.kl_beta", "less than or equal to 100"),
        (TINY, {"sampling": {"temperature": 1e308}}, "sampling.temperature", "less than or equal to 100"),
        (
            TINY,
            {"trainer": {"nproc_per_node": 64, "threads_per_process": 64}},
            "trainer",
            "64 x 64 = 4096 threads on one node, more than the 1024",
        ),
        # sizes multiply: trials x tokens, held-out prompts x tokens
        (
            TINY,
            {"prompts_per_step": 1024, "n_samples": 64, "sampling": {"max_new_tokens": 4096}},
            "<root>",
            "1024 x 64 x 4096 x 1 = 268435456 tokens the driver may hold, more than 134217728",
        ),
        (  # at a lag the driver holds the steps generated ahead too
            TINY,
            {"prompts_per_step": 512, "n_samples": 64, "sampling": {"max_new_tokens": 2048}, "max_policy_lag": 3},
            "<root>",
            "512 x 64 x 2048 x 4 = 268435456 tokens the driver may hold",
        ),
        (TINY, {"max_policy_lag": 9}, "max_policy_lag", "less than or equal to 8"),
        (TINY, {"grpo": {"mismatch": {"cap": 1.0}}}, "grpo.mismatch.cap", "greater than 1"),
        (
            TINY,
            {"task": {"source": {"kind": "synthetic", "n_eval": 100_000}, "eval_max_new_tokens": 32768}},
            "<root>",
            "100000 x 32768 = 3276800000 tokens an evaluation may generate",
        ),
    ],
)
def test_a_setting_past_its_bound_fails_at_load_naming_file_field_and_bound(tmp_path, experiment, override, field, reason):
    """Finding 5: these passed validation and crashed far away (bare JSON errors, a 256 GB
    allocation, libgomp out of memory, a pydantic error about TrainMetrics.loss)."""
    with pytest.raises(ExperimentError) as err:
        load(tmp_path, shipped_settings(experiment, **override))
    message = str(err.value)
    assert f"{experiment}.yaml: invalid experiment: field '{field}'" in message, message
    assert reason in message, message


def test_yaml_numbers_are_numbers_and_text_is_never_one(tmp_path):
    """Finding 7: `n_steps: "4"` was coerced silently; and 1e-4, which PyYAML reads as text, is a number."""
    folder = tmp_path / "exp"
    folder.mkdir()
    text = (REPO / "experiments" / f"{TINY}.yaml").read_text().replace("learning_rate: 0.001", "learning_rate: 1e-3")
    (folder / f"{TINY}.yaml").write_text(text.replace("seed: 0", "seed: 5e3"))
    loaded = load_experiments(folder)[TINY]
    assert loaded.grpo.learning_rate == 1e-3 and loaded.seed == 5000
    (folder / "quoted.yaml").write_text(yaml.safe_dump(demo_settings(name="quoted", n_steps="4")))
    with pytest.raises(
        ExperimentError,
        match=r"quoted\.yaml: invalid experiment: field 'n_steps': a number is required, not the text '4': write it without quotes",
    ):
        load_experiments(folder)


def test_a_yml_file_is_read_like_a_yaml_file(tmp_path):
    """Finding 7: `*.yml` files were ignored, silently."""
    folder = write_experiments(tmp_path / "exp", demo_settings())
    (folder / "other.yml").write_text(yaml.safe_dump(demo_settings(name="other", seed=3)))
    (folder / "broken.yml").write_text(yaml.safe_dump(demo_settings(name="broken", n_samples=1)))
    with pytest.raises(ExperimentError, match=r"broken\.yml: invalid experiment: field 'n_samples'"):
        load_experiments(folder)
    (folder / "broken.yml").unlink()
    assert sorted(load_experiments(folder)) == ["demo", "other"] and load_experiments(folder)["other"].seed == 3
