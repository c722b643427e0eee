"""One trial's turn loop: its environment in a process of its own, and its one growing token sequence.

An `Episode` does not sample: whoever samples (the in-process batch of `agent.rollout_hf`, one turn
of every live trial per forward pass; or, on a server, one request per turn of this trial) asks it
for the ids to continue (`ids`) and the turn's seed (`turn_seed`), and hands back what was sampled
(`advance`). The episode appends the sampled ids as they are, gives their decoded text to the
environment, and appends the environment's answer in the chat template's turn markers (mask 0).

The environment runs in a child process (`environment_process`): each of its calls is timed alone
and stopped at the trial's time limit, so an environment that blocks fails its own trial, never
the batch. The programs it runs (a tool call) run in the trial's sandbox and are recorded in the
turn that made them, with what they printed and how they ended (`ToolCall`); their wall times are
kept beside the trajectory (`call_seconds`), not in it, so that a trial replayed elsewhere stores
the same bytes.

Turn t of a trial draws from `seed_of(trial seed, "turn", t)`: a retried trial replays its turns.
The turn budget ends an episode as `turn_budget` (a trajectory); the environment's own exception,
an observation over `task.episode.max_observation_tokens`, or a trial that outlives its timeout is
a failure of the trial (retried, never cached). The trial's folder is made fresh when the episode
starts and removed when it closes, however it ends (or, if this process is killed, by the next
process that opens the same root).
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dagster_rl.base import counters
from dagster_rl.base.errors import DagsterRLError
from dagster_rl.base.hashing import seed_of
from dagster_rl.sandbox.calls import Call, Program
from dagster_rl.sandbox.folders import remove_tree, trial_folder
from dagster_rl.sandbox.placement import Sandboxes
from dagster_rl.tasks.agent.chat import ChatTurns
from dagster_rl.tasks.agent.environment import EnvironmentSettings, EnvironmentSpec, Outcome, World, environment_of
from dagster_rl.tasks.agent.environment_process import EnvironmentProcess, Returned, TrialTimeout, plain_verdict
from dagster_rl.tasks.agent.records import AgentTrajectory, EpisodeRequest, ToolCall, Turn
from dagster_rl.tasks.agent.trial_sandbox import TrialSandbox

if TYPE_CHECKING:
    from dagster_rl.tasks.agent.experiment import AgentExperiment

CHARS_PER_TOKEN = 16  # an observation longer than this many characters per allowed token is over its bound unread

__all__ = ["Episode", "ObservationTooLong", "Stage", "TrialTimeout", "stage"]


class ObservationTooLong(DagsterRLError):
    """An environment's observation is longer than `task.episode.max_observation_tokens`: a failed trial."""


@dataclass(frozen=True)
class Stage:
    """What the episodes of one rollout share: the environment and its settings, the chat template,
    the budgets, where trials keep their folders and run their programs. `isolated`: each trial's
    environment in a process of its own (rollouts and evaluations); off, in this process (the
    warm-up's demonstrations: the environment's own scripted actions, no time limit)."""

    spec: EnvironmentSpec
    settings: EnvironmentSettings
    chat: ChatTurns
    max_turns: int
    timeout_s: float
    sandbox_root: Path
    sandboxes: Sandboxes | None = None
    max_observation_tokens: int = 4096
    isolated: bool = True
    plugins: tuple[tuple[str, str | None], ...] = ()


def stage(
    exp: "AgentExperiment",
    chat: ChatTurns,
    sandbox_root: Path,
    sandboxes: Sandboxes | None,
    isolated: bool = True,
    max_turns: int | None = None,
) -> Stage:
    """The stage of an experiment's episodes (`max_turns`: another turn budget, the warm-up's)."""
    episode = exp.task.episode
    return Stage(
        spec=environment_of(exp.task.environment.name),
        settings=exp.task.environment,
        chat=chat,
        max_turns=max_turns or episode.max_turns,
        timeout_s=episode.trial_timeout_s if isolated else float("inf"),
        sandbox_root=sandbox_root,
        sandboxes=sandboxes,
        max_observation_tokens=episode.max_observation_tokens,
        isolated=isolated,
        plugins=exp.plugin_files(),
    )


