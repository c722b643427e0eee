"""The supervised warm-up `<exp>/sft`: an unpartitioned asset upstream of the step chain, cached by
content, which step 0 starts from; and the KL term's reference (`grpo.kl_reference: base | sft`)."""

import numpy as np
import pytest
from dagster import AssetKey, BackfillPolicy

from dagster_rl.base import counters
from dagster_rl.base.errors import ExperimentError
from tests.harness import LM_CHAIN, failure_message
from tests.lm_fixtures import ON_POLICY_ROUNDING
from tests.settings import demo_settings, shipped_settings

SMALL_WARMUP = {"demos": 16, "steps": 10, "batch_size": 8, "learning_rate": 0.005}


def small(name: str, **overrides) -> dict:
    """tiny_grpo with a short warm-up and small steps: the warm-up's plumbing, not its learning."""
    return shipped_settings(
        "tiny_grpo",
        name=name,
        n_steps=4,
        prompts_per_step=4,
        n_samples=4,
        min_trials_per_step=8,
        warmup=SMALL_WARMUP,
        **overrides,
    )


def test_the_warmup_is_an_unpartitioned_asset_upstream_of_the_chain_in_the_group_and_the_job(lab):
    made = lab("graph", small("warm"), demo_settings())
    graph = made.defs.resolve_asset_graph()
    sft = AssetKey(["warm", "sft"])
    node = graph.get(sft)
    assert node.partitions_def is None and node.group_name == "warm"
    assert node.backfill_policy == BackfillPolicy.single_run()
    assert graph.get(AssetKey(["warm", "rollouts"])).parent_keys == {sft}  # the lineage edge sft -> rollouts
    assert graph.get(sft).child_keys == {AssetKey(["warm", "rollouts"])}
    assert sft in made.defs.resolve_job_def("warm_train").asset_layer.executable_asset_keys
    # an experiment without a warm-up has no such asset
    assert AssetKey(["demo", "sft"]) not in graph.get_all_asset_keys()
    assert graph.get(AssetKey(["demo", "rollouts"])).parent_keys == set()


def test_a_range_materializes_the_warmup_first_and_step_0_starts_from_it(lab):
    made = lab("order", small("warm"))
    before = counters.read("warmups")
    result = made.run("warm", "0000", "0001")
    assert result.success, failure_message(result)
    assert counters.read("warmups") == before + 1
    [sft] = made.events("warm", "sft")
    rollouts = made.events("warm", "rollouts")
    assert sft.asset_materialization.partition is None
    assert sft.run_id == rollouts[0].run_id and sft.storage_id < rollouts[0].storage_id
    meta = made.latest("warm", "sft", None)
    assert meta["cache"] == "miss" and meta["demos"] == 16 and meta["sft_steps"] == 10
    assert meta["final_loss"] < meta["first_loss"]
    behavior = made.latest("warm", "rollouts", "0000")["behavior_policy"]
    assert behavior["partition"] == "sft" and behavior["content_hash"] == meta["content_hash"] and behavior["version"] == 0
    assert made.latest("warm", "rollouts", "0001")["behavior_policy"]["partition"] == "0000"
    evaluation = made.latest("warm", "evaluation", "0000")
    assert evaluation["start_accuracy"] == meta["accuracy"] and evaluation["base_accuracy"] == meta["base_accuracy"]

    # a second run recomputes nothing: the warm-up is a cache hit like every artifact
    assert made.run("warm", "0000", "0001").success
    assert counters.read("warmups") == before + 1
    assert made.latest("warm", "sft", None)["cache"] == "hit"
    assert made.latest("warm", "weights", "0001")["cache"] == "hit"


def test_a_chain_only_run_from_step_0_computes_and_records_the_warmup(lab):
    made = lab("chain_only", small("warm"))
    job = made.defs.resolve_job_def("warm_train")
    chain_only = job.get_subset(asset_selection={AssetKey(["warm", a]) for a in LM_CHAIN})
    result = chain_only.execute_in_process(
        instance=made.instance,
        tags={"dagster/asset_partition_range_start": "0000", "dagster/asset_partition_range_end": "0000"},
        resources=made.defs.resources,
    )
    assert result.success
    [sft] = made.events("warm", "sft")
    assert made.latest("warm", "sft", None)["recorded_by"] == "driver"
    assert (
        made.latest("warm", "rollouts", "0000")["behavior_policy"]["content_hash"]
        == made.latest("warm", "sft", None)["content_hash"]
    )


