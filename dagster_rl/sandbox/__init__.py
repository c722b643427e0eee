"""The sandbox tier: programs a model wrote, run isolated and bounded, on this machine or in pods.
Nothing here imports Dagster or torch.

    limits      what one program may use (CPU seconds, memory, processes, files, output, wall time)
    calls       a program to run, and what running it returned (the tool call's record)
    placement   the one interface both placements implement: `Sandboxes` opens an episode's `Workspace`
    outcomes    what both placements share: the program's environment, bounded output, the call's record
    launcher    the first process in a sandbox: sets the program's rlimits, runs it, reports how it ended
                (`launcher_main` holds its standard-library source)
    folders     episode folders on this machine, named by their owner; the folders of dead owners removed
    bubblewrap  the local placement (the embedded default): bubblewrap, an unprivileged user, rlimits
    pods        the Kubernetes placement: a fresh pod of the sandbox tier per episode, from a pool started ahead
    pod_manifest  the sandbox pods' settings (`PodSandboxSettings`) and manifest: no token, the policy's labels
    pod_exec    one exec into a sandbox pod (the API server's pods/exec websocket) and the launcher's frames
    pod_api     the Kubernetes API as the sandbox pods need it: clients, owners, a pod's state, leftovers
    pod_pool    sandbox pods as the cluster holds them: started, taken by one episode, the warm pool kept full
    slots       a tier's concurrency limit across the processes of one machine (lock files)
    cli         `dagster-rl sandbox run FILE`: a file run in exactly the sandbox the tools use
"""