class InlineEnvironment:
    """A trial's environment in this process, answering as an `EnvironmentProcess` does."""

    def __init__(self, stage: Stage, world: World, seed: int, folder: Path, label: str):
        self.sandbox = TrialSandbox(folder, stage.sandboxes, label)
        self.max_chars = stage.max_observation_tokens * CHARS_PER_TOKEN
        try:
            self.env = stage.spec.make(stage.settings, world, seed, self.sandbox)
        except BaseException:
            self.sandbox.close()
            raise

    def _cut(self, text: str) -> Returned:
        return Returned(text[: self.max_chars], len(text))

    def reset(self) -> Returned:
        return self._cut(self.env.reset())

    def step(self, action: str) -> tuple[Outcome, Returned, list[tuple[Program, Call]]]:
        outcome = self.env.step(action)
        return outcome, self._cut(outcome.observation), self.sandbox.taken()

    def verdict(self) -> Any:
        return plain_verdict(self.env.verdict())

    def calls(self) -> list[tuple[Program, Call]]:
        return self.sandbox.taken()

    def close(self) -> None:
        try:
            self.env.close()
        finally:
            self.sandbox.close()


def tool_call(program: Program, call: Call) -> ToolCall:
    return ToolCall(
        program=program.python if program.python is not None else " ".join(program.argv),
        stdout=call.stdout,
        stderr=call.stderr,
        stdout_cut=call.stdout_cut,
        stderr_cut=call.stderr_cut,
        exit_status=call.exit_status,
        signal=call.signal,
        outcome=call.outcome,
    )


