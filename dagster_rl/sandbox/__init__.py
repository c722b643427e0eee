"""The sandbox tier: programs a model wrote, run isolated and bounded, on this machine or in pods.

limits      what one program may use (CPU seconds, memory, processes, files, output, wall time)
calls       a program to run, and what running it returned (the tool call's record)
placement   the one interface both placements implement: `Sandboxes` opens an episode's `Workspace`
folders     episode folders on this machine, named by their owner; the folders of dead owners removed
outcomes    what both placements share: the program's environment, bounded output, the call's record
bubblewrap  the local placement (the embedded default): bubblewrap, an unprivileged user, rlimits
pods        the Kubernetes placement: a pod of the sandbox tier per episode
cli         `dagster-rl sandbox run FILE`: a file run in exactly the sandbox the tools use
"""