@pytest.mark.numerics
def test_the_kl_reference_is_the_base_or_the_warmup(lab):
    base = lab("kl_base", small("warm", grpo={"kl_beta": 0.05, "kl_reference": "base"}))
    sft = lab("kl_sft", small("warm", grpo={"kl_beta": 0.05, "kl_reference": "sft"}))
    assert base.run("warm", "0000", "0001").success and sft.run("warm", "0000", "0001").success
    b0, s0 = base.latest("warm", "weights", "0000"), sft.latest("warm", "weights", "0000")
    # step 0 samples with the warm-up's adapter: it IS the sft reference (KL 0), and differs from the base
    assert s0["kl"] == 0.0 and b0["kl"] > 0.0
    # on-policy in both: a ratio of 1 up to the sampler's rounding against the trainer's (a mean of token
    # ratios lies within their largest deviation, plus the mean's own rounding, eps32); not bit for bit
    eps32 = float(np.finfo(np.float32).eps)
    for md in (s0, b0):
        assert md["ratio_max_dev"] < ON_POLICY_ROUNDING and abs(md["ratio"] - 1.0) <= md["ratio_max_dev"] + eps32, md
    assert sft.latest("warm", "weights", "0001")["kl"] > 0.0
    assert b0["loss"] != s0["loss"] and b0["artifact_key"] != s0["artifact_key"]
    # the same warm-up and the same rollouts of step 0: only the reference differs
    assert base.latest("warm", "sft", None)["content_hash"] == sft.latest("warm", "sft", None)["content_hash"]
    assert base.latest("warm", "rollouts", "0000")["content_hash"] == sft.latest("warm", "rollouts", "0000")["content_hash"]


def test_kl_reference_sft_needs_a_warmup(tmp_path):
    from dagster_rl.core.experiment_files import load_experiments
    from tests.settings import write_experiments

    raw = shipped_settings("tiny_grpo", grpo={"kl_reference": "sft"})
    raw.pop("warmup")
    with pytest.raises(ExperimentError, match="kl_reference: sft needs a supervised warm-up"):
        load_experiments(write_experiments(tmp_path / "exp", raw))


def test_a_warmup_asking_for_more_demonstrations_than_training_prompts_fails_clearly(lab):
    made = lab("too_many", small("warm", task={"source": {"kind": "synthetic", "ops": ["copy"], "n_eval": 2}}))
    result = made.run("warm", "0000", "0000", raise_on_error=False)
    assert not result.success
    assert "asks for 16 demonstrations but the training split has 8" in failure_message(result)
    assert made.events("warm", "sft") == [] and made.events("warm", "rollouts") == []
    assert made.instance.get_run_by_id(result.run_id).tags["dagster/retry_on_asset_or_op_failure"] == "false"  # not retried


def test_a_warmup_with_a_target_accuracy_stops_at_the_first_check_that_reaches_it(tiny_dir):
    """Checked every `check_every` steps on training prompts that are not demonstrations (never a
    held-out one); it stops at the first check that reaches the target, or runs all its steps."""
    from dagster_rl.tasks.lm.data.prompts import SyntheticPrompts, load_prompt_set
    from dagster_rl.tasks.lm.settings import WarmupSettings
    from dagster_rl.tasks.lm.train.warmup import warm_up
    from tests.lm_fixtures import fresh_policy

    prompts = load_prompt_set(SyntheticPrompts(ops=("last",), n_eval=100))
    held_out = {it.id for it in prompts.eval}
    seen = []

    def check(policy, items):  # a scripted accuracy: 0.1, 0.2, 0.3, ... one check after another
        seen.append([it.id for it in items])
        return 0.1 * len(seen)

    settings = WarmupSettings(demos=8, steps=40, batch_size=4, target_accuracy=0.3, check_every=5, check_prompts=20)
    _, stats = warm_up(fresh_policy(tiny_dir), prompts.train, prompts.template, settings, seed=0, check=check)
    assert stats.checks == [(5, pytest.approx(0.1)), (10, pytest.approx(0.2)), (15, pytest.approx(0.3))]
    assert len(stats.losses) == 15  # stopped at the third check
    assert all(len(ids) == 20 and ids == seen[0] for ids in seen)  # the same 20 prompts each time
    assert not set(seen[0]) & set(stats.demos) and not set(seen[0]) & held_out
    # a target never reached: every step runs, a check every check_every steps
    seen.clear()
    never = settings.model_copy(update={"target_accuracy": 1.0, "steps": 12})
    _, stats = warm_up(fresh_policy(tiny_dir), prompts.train, prompts.template, never, seed=0, check=lambda p, items: 0.0)
    assert len(stats.losses) == 12 and [s for s, _ in stats.checks] == [5, 10]
    # too few training prompts left to check on: a clear error
    from dagster_rl.tasks.lm.train.warmup import WarmupError

    greedy = settings.model_copy(update={"check_prompts": len(prompts.train)})
    with pytest.raises(WarmupError, match="lower warmup.check_prompts or warmup.demos"):
        warm_up(fresh_policy(tiny_dir), prompts.train, prompts.template, greedy, seed=0, check=check)
