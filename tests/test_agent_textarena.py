"""Text games: textarena's single-player games as a text environment (`textarena`).

- the verified games are textarena's own, as it registers them; a game not verified is refused
  naming the ones that are, and an option of another game is refused;
- the mapping: the game's prompt (or a brief one) is the first observation, what the game answers
  an action is the next one (verbatim, without the wrappers' history), its reward is the verdict
  (`success` when it says the player won; the raw reward and the game's reason beside it);
- a game is its world's seed alone: the same seed plays the same game, another seed another, and
  two games interleaved in one process play as each does alone, leaving Python's `random` as it was
  (textarena seeds the global `random`);
- the demonstrations win; the games play offline (no socket, no NLTK download);
- through the real driver, a textarena game warms up, trains, and a run crashed after step 0
  resumes to the same bytes.
"""

import random
import socket

import pytest
from pydantic import ValidationError

from dagster_rl.core.experiment_files import parse_experiment
from dagster_rl.tasks.agent.environment import World, environment_of
from dagster_rl.tasks.agent.textarena_game import SPEC, PrivateRandom, TextArenaGame, demonstrate, hanoi
from dagster_rl.tasks.agent.textarena_settings import GAMES, TextArenaSettings
from tests.harness import CHAIN
from tests.settings import shipped_settings

GUESS = TextArenaSettings(game="GuessTheNumber-v0")


def target(settings: TextArenaSettings, world: World) -> int:
    """The number a GuessTheNumber world hides: the last guess of a binary search that wins it."""
    actions = demonstrate(settings.model_copy(update={"demo_bisect_rate": 1.0}), world, random.Random(0))
    return int(actions[-1].strip("[]"))


def play(settings: TextArenaSettings, world: World, actions: list[str]) -> list[object]:
    game = TextArenaGame(settings, world, 0, None)
    seen: list[object] = [game.reset()]
    for action in actions:
        outcome = game.step(action)
        seen.append(outcome)
        if outcome.done:
            break
    return [*seen, game.verdict()]


def test_the_verified_games_are_textarenas_own_and_registered():
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY

    for game, spec in GAMES.items():
        assert ENV_REGISTRY[game].kwargs == spec.options, game
        assert ENV_REGISTRY[f"{game}-raw"].default_wrappers is None, game  # the game alone, no observation wrapper
    assert environment_of("textarena") is SPEC and SPEC.code_version.endswith(f"+textarena-{ta.__version__}")


def test_a_game_not_verified_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValidationError) as refused:
        TextArenaSettings(game="Wordle-v0")
    message = str(refused.value)
    assert "'Wordle-v0' is not a textarena game verified to run offline" in message
    assert all(game in message for game in GAMES)
    raw = shipped_settings("tiny_guess_number")
    raw["task"]["environment"] = {**raw["task"]["environment"], "game": "Chess-v0"}
    with pytest.raises(ValueError, match=r"'Chess-v0' is not a textarena game verified.*GuessTheNumber-v0, "):
        parse_experiment(raw)
    with pytest.raises(ValidationError, match="num_disks is a setting of the TowerOfHanoi games, not of GuessTheNumber-v0"):
        TextArenaSettings(game="GuessTheNumber-v0", num_disks=3)
    with pytest.raises(ValidationError, match=r"min_number \(9\) must be below max_number \(5\)"):
        TextArenaSettings(game="GuessTheNumber-v0", min_number=9, max_number=5)