class Episode:
    def __init__(self, request: EpisodeRequest, stage: Stage, clock: Callable[[], float] = time.monotonic):
        self.request, self.stage, self.chat, self.clock = request, stage, stage.chat, clock
        self.max_turns, self.timeout_s = stage.max_turns, stage.timeout_s
        self.started = clock()
        self.folder = trial_folder(stage.sandbox_root, request.trial_id)
        self.env: Any = None
        self.sandbox_seconds = 0.0
        self.call_seconds: list[list[float]] = []  # per turn, each program's wall time
        self.programs = 0  # programs its environment ran (counted in `programs_run`)
        try:
            world = World(request.world_id, request.world_seed)
            if stage.isolated:
                self.env = EnvironmentProcess(
                    stage.spec,
                    stage.settings,
                    world,
                    request.seed,
                    self.folder,
                    stage.sandboxes,
                    request.trial_id,
                    stage.max_observation_tokens * CHARS_PER_TOKEN,
                    lambda: self.seconds_left,
                    stage.plugins,
                )
            else:
                self.env = InlineEnvironment(stage, world, request.seed, self.folder, request.trial_id)
            self.first_observation = self._bounded(self.env.reset(), 0)
            setup = self.env.calls()  # programs that make() or reset() ran
            counters.bump("programs_run", len(setup))
            self.programs += len(setup)
            self.sandbox_seconds += sum(c.seconds for _, c in setup)
            self.prompt_ids = self.chat.prompt(self.first_observation)
        except BaseException:
            self.close()
            raise
        self.completion: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.turns: list[Turn] = []
        self.end_reason: str | None = None

    @property
    def live(self) -> bool:
        return self.end_reason is None

    @property
    def ids(self) -> list[int]:
        """The sequence the next action continues."""
        return [*self.prompt_ids, *self.completion]

    @property
    def seconds_left(self) -> float:
        """What is left of the trial's time limit (`task.episode.trial_timeout_s`)."""
        return self.timeout_s - (self.clock() - self.started)

    @property
    def turn_seed(self) -> int:
        return seed_of(self.request.seed, "turn", len(self.turns))

    def _bounded(self, returned: Returned, turn: int) -> str:
        """The observation, refused when it is longer than `max_observation_tokens` (counted in tokens
        of what was kept; one cut by the character bound is over it unread)."""
        limit = self.stage.max_observation_tokens
        too_long = returned.cut or len(self.chat.tokenizer(returned.text, add_special_tokens=False)["input_ids"]) > limit
        if too_long:
            raise ObservationTooLong(
                f"trial {self.request.trial_id}: environment {self.stage.spec.name}'s observation at turn {turn} holds "
                f"{returned.length} characters, more than task.episode.max_observation_tokens={limit} tokens: make the "
                "environment's observations shorter, or raise the bound"
            )
        return returned.text

    def _account(self, calls: list[tuple[Program, Call]]) -> list[ToolCall]:
        counters.bump("programs_run", len(calls))
        self.programs += len(calls)
        self.call_seconds.append([c.seconds for _, c in calls])
        self.sandbox_seconds += sum(c.seconds for _, c in calls)
        return [tool_call(p, c) for p, c in calls]

    def advance(self, sampled: list[int], logprobs: list[float], finish_reason: str) -> None:
        """One turn: the sampled ids (as sampled) and their log-probs; the environment's answer."""
        if not self.live or self.env is None:
            raise RuntimeError(f"trial {self.request.trial_id} has ended ({self.end_reason}); it takes no more turns")
        if len(sampled) != len(logprobs):
            raise ValueError(f"{len(sampled)} sampled ids with {len(logprobs)} log-probs")
        start = len(self.completion)
        self.completion += sampled
        self.mask += [1] * len(sampled)
        self.logprobs += logprobs
        action = str(self.chat.tokenizer.decode(sampled, skip_special_tokens=True))  # one sequence: one string
        outcome, returned, calls = self.env.step(action)
        tool_calls = self._account(calls)  # what ran is counted even when the turn fails below
        observation = self._bounded(returned, len(self.turns) + 1)
        end = len(self.completion)
        if outcome.done:
            self.end_reason = outcome.end_reason or "done"
        elif len(self.turns) + 1 >= self.max_turns:
            self.end_reason = "turn_budget"
        else:
            following = self.chat.after_action(sampled, observation)
            self.completion += following
            self.mask += [0] * len(following)
        self.turns.append(
            Turn(
                action_start=start,
                action_end=end,
                observation_end=len(self.completion),
                action=action,
                finish_reason=finish_reason,
                tool=outcome.tool,
                argument=outcome.argument,
                observation=observation,
                calls=tool_calls,
            )
        )
        self.check_time()

    def check_time(self) -> None:
        """A `TrialTimeout` once the trial has run longer than its timeout."""
        if self.seconds_left < 0:
            raise TrialTimeout(
                f"trial {self.request.trial_id} ran longer than its timeout of {self.timeout_s} s (task.episode.trial_timeout_s)"
            )

    def trajectory(self, temperature: float, top_p: float, behavior_version: int) -> AgentTrajectory:
        """The finished episode's record (with the environment's verdict)."""
        if self.live or self.env is None:
            raise RuntimeError(f"trial {self.request.trial_id} has not ended")
        r = self.request
        return AgentTrajectory(
            trial_id=r.trial_id,
            step=r.step,
            prompt=r.prompt,
            sample=r.sample,
            world_id=r.world_id,
            seed=r.seed,
            first_observation=self.first_observation,
            prompt_token_ids=self.prompt_ids,
            completion_token_ids=self.completion,
            completion_mask=self.mask,
            sampling_logprobs=self.logprobs,
            turns=self.turns,
            end_reason=self.end_reason or "done",
            verdict=self.env.verdict(),
            temperature=temperature,
            top_p=top_p,
            behavior_version=behavior_version,
        )

    def close(self) -> None:
        """Close the environment (its process, its sandbox) and remove the trial's folder, whatever the first raises."""
        try:
            if self.env is not None:
                self.env.close()
        finally:
            remove_tree(self.folder)
