"""Processes the loop starts and keeps: processes that die with their parent, workers that outlive
one call, pods and their Kubernetes manifests.

    lifetime       a process that must not outlive its parent; who a process is
    workers        workers a backend holds across calls, and how a launcher keeps them
    pods           what a set of pods needs and runs (`PodJob`), the launcher protocol
    k8s_manifests  the Indexed Job and headless Service of a `PodJob`
    function_workers  worker processes that call code we do not control, killed past a call's deadline
"""