def test_the_games_observations_are_the_observations_and_its_reward_the_verdict():
    world = World("e0", 11)
    number = target(GUESS, world)
    low = 1 if number > 1 else 2
    first, hint, won, verdict = play(GUESS, world, [str(low), f" [{number}] is my guess"])
    assert first.startswith("You are Player 0. You are playing Guess The Number.") and "[5]" in first
    assert (hint.observation, hint.done, hint.tool, hint.argument) == (
        f"The target number is {'higher' if number > low else 'lower'}.",  # verbatim; the bare `1` read as `[1]`
        False,
        "guess",
        f"[{low}]",
    )
    assert won.done and won.end_reason == "won" and won.observation == ""
    assert verdict == {
        "success": True,
        "reward": 1.0,
        "reason": "Congratulations! You guessed the correct number.",
        "game_over": True,
        "moves": 2,
        "game": "GuessTheNumber-v0",
    }

    # one invalid move is forgiven with the game's reason; the second in a row ends the game, not won
    _, forgiven, ended, verdict = play(GUESS, world, ["no idea", "still none"])
    assert forgiven.observation.startswith("You attempted an invalid move. Reason: Invalid move format.") and not forgiven.done
    assert ended.end_reason == "invalid_move" and verdict["success"] is False and verdict["reason"].startswith("Invalid Move")

    # the episode's turn budget may end a game before the game does: not over, no reward, not a success
    hanoi_game = TextArenaSettings(game="TowerOfHanoi-v0", prompt="brief")
    board, moved, verdict = play(hanoi_game, world, ["A C"])
    assert board == "Move the 3 disks from tower A to tower C, one disk a turn, never a bigger disk onto a smaller one. " + (
        "Reply with a move, like [A C].\nCurrent Board: \nA: [3, 2, 1]\nB: []\nC: []\n."
    )
    assert moved.observation == "You moved disk 1 from A to C.\nCurrent Board: \nA: [3, 2]\nB: []\nC: [1]\n."
    assert verdict == {
        "success": False,
        "reward": None,
        "reason": None,
        "game_over": False,
        "moves": 1,
        "game": "TowerOfHanoi-v0",
    }

    # the game's own turn limit loses it (textarena ends it at the move after the limit), with its partial credit
    short = GUESS.model_copy(update={"game_turns": 1})
    wrong = [str(n) for n in range(1, 21) if n != number][:2]
    _, _, lost, verdict = play(short, world, wrong)
    assert lost.end_reason == "lost" and verdict["success"] is False and 0.0 < verdict["reward"] < 1.0
    assert verdict["reason"] == f"The turn limit has been reached. Guess: {wrong[-1]}, Target: {number}"


def test_a_game_is_its_seed_alone_and_games_in_one_process_do_not_share_random():
    actions = [f"[{n}]" for n in (5, 8, 2, 9, 1, 3)]
    a, b = World("t0.0", 101), World("t0.1", 202)
    alone_a, alone_b = play(GUESS, a, actions), play(GUESS, b, actions)
    assert play(GUESS, World("another id", 101), actions) == alone_a  # the seed, not the id
    assert len({target(GUESS, World("w", seed)) for seed in range(12)}) > 3  # other seeds, other games

    before = random.getstate()
    first, second = TextArenaGame(GUESS, a, 0, None), TextArenaGame(GUESS, b, 0, None)
    random.random()  # someone else draws from the global random between the games' calls
    seen_a, seen_b = [first.reset()], [second.reset()]
    for action in actions:
        for game, seen in ((second, seen_b), (first, seen_a)):
            if not (seen[-1:] and getattr(seen[-1], "done", False)):
                seen.append(game.step(action))
    random.seed(5)  # textarena's reset calls random.seed(): the games' own states are not the global one
    assert [*seen_a, first.verdict()] == alone_a and [*seen_b, second.verdict()] == alone_b

    random.setstate(before)
    TextArenaGame(GUESS, a, 0, None).step("[5]")
    assert random.getstate() == before  # a game leaves Python's random as it found it

    private, reference = PrivateRandom(3), random.Random(3)
    assert [private.call(random.random) for _ in range(3)] == [reference.random() for _ in range(3)]
    assert random.getstate() == before


