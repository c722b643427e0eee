"""Every key names every input: for every artifact of every registered task, equal keys mean equal bytes.

Each task kind has a tiny experiment here (`BASES`); `tests/key_completeness.py` computes all it
stores (initial weights, warm-up, two steps of rollouts, rewards and weights, evaluations, worlds,
the LLM judge's journal), then changes every setting of the experiment and of its three
environments in turn (found by walking their pydantic models: a new field is covered without a line
here) and computes again on a fresh store. An artifact that both store under one key with other
bytes is a key that leaves the setting out: the test names the setting and the artifact.

`OUTSIDE_KEYS` is the one place that says which settings enter no key, each with why; the test
checks that changing each of them changes no key and no stored byte. A setting that is in neither
a key nor that list fails the test.
"""

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Literal

import pytest
from pydantic import ValidationError

from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.core.task import BUILTIN_TASKS, Backends
from dagster_rl.store.artifact_store import ADOPTING_KINDS
from dagster_rl.tasks.agent.environment import register_environment
from dagster_rl.tasks.agent.text_world import SPEC, SecretSearchTextSettings
from tests.key_completeness import Change, Plan, Walk, _listed, changes, combined, compute, findings, outcome
from tests.openai_stub import OpenAIStub

# The settings that must not enter any cache key, and why (a section covers its fields). Changing
# each one must change no key and no stored byte: the test computes it.
OUTSIDE_KEYS = {
    "description": "free text shown in the UI",
    "n_steps": "how many steps the experiment has: a step's inputs are the same whatever follows it",
    "min_trials_per_step": "the floor below which a step fails: it judges what is stored, and changes none of it",
    "checks": "thresholds of the blocking checks: they judge what is stored, and change none of it",
    "faults": "seeded fault injection, on first attempts only and retried: a step computed again, or healed, holds the "
    "same bytes (a crash of the driver is the driver's, outside the loop)",
    "driver_pod": "what the driver's pod needs on Kubernetes: where it runs, not what it computes",
    "plugins": "the modules imported before the file is read, to register what it names: what a plugin registers is "
    "keyed by its own code version (a text environment's `code_version`), not by the file or module that registered it",
    "generation_threads": "torch threads of generation: the same tokens and log-probs whatever the count",
    "policy.device=cpu": "where the policy runs (auto: cuda when there is one); across devices numbers agree to float "
    "rounding, and a run resumed on another device reuses every stored step",
    "trainer.session": "workers for a range or a launch per step: both store the same bytes (test_trainer_session.py)",
    "trainer.session_idle_timeout_s": "when idle workers stop: a timeout",
    "trainer.nproc_per_node": "with backend in_process it is unused; with torchrun or k8s it sets the world size, which "
    "the weights' key holds (the world_size input)",
    "trainer.threads_per_process": "torch threads of each trainer process: the same bytes whatever the count",
    "trainer.max_restarts": "k8s: restarts of the pods after a failure; a timeout-like limit",
    "trainer.active_deadline_s": "k8s: a step's deadline",
    "trainer.pods": "what each trainer pod needs: where it runs, not what it computes",
    "environments.rollout.max_retries": "environment limits: a retried trial is the same trial (everything is seeded)",
    "environments.rollout.timeout_s": "environment limits: a timeout",
    "environments.rollout.max_concurrency": "trials are seeded one by one and stored in trial-id order: the same bytes "
    "whatever runs at once",
    "environments.rollout.sandbox_root": "where trials write their sandboxes, which die with them",
    "environments.rollout.base_url": "where the rollout server is (unused by the in-process engines): the server "
    "serves the experiment's own policy, which the on_policy check holds it to",
    "environments.rollout.api_key": "a credential",
    "environments.rollout.request_timeout_s": "a timeout",
    "environments.rollout.adapter_dir": "where the server reads adapters: the bytes are checked to be the run's",
    "environments.rollout.server_command": "how the rollout server starts (unused by the in-process engines)",
    "environments.rollout.server_startup_timeout_s": "a timeout",
    "environments.judge.max_retries": "environment limits: a retried judgement replays its journal",
    "environments.judge.timeout_s": "a timeout",
    "environments.judge.max_concurrency": "judgements are stored in trial-id order: the same bytes whatever runs at once",
    "environments.judge.base_url": "where the judge model is served; its model's name is in the keys",
    "environments.judge.api_key": "a credential",
    "environments.judge.request_timeout_s": "a timeout",
    "environments.trainer.max_retries": "environment limits: a retried update computes the same bytes",
    "environments.trainer.timeout_s": "a timeout",
    "environments.trainer.max_concurrency": "one update at a time in a range whatever it says",
    "environments.sandbox.max_retries": "a sandbox that could not be made is made again: a program runs once",
    "environments.sandbox.timeout_s": "how long a call waits for a free sandbox: a timeout",
    "environments.sandbox.max_concurrency": "programs run in their trial's own sandbox, whatever runs beside them",
    "environments.sandbox.root": "where the episodes' folders lie, which die with them",
    "environments.sandbox.uid": "the unprivileged user programs run as: a program sees its own folder, whoever owns it",
    "environments.sandbox.python": "the interpreter programs run on: what it is (its version) enters the rollouts' key of an "
    "environment that runs programs (`Sandboxes.identity`), not where it lies",
    "environments.sandbox.pod_image": "where programs run on a cluster: what the image's interpreter is enters the "
    "rollouts' key of an environment that runs programs (`Sandboxes.identity`)",
    "environments.sandbox.pod_namespace": "where sandbox pods run",
    "environments.sandbox.pod_runtime_class_name": "the kernel between a program and the node (gVisor, Kata): the same "
    "program prints the same",
    "environments.sandbox.pod_service_account": "an account bound to no Role: what a pod may call, not what it computes",
    "environments.sandbox.pod_pool_size": "pods started ahead, each for one episode: when a pod starts, not what runs in it",
    "environments.sandbox.pod_cpu_limit": "a pod's CPU rate: a program's CPU seconds (the experiment's limit) are the "
    "same; the wall backstop is checked to fit it",
    "environments.sandbox.pod_memory_limit": "a pod's memory: each process's address space is the experiment's limit, "
    "checked to fit it",
    "rubric.functions.0.timeout_s": "a reward function's time limit: a call past it fails its trial, never stored",
}
# The settings whose change may change float bytes within rounding (`dagster_rl.base.differences`): the
# stored float artifacts are then another computation of the same plan (adopted by a second writer),
# and the keys computed from their content hashes differ. Each must change nothing else.
ROUNDING = {
    "generation_threads": "torch threads of generation: the same tokens whatever the count; a multi-turn episode's "
    "longer batched forwards round their log-probs otherwise with another count (within rounding)",
    "faults.flaky_trial_rate": "a trial retried after its first attempt failed is generated in another batch, whose "
    "shapes round its log-probs otherwise (within rounding); its tokens are the same",
}
# Changes this test does not compute, and why; what holds each instead.
SKIP = {
    "trainer.backend=torchrun": "starts torchrun (seconds): test_lm_ddp.py and test_trainer_session.py show it stores "
    "the in-process trainer's bytes at world size 1",
    "trainer.backend=k8s": "needs a cluster: test_k8s_trainer.py runs it on a fake one",
    "trainer.nodes": "more than one needs backend k8s (a cluster); it enters the weights' key as world_size",
    "policy.device=cuda": "no GPU in CI: test_lm_cuda.py",
    "environments.sandbox.backend=k8s": "needs a cluster (and an image): where programs run, not what they print; the "
    "interpreter they run on enters the rollouts' key of an environment that runs programs (`Sandboxes.identity`), and "
    "test_k8s_sandbox.py runs the pods' protocol on a fake cluster",
    "task.environment=TextArenaSettings": "a game's moves do not fit the base's 3-token turns: a game is walked from its "
    "own base (test_every_key_of_a_text_game_names_every_setting)",
    "task.environment.num_disks": "TowerOfHanoi's, refused beside the base's GuessTheNumber options: the game's options "
    "enter the key as its other options do (max_number, min_number: walked)",
    "rollout.backend=openai_server": "needs a rollout server: its engine and request version are in the rollouts' key "
    "(LMRolloutSettings.cache_inputs); test_lm_openai_server.py computes it",
}
# Environment fields that are other resources, not settings.
NOT_SETTINGS = {
    "environments.judge.artifact_store": "the store itself (each computation has a fresh one)",
    "environments.trainer.launcher": "how torchrun starts (trainer.backend says whether it does)",
    "environments.trainer.k8s": "how pods start (trainer.backend says whether they do)",
}

