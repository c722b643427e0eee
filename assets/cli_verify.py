"""`dagster-rl verify` and `dagster-rl lineage`: the artifacts an experiment's materializations name,
re-hashed and checked against what each materialization recorded (`verify --repair` moves the bad
ones to the store's quarantine); a step's weights traced back to step 0 through every behavior
policy, each step checked the same way.
"""

import argparse
import json
import sys
from typing import Any

from assets.chain import CHAIN, step_assets
from assets.cli_inputs import find_experiment, latest, not_ours_message, open_instance, open_store, quiet_closed_stdout
from dagster_rl.base.errors import CorruptArtifactError, DagsterRLError, StoreLinkError
from dagster_rl.core.experiment import Experiment, step_key
from dagster_rl.core.task import task_of


def cmd_verify(args: argparse.Namespace) -> None:
    """Re-hash every artifact the experiment's latest materializations name and compare its content
    hash with the one the materialization recorded; report each bad one (`--repair`: move it aside)."""
    exp = find_experiment(args.experiment)
    store = open_store(args, repair=args.repair)
    checked, bad = 0, []  # bad: (step, what is wrong, what --repair did)
    with open_instance() as instance:
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
    if (foreign := not_ours_message(md, what, step)) is not None:
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


def cmd_lineage(args: argparse.Namespace) -> None:
    """The chain of a step's weights back to step 0, read from the store; each step's artifacts are
    checked against the experiment's materializations of that step as `verify` checks them, and a
    mismatch is flagged under the step (exit 1)."""
    from dagster_rl.core.lineage import trace, trial_of
    from dagster_rl.store.artifact_store import check_key

    exp = find_experiment(args.experiment)
    step = parse_step(exp, args.step)
    store = open_store(args)
    with open_instance() as instance:
        md = latest(instance, exp, "weights", step)
        if md is None:
            sys.exit(f"dagster-rl: {exp.name}/weights has no materialization for step {step}; run it first")
        if (foreign := not_ours_message(md, f"{exp.name}/weights {step}", step)) is not None:
            sys.exit(f"dagster-rl: {foreign}.")
        try:
            chain = trace(store, check_key(md.get("artifact_key"), f"artifact key of {exp.name}/weights {step}"))
            trial = trial_of(store, chain, args.trial) if args.trial else None
        except DagsterRLError as e:
            sys.exit(f"dagster-rl: {e}")
        flags = {s.step: _lineage_flags(instance, exp, store, s) for s in chain}
        moved = bool(chain) and step_key(chain[0].step) != step  # e.g. step 1's artifact under step 3's name
        named = artifact_problem(store, md, "weights", step, exp)[0] if moved else None  # else `flags` checked it
    top = [f"weights {step}: {named}"] if named is not None and not any(flags.values()) else []
    bad = sorted(k for k, f in flags.items() if f)
    try:  # a reader that closes the pipe early (`| head`) still leaves the summary and the exit status
        if args.json:
            print(
                json.dumps(
                    [
                        dict(s.model_dump(), seeds_hash=s.seeds_hash, problems=flags[s.step] + (top if i == 0 else []))
                        for i, s in enumerate(chain)
                    ],
                    indent=2,
                )
                if trial is None
                else trial.model_dump_json(indent=2)
            )
        else:
            print(f"lineage of {exp.name}/weights {step} (artifacts in {store.url}, experiment seed {exp.seed})")
            for problem in top:
                print(f"  MISMATCH {problem}")
            for s in chain:
                b = s.behavior_policy
                print(f"step {step_key(s.step)}  weights v{s.weights_version} {s.weights_hash[:16]} (key {s.weights_key[:16]})")
                print(f"  <- rewards  {s.rewards_hash[:16]}  rubric {s.rubric.get('name')} {_rubric_weights(s.rubric)}")
                print(
                    f"  <- rollouts {s.rollouts_hash[:16]}  {s.n_trajectories} trajectories, {len(s.skipped)} skipped, "
                    f"seeds {s.seeds_hash[:16]} ({_seed_span(s.seeds)})"
                )
                print(f"  <- behavior policy: weights {b['partition']} v{b['version']} {str(b['content_hash'])[:16]}")
                for problem in flags[s.step]:
                    print(f"  MISMATCH {problem}")
            if trial is not None:
                print_trial(trial)
        sys.stdout.flush()
    except BrokenPipeError:
        quiet_closed_stdout()
    if bad or top:
        print(
            f"{sum(len(flags[k]) for k in bad) + len(top)} mismatch(es) with what Dagster recorded: `dagster-rl verify {exp.name}` lists "
            f"every bad artifact; re-run from step {step_key(bad[0]) if bad else step}.",
            file=sys.stderr,
        )
        sys.exit(1)


