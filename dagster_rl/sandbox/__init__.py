"""The sandbox tier: programs a model wrote, run isolated and bounded, on this machine or in pods.
Nothing here imports Dagster or torch.

    limits      what one program may use (CPU seconds, memory, processes, files, output, wall time)
    calls       a program to run, and what running it returned (the tool call's record)
    placement   the one interface both placements implement: `Sandboxes` opens an episode's `Workspace`
    launcher    the first process in a sandbox: sets the program's rlimits, runs it, reports how it ended
                (`launcher_main` holds its standard-library source)
    folders     episode folders on this machine, named by their owner; the folders of dead owners removed
    bubblewrap  the local placement (the embedded default): bubblewrap, an unprivileged user, rlimits
    cli         `dagster-rl sandbox run FILE`: a file run in exactly the sandbox the tools use
"""
