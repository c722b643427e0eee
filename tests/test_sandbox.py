"""Trials run in private sandboxes: writes never reach the world or another trial."""

from concurrent.futures import ThreadPoolExecutor

from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.store.artifact_store import ArtifactStore
from dagster_rl.tasks.secret_search.agent import run_agent
from dagster_rl.tasks.secret_search.experiment import Rubric
from dagster_rl.tasks.secret_search.judge import judge, verify
from dagster_rl.tasks.secret_search.loop import ensure_worlds
from dagster_rl.tasks.secret_search.records import TrialSpec
from dagster_rl.tasks.secret_search.world import DIGEST_PREFIX, build_world, secret_digest, secret_doc
from tests.settings import demo_settings


def test_world_holds_the_digest_in_exactly_one_document_and_never_the_secret():
    docs = build_world("w1", 8)
    holders = [name for name, data in docs.items() if DIGEST_PREFIX.encode() in data]
    assert holders == [f"doc_{secret_doc('w1', 8):03d}.txt"]
    assert secret_digest("w1").encode() in docs[holders[0]]
    assert build_world("w1", 8) == docs and build_world("w2", 8) != docs


def test_sandbox_writes_never_reach_the_world_or_another_trial(tmp_path):
    exp = parse_experiment(demo_settings(task={"scratch_rate": 1.0, "max_turns": 8}))
    store = ArtifactStore(f"file://{tmp_path}/store")
    worlds = ensure_worlds(exp, store)
    world_ref, world_files = worlds["w0"]
    specs = [TrialSpec(trial_id=f"s0-p0-n{i}", step=0, prompt=0, sample=i, world_id="w0", seed=i) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        trajs = list(
            pool.map(
                lambda s: run_agent(
                    s, [1 / 8] * 8, world_files, max_turns=8, scratch_rate=1.0, behavior_version=0, sandbox_root=tmp_path / "sb"
                ),
                specs,
            )
        )
    assert all(t.files_left == ["scratch.txt"] for t in trajs)  # each wrote a scratch file and annotated docs
    assert all(t.foreign_notes_seen == 0 for t in trajs)  # ...that no other trial saw
    assert sum(t.turns for t in trajs) > 16
    assert store.get_all("worlds", world_ref.key) == world_files == build_world("w0", 8)
    assert store.ref("worlds", world_ref.key) == world_ref
    assert list((tmp_path / "sb").iterdir()) == []  # sandboxes removed


def test_same_seed_same_trajectory_and_the_judge_scores_by_rubric(tmp_path):
    spec = TrialSpec(trial_id="s0-p0-n0", step=0, prompt=0, sample=0, world_id="w0", seed=42)
    world = build_world("w0", 8)

    def run():
        return run_agent(spec, [1 / 8] * 8, world, max_turns=8, scratch_rate=0.0, behavior_version=0, sandbox_root=tmp_path)

    a, b = run(), run()
    assert a == b and verify(a)
    r = judge(a, Rubric(correctness=1.0, efficiency=0.5, tidiness=0.2), max_turns=8)
    assert r.reward == 1.0 + 1.0 + 0.5 * (8 - a.turns + 1) / 8 + 0.2


def test_a_sandbox_root_that_cannot_hold_sandboxes_is_refused_naming_the_path(tmp_path):
    """Finding 7 of issue 20: a sandbox_root that was a file (or read-only) gave an OSError naming no path."""
    import pytest

    from dagster_rl.base.errors import SandboxError
    from dagster_rl.tasks.secret_search.backends import SandboxRollouts

    a_file = tmp_path / "a_file"
    a_file.write_text("not a folder")
    with pytest.raises(
        SandboxError, match=rf"the sandbox folder {a_file} \(the rollout environment's sandbox_root.*is a file, not a folder"
    ):
        SandboxRollouts(a_file)
    with pytest.raises(
        SandboxError, match=rf"the sandbox folder {a_file}/sub .*cannot hold sandboxes: Not a directory \({a_file}/sub\)"
    ):
        SandboxRollouts(a_file / "sub")
    SandboxRollouts(tmp_path / "new" / "sandboxes")  # a missing folder is made
    assert list((tmp_path / "new" / "sandboxes").iterdir()) == []
