"""Errors that say what was wrong and what to do."""


class DagsterRLError(Exception):
    """Base class of every error dagster-rl raises on purpose."""

    retryable = True  # False: retrying the same run cannot help; the user must act first


class ExperimentError(DagsterRLError):
    """An experiment file is invalid."""


class MissingPredecessorError(DagsterRLError):
    """A step was asked for before the step whose weights it needs."""

    retryable = False


class TooFewTrialsError(DagsterRLError):
    """A step ended with fewer usable trials than the experiment requires."""


class ArtifactConflictError(DagsterRLError):
    """A different content was about to be written under an existing artifact key."""

    retryable = False


class SimulatedCrash(DagsterRLError):
    """Fault injection: the driver dies after a step (experiment `faults.crash_driver_at_step`)."""


class CheckFailedError(DagsterRLError):
    """A blocking check of a step's weights failed: the range stops at that step."""

    retryable = False


class MissingArtifactError(DagsterRLError):
    """An artifact asked for is not in the store (deleted, moved aside, or never made)."""


class CorruptArtifactError(DagsterRLError):
    """A stored artifact does not match its manifest (or has none that can be read)."""


class ArtifactMismatchError(DagsterRLError):
    """A stored artifact's content hash differs from the one Dagster's event log recorded for it:
    consistently changed (files and manifest together), or pointed to by a materialization that is
    not the step's own. The step stops; the fix is to re-run from the step that makes it."""

    retryable = False


class InvalidArtifactKeyError(DagsterRLError):
    """A key, kind or file name is not of the form the store builds paths from: never a path."""

    retryable = False


class SandboxError(DagsterRLError):
    """The rollout environment's sandbox root cannot hold sandboxes (a file, read-only, missing)."""

    retryable = False


class StoreWriteError(DagsterRLError):
    """The artifact store refused a write (read-only, full, unreachable)."""


class StoreLinkError(DagsterRLError):
    """A symbolic link stands in place of one of the artifact store's folders: never followed."""

    retryable = False

    def __init__(self, message: str, path: str = ""):
        super().__init__(message)
        self.path = path  # the link


class SettingError(DagsterRLError):
    """An environment variable or a resource setting the code location reads is missing or invalid."""

    retryable = False


class DagsterHomeError(DagsterRLError):
    """DAGSTER_HOME is unset: Dagster would use a throwaway instance and lose the runs' records."""

    retryable = False