BASES = {
    "secret_search": {
        "name": "keys",
        "n_steps": 2,
        "prompts_per_step": 2,  # fewer than n_worlds: a step uses 2 of the 3 worlds
        "n_samples": 2,
        "min_trials_per_step": 1,
        "task": {"kind": "secret_search", "n_worlds": 3, "n_docs": 4, "max_turns": 2, "scratch_rate": 0.5},
        "grpo": {"learning_rate": 1.0},
    },
    "verifiable_prompts": {
        "name": "keys",
        "n_steps": 2,
        "prompts_per_step": 2,
        "n_samples": 2,
        "min_trials_per_step": 1,
        "task": {"kind": "verifiable_prompts", "source": {"kind": "synthetic", "ops": ["copy"], "n_eval": 2}},
        "policy": {
            "base_model": "builtin:tiny-qwen2",
            "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"], "init_seed": 1},
        },
        "sampling": {"max_new_tokens": 2},
        "rubric": {"accuracy": 1.0, "format": 0.5},
        "grpo": {"learning_rate": 0.01, "kl_beta": 0.01},
        "warmup": {
            "demos": 2,
            "steps": 2,
            "batch_size": 2,
            "learning_rate": 0.01,
            "target_accuracy": 1.0,
            "check_every": 1,
            "check_prompts": 2,
        },
    },
}