def test_the_demonstrations_win_by_binary_search_a_scan_or_the_recursive_solution():
    rng = random.Random(0)
    for i in range(30):
        world = World(f"d{i}", i)
        bisect = demonstrate(GUESS, world, rng)
        assert play(GUESS, world, bisect)[-1]["success"] and len(bisect) <= 5  # 1..20: at most 5 guesses
        scan = demonstrate(GUESS.model_copy(update={"demo_bisect_rate": 0.0}), world, rng)
        assert scan == [f"[{n}]" for n in range(1, len(scan) + 1)] and len(scan) <= 11  # the game's 10 turns, + 1
        assert play(GUESS, world, scan)[-1]["success"] == (target(GUESS, world) <= 11)
    for game, disks in (("TowerOfHanoi-v0", 3), ("TowerOfHanoi-v0-medium", 4)):
        moves = demonstrate(TextArenaSettings(game=game), World("d0", 0), rng)
        assert moves == hanoi(disks) and len(moves) == 2**disks - 1
        assert play(TextArenaSettings(game=game), World("d0", 0), moves)[-1]["success"]


def test_the_verified_games_play_offline(monkeypatch):
    import nltk

    def refused(*args, **kwargs):
        raise AssertionError(f"a game reached for the network: {args}")

    monkeypatch.setattr(socket.socket, "connect", refused)
    monkeypatch.setattr(socket, "create_connection", refused)
    monkeypatch.setattr(nltk, "download", refused)
    for game in GAMES:
        settings = TextArenaSettings(game=game)
        world = World("e1", 3)
        assert play(settings, world, demonstrate(settings, world, random.Random(1)))[-1]["success"], game


SMALL = {
    **shipped_settings("tiny_guess_number"),
    "name": "guess_resume",
    "n_steps": 2,
    "prompts_per_step": 2,
    "n_samples": 2,
    "min_trials_per_step": 4,
    "policy": {
        "base_model": "builtin:tiny-qwen2-agent",
        "lora": {"rank": 2, "alpha": 4, "target_modules": ["q_proj", "v_proj"], "init_seed": 1},
    },
    "warmup": {"demos": 4, "steps": 2, "batch_size": 2, "learning_rate": 0.001, "max_turns": 10},
    "sampling": {"temperature": 2.0},
}
SMALL["task"] = {**SMALL["task"], "n_eval": 2, "episode": {"max_turns": 2, "max_turn_tokens": 4}}


def test_a_game_through_the_driver_resumes_to_the_same_bytes_after_a_crash(lab):
    whole = lab("guess_whole", SMALL)
    assert whole.run("guess_resume", "0000", "0001").success
    crashy = lab("guess_cut", {**SMALL, "faults": {"crash_driver_at_step": 0}})
    assert not crashy.run("guess_resume", "0000", "0001", raise_on_error=False).success
    resumed = crashy.reopen()
    assert resumed.run("guess_resume", "0000", "0001").success
    for asset in (*CHAIN, "evaluation"):
        for step in ("0000", "0001"):
            a, b = whole.latest("guess_resume", asset, step), resumed.latest("guess_resume", asset, step)
            assert a["content_hash"] == b["content_hash"], (asset, step)
    assert (
        whole.latest("guess_resume", "sft", None)["content_hash"] == resumed.latest("guess_resume", "sft", None)["content_hash"]
    )

    from dagster_rl.core.records import Rollouts
    from dagster_rl.tasks.agent.records import AgentTrajectory

    rollouts = whole.store().get_model(
        "rollouts", whole.latest("guess_resume", "rollouts", "0001")["artifact_key"], Rollouts[AgentTrajectory]
    )
    assert {t.world_id for t in rollouts.trajectories} == {"t1.0", "t1.1"}
    for t in rollouts.trajectories:
        assert t.first_observation.startswith("Guess the number from 1 to 10 within 10 turns.")
        assert t.end_reason in ("won", "invalid_move", "lost", "turn_budget") and t.verdict["game"] == "GuessTheNumber-v0"
        assert all(turn.tool == "guess" for turn in t.turns)
    first_of = {t.world_id: t.first_observation for t in rollouts.trajectories}
    assert len(set(first_of.values())) == 1  # the brief prompt; the games differ by their hidden number