def parse_step(exp: Experiment, text: str) -> str:
    """A step number (`7` or `0007`) of the experiment, as its partition key; exits with a message otherwise."""
    if not text.isdigit() or not 0 <= int(text) < exp.n_steps:
        sys.exit(f"dagster-rl: {text!r} is not a step of {exp.name}; give a number from 0 to {exp.n_steps - 1} (e.g. 7 or 0007)")
    return step_key(int(text))


def _lineage_flags(instance, exp: Experiment, store, s) -> list[str]:
    """What is wrong with one step of a lineage: each of its artifacts against the latest
    materialization of this experiment's step (as `verify` checks it), and that materialization
    names the artifact the chain went through."""
    partition, flags = step_key(s.step), []
    hashes = {
        "rollouts": (s.rollouts_key, s.rollouts_hash),
        "rewards": (s.rewards_key, s.rewards_hash),
        "weights": (s.weights_key, s.weights_hash),
    }
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


def _rubric_weights(rubric: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in rubric.items() if k != "name")


def _seed_span(seeds: dict[str, int]) -> str:
    ids = sorted(seeds)
    return f"{ids[0]}={seeds[ids[0]]} .. {ids[-1]}={seeds[ids[-1]]}" if ids else "none"


def _call_line(call: dict, seconds: float | None) -> str:
    """A program a turn ran: its code, how it ended, what it printed, its time (`dagster_rl.sandbox.calls`)."""
    ending = f"exit status {call['exit_status']}" if call["outcome"] == "exit" else call["outcome"]
    if call["signal"]:
        ending += f", signal {call['signal']}"
    cut = " (stdout cut)" if call["stdout_cut"] else ""
    took = f", {seconds:.2f} s" if seconds is not None else ""
    stderr = f", stderr {call['stderr'][-120:]!r}" if call["stderr"] else ""
    return f"{call['program'][:200]!r}: {ending}{took}; stdout {call['stdout'][:200]!r}{cut}{stderr}"


def print_trial(trial) -> None:
    """A trial of a lineage: its reward, then each turn's action and observation with the tokens the
    model sampled and their log-probability (a multi-turn trajectory), its completion (a single-turn
    one), or its record as stored (a task whose trials hold no tokens)."""
    t, r = trial.trajectory, trial.reward
    if r is None:
        verdict = "skipped (judging failed)"
    else:
        verdict = f"reward {r['reward']:.3f}" + (f", {'correct' if r['correct'] else 'wrong'}" if "correct" in r else "")
    print(f"trial {trial.trial_id} (step {step_key(trial.step)}, seed {trial.seed}): {verdict}")
    turns, logps = t.get("turns"), t.get("sampling_logprobs")
    if isinstance(turns, list) and logps is not None:
        mask = t["completion_mask"]
        for i, turn in enumerate(turns):
            first = sum(mask[: turn["action_start"]])
            sampled = sum(mask[turn["action_start"] : turn["action_end"]])
            seen = "" if turn["observation"] == "" else f" -> {turn['observation']!r}"
            print(
                f"  turn {i + 1}: {turn['action']!r} ({sampled} tokens, log-prob {sum(logps[first : first + sampled]):.2f}, "
                f"{turn['finish_reason']}){seen}"
            )
            times = trial.call_seconds[i] if trial.call_seconds and i < len(trial.call_seconds) else []
            for k, call in enumerate(turn.get("calls", [])):
                print(f"    program {k + 1}: {_call_line(call, times[k] if k < len(times) else None)}")
        print(f"  ended: {t['end_reason']}")
    elif logps is not None:
        print(f"  completion: {t.get('completion_text')!r} ({len(logps)} tokens, log-prob {sum(logps):.2f})")
    else:
        print(f"  {json.dumps({k: v for k, v in t.items() if k != 'trial_id'})}")