BASES["text_agent"] = {
    "name": "keys",
    "n_steps": 2,
    "prompts_per_step": 2,
    "n_samples": 2,
    "min_trials_per_step": 1,
    "task": {
        "kind": "text_agent",
        "environment": {"name": "secret_search", "n_docs": 3, "titles": 4, "digest_chars": 2, "demo_clue_rate": 0.5},
        "episode": {"max_turns": 2, "max_turn_tokens": 3},
        "n_eval": 2,
    },
    "policy": {
        "base_model": "builtin:tiny-qwen2-agent",
        "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"], "init_seed": 1},
    },
    "grpo": {"learning_rate": 0.01, "kl_beta": 0.01},
    "warmup": {"demos": 2, "steps": 2, "batch_size": 2, "learning_rate": 0.01},
}


# A text game's base: GuessTheNumber within 4 turns of up to 6 tokens (a move `[n]` and its end).
GAME_BASE = {
    **BASES["text_agent"],
    "task": {
        "kind": "text_agent",
        "environment": {"name": "textarena", "game": "GuessTheNumber-v0", "prompt": "brief", "max_number": 4},
        "episode": {"max_turns": 4, "max_turn_tokens": 6},
        "n_eval": 2,
    },
    "warmup": {**BASES["text_agent"]["warmup"], "max_turns": 4},
}


class _CopySettings(SecretSearchTextSettings):
    name: Literal["secret_search_copy"] = "secret_search_copy"  # type: ignore[assignment]


# another text environment (the same world under another name and code version): the agent's rollouts,
# warm-up and evaluations must name the environment they were played in
register_environment(replace(SPEC, name="secret_search_copy", settings=_CopySettings, code_version="secret-search-copy-1"))


def _gsm8k_file(folder: Path, name: str, shift: int) -> str:
    """A GSM8K-format file of the tiny model's words: "copy 3 :" -> 3."""
    lines = [{"question": f"copy {d} :", "answer": f"{(d + shift) % 10} #### {(d + shift) % 10}"} for d in range(10)]
    path = folder / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


GYM = {
    "kind": "reasoning_gym",
    "dataset": "chain_sum",
    "config": {"min_terms": 2, "max_terms": 2, "max_digits": 1},
    "size": 8,
    "n_eval": 2,
    "extract": "last_number",
}
FUNCTIONS_RUBRIC = {
    "kind": "functions",
    "accuracy": 1.0,
    "format": 0.5,
    "functions": [{"function": "tests.reward_fixtures:length", "weight": 0.5}],
}


