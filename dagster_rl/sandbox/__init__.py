"""The sandbox tier: programs a model wrote, run isolated and bounded, on this machine or in pods.

limits      what one program may use (CPU seconds, memory, processes, files, output, wall time)
calls       a program to run, and what running it returned (the tool call's record)
placement   the one interface both placements implement: `Sandboxes` opens an episode's `Workspace`
folders     episode folders on this machine, named by their owner; the folders of dead owners removed
outcomes    what both placements share: the program's environment, bounded output, the call's record
launcher    the first process inside a sandbox, in either placement: rlimits, the program, its report
launcher_main  the launcher's own source (standard library only), run by the sandbox's interpreter
bubblewrap  the local placement (the embedded default): bubblewrap, an unprivileged user, rlimits
pods        the Kubernetes placement: a fresh pod of the sandbox tier per episode, from a pool started ahead
pod_manifest  the sandbox pods' settings (`PodSandboxSettings`) and manifest: no token, the policy's labels, limits
pod_exec    one exec into a sandbox pod (the API server's pods/exec websocket) and the launcher's frames
pod_api     the Kubernetes API as the sandbox pods need it: clients, owners, a pod's state, leftovers removed
cli         `dagster-rl sandbox run FILE`: a file run in exactly the sandbox the tools use
"""