def _overrides(folder: Path, judge_url: str, kind: str) -> dict[str, list]:
    """Values of settings that cannot be guessed from their type."""
    data_file = {
        "kind": "datasets",
        "path": _gsm8k_file(folder, "c.jsonl", 0),  # absolute: a plan is parsed with no experiments folder
        "columns": {"prompt": "question", "answer": "answer"},
        "n_eval": 2,
    }
    return {
        "environments.judge.base_url": [judge_url.replace("127.0.0.1", "localhost")],  # the same judge, named otherwise
        # another model: the same tokenizer (a chat model's, for the agent: its turn markers frame the observations)
        "policy.base_model": ["builtin:tiny-qwen2-gsm8k" if kind == "text_agent" else "builtin:tiny-qwen2-vllm"],
        "task.source": [
            {"kind": "gsm8k", "path": _gsm8k_file(folder, "a.jsonl", 0), "n_eval": 2, "template": "{question}"},
            data_file,
            GYM,
        ],
        "task.source.path": [_gsm8k_file(folder, "b.jsonl", 1)],
        "task.source.columns": [{"prompt": "question", "answer": "answer", "level": "answer"}],  # one more column
        "task.source.dataset": ["basic_arithmetic"],  # reasoning-gym: another task with the same config fields
        "task.source.config": [{"min_terms": 2, "max_terms": 2, "max_digits": 2}],
        "rubric": [FUNCTIONS_RUBRIC],
        "rubric.functions": [[*FUNCTIONS_RUBRIC["functions"], {"function": "tests.reward_fixtures:mentions_answer"}]],
        "rubric.functions.0.function": ["tests.reward_fixtures:echo_columns"],
        "task.environment": [
            {"name": "secret_search_copy"},  # another environment (registered above)
        ],
        "task.environment.name": ["secret_search"],
        "task.environment.game": ["GuessTheNumber-v0-hardcore"],  # textarena: another verified game of the family
        "task.environment.max_number": [5],  # a game the warm-up's demonstrations win within 4 turns
        "task.environment.min_number": [2],
        "plugins": [["dagster_rl.tasks.agent.text_world"]],  # a module that registers a text environment
    }


def _environments(judge_url: str) -> dict:
    return {
        "rollout": {"base_url": "http://127.0.0.1:9/v1"},  # where a server would be: the in-process engines use none
        "judge": {"backend": "openai", "base_url": judge_url, "model": "judge-a"},
        "trainer": {},
        "sandbox": {},
    }


def _resources():
    from resources import JudgeEnvironment, RolloutEnvironment, SandboxEnvironment, TrainerEnvironment

    return {
        "rollout": RolloutEnvironment,
        "judge": JudgeEnvironment,
        "trainer": TrainerEnvironment,
        "sandbox": SandboxEnvironment,
    }


def _valid(plan: Plan) -> bool:
    try:
        parse_experiment(plan.experiment)
        for tier, cls in _resources().items():
            kwargs = dict(plan.environments[tier])
            if tier == "trainer":
                from resources import PipesTorchrunLauncher

                kwargs["launcher"] = PipesTorchrunLauncher()
            if tier == "judge":
                from resources import ArtifactStoreResource

                kwargs["artifact_store"] = ArtifactStoreResource(url="file:///nonexistent")
            made = cls(**kwargs)
            if tier == "rollout":
                made.endpoint()
    except (ValidationError, ValueError):
        return False
    return True


def _build(plan: Plan, root: Path, folder: Path | None = None):
    """The experiment (read as from `folder`, the experiments folder), and its backends built by the
    environments as the driver builds them."""
    from resources import ArtifactStoreResource, PipesTorchrunLauncher

    exp = parse_experiment(plan.experiment, folder)
    env, resources = plan.environments, _resources()
    rollout = resources["rollout"](**env["rollout"])
    judge = resources["judge"](artifact_store=ArtifactStoreResource(url=f"file://{root}"), **env["judge"])
    trainer = resources["trainer"](launcher=PipesTorchrunLauncher(), **env["trainer"])
    sandboxes = resources["sandbox"](**env["sandbox"]).sandboxes()
    return exp, Backends(rollout.backend_for(exp, sandboxes), judge.backend_for(exp), trainer.backend_for(exp, None))


def _judge_score(body: dict) -> float:
    """A judge that answers each question with its own score: another question, another score."""
    digest = hashlib.sha256(json.dumps(body["messages"], sort_keys=True).encode()).digest()
    return round(digest[0] / 255, 3)


@pytest.fixture(scope="module")
def judge():
    with OpenAIStub(rule=_judge_score) as stub:
        yield stub


@pytest.fixture(autouse=True)
def one_thread():
    """Torch on one thread: these tiny models' ops cost less than waking a second thread on a busy machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class Computations:
    """Plans computed once each, on a store of their own."""

    def __init__(self, folder: Path):
        self.folder, self.done = folder, {}

    def __call__(self, plan: Plan) -> dict:
        key = plan.key()
        if key not in self.done:
            self.done[key] = compute(plan, self.folder / f"store-{len(self.done)}", _build)
        return self.done[key]


def audit(
    kind: str,
    folder: Path,
    judge_url: str,
    only: set[str] | None = None,
    outside: dict[str, str] = OUTSIDE_KEYS,
    base: dict | None = None,
) -> tuple[list[str], int]:
    """Every finding of every setting of the task's base experiment (`base`, else BASES[kind]; only
    the settings in `only`, when given), and how many settings were changed. Each setting that should enter a key is
    changed and computed alone; those of OUTSIDE_KEYS all at once, and split in halves only when
    something of them shows (a change of none of them may show)."""
    walk = Walk(_valid, _overrides(folder, judge_url, kind), SKIP)
    base = Plan(base or BASES[kind], _environments(judge_url))
    computed = Computations(folder)
    every = [c for c in changes(base, _resources(), set(NOT_SETTINGS), walk) if only is None or c.setting in only]
    together = [c for c in every if _listed(c.setting, outside) and not _listed(c.setting, ROUNDING)]
    problems = []
    for change in every:
        if change not in together:
            problems += _alone(change, computed, outside)
    problems += _together(base, together, computed, outside)
    if only is None:
        problems += [
            f"{s}: no value of it validates; add one to _overrides, or the change to SKIP with why" for s in walk.unchangeable
        ]
    return problems, len(every)


def _alone(change: Change, computed: "Computations", outside: dict[str, str]) -> list[str]:
    seen = outcome(change.setting, computed(change.reference), computed(change.changed), ADOPTING_KINDS)
    return findings(change.setting, seen, outside, ROUNDING)


def _together(base: Plan, group: list[Change], computed: "Computations", outside: dict[str, str]) -> list[str]:
    if not group:
        return []
    plan = combined(base, group)
    if plan is not None and _valid(plan):
        names = ", ".join(c.setting for c in group)
        seen = outcome(names, computed(base), computed(plan), ADOPTING_KINDS)
        if not (seen.omissions or seen.rounding or seen.moved):
            return []
    if len(group) == 1:
        return _alone(group[0], computed, outside)
    half = len(group) // 2
    return _together(base, group[:half], computed, outside) + _together(base, group[half:], computed, outside)


@pytest.mark.parametrize("kind", sorted(BUILTIN_TASKS))
def test_every_key_names_every_setting_that_changes_its_bytes(kind, tmp_path, judge):
    start = time.monotonic()
    problems, n = audit(kind, tmp_path, judge.base_url)
    assert n > 20, f"only {n} settings of {kind} were changed"
    assert not problems, f"{len(problems)} problem(s) of the cache keys of {kind}:\n" + "\n".join(problems)
    print(f"{kind}: {n} settings changed and computed in {time.monotonic() - start:.1f} s")


def test_every_key_of_a_text_game_names_every_setting(tmp_path, judge):
    start = time.monotonic()
    problems, n = audit("text_agent", tmp_path, judge.base_url, base=GAME_BASE)
    assert n > 20, f"only {n} settings of a text game were changed"
    assert not problems, f"{len(problems)} problem(s) of the cache keys of a text game:\n" + "\n".join(problems)
    print(f"a text game: {n} settings changed and computed in {time.monotonic() - start:.1f} s")


def test_every_task_kind_has_a_base_experiment():
    assert set(BASES) == set(BUILTIN_TASKS), "give every task kind a tiny experiment in BASES, so its keys are checked"


def _initial_prior_keyed_by_the_task_alone(exp, store):
    """The secret_search initial prior as it was keyed before: by its `task` block alone."""
    from dagster_rl.base.hashing import cache_key
    from dagster_rl.core.task import Weights
    from dagster_rl.tasks.secret_search.loop import used_worlds
    from dagster_rl.tasks.secret_search.prior import uniform
    from dagster_rl.tasks.secret_search.records import TabularWeights

    priors = TabularWeights(version=0, doc_prior={w: uniform(exp.task.n_docs) for w in used_worlds(exp)})
    return Weights(
        "initial", store.put_model("weights", cache_key("weights", "tabular-uniform-1", task=exp.task), priors), priors, 0
    )


def test_a_key_that_leaves_a_setting_out_is_named_with_the_artifact(tmp_path, judge, monkeypatch):
    """The omission this test was written for: two experiments with one `task:` block, the first
    with fewer prompts per step than worlds, shared one initial prior."""
    import dagster_rl.tasks.secret_search.loop as loop

    monkeypatch.setattr(loop, "initial_weights", _initial_prior_keyed_by_the_task_alone)
    problems, n = audit("secret_search", tmp_path, judge.base_url, only={"prompts_per_step"})
    assert n == 1 and len(problems) == 1, problems
    assert problems[0].startswith("prompts_per_step: initial weights (weights/") and "leaves this setting out" in problems[0]


@pytest.mark.parametrize(
    "outside, setting, said",
    [
        ({**OUTSIDE_KEYS, "seed": "claimed"}, "seed", "seed is in OUTSIDE_KEYS (claimed), but changing it changes the key of"),
        (
            {k: v for k, v in OUTSIDE_KEYS.items() if k != "description"},
            "description",
            "description changes no key and no stored byte",
        ),
    ],
)
def test_a_setting_in_a_key_and_the_list_or_in_neither_is_named(tmp_path, judge, outside, setting, said):
    problems, _ = audit("secret_search", tmp_path, judge.base_url, only={setting}, outside=outside)
    assert len(problems) == 1 and problems[0].startswith(said), problems


def test_the_content_of_a_prompt_file_is_in_the_keys_that_read_it(tmp_path, judge):
    """A file's content is an input as its settings are: the same path holding other answers."""
    source = {"kind": "gsm8k", "path": _gsm8k_file(tmp_path, "prompts.jsonl", 0), "n_eval": 2, "template": "{question}"}
    plan = Plan(
        {**BASES["verifiable_prompts"], "task": {"kind": "verifiable_prompts", "source": source}}, _environments(judge.base_url)
    )
    before = compute(plan, tmp_path / "before", _build)
    _gsm8k_file(tmp_path, "prompts.jsonl", 1)  # the same questions (the same prompt ids), other answers
    after = compute(plan, tmp_path / "after", _build)
    seen = outcome("the content of task.source.path", before, after, ADOPTING_KINDS)
    assert not seen.omissions and not seen.rounding, seen.omissions
    assert {"the warm-up's weights", "rollouts of step 0000"} <= set(seen.moved)


def test_the_bytes_of_a_reward_functions_file_are_in_the_keys_of_what_it_scores_and_nothing_else(tmp_path, judge):
    """The same experiment, its function's file edited: the rewards and what follows them are new
    artifacts; the warm-up and the first rollouts are not (nothing else changes a key)."""
    from functools import partial

    from tests.reward_fixtures import USER_FILE

    folder = tmp_path / "experiments"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(USER_FILE)
    rubric = {"kind": "functions", "functions": [{"function": "my_rewards.py:distinct_chars"}]}
    plan = Plan({**BASES["verifiable_prompts"], "rubric": rubric}, _environments(judge.base_url))
    before = compute(plan, tmp_path / "before", partial(_build, folder=folder))
    (folder / "my_rewards.py").write_text(USER_FILE.replace("/ 64", "/ 32"))  # the same name, other rewards
    after = compute(plan, tmp_path / "after", partial(_build, folder=folder))
    seen = outcome("the bytes of my_rewards.py", before, after, ADOPTING_KINDS)
    assert not seen.omissions and not seen.rounding, seen.omissions
    assert {"rewards of step 0000", "rewards of step 0001", "weights of step 0000"} <= set(seen.moved)
    assert not {"the warm-up's weights", "initial weights", "rollouts of step 0000"} & set(seen.moved)
