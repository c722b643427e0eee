"""The Kubernetes placement of the sandbox tier (`dagster_rl.sandbox.pods`) against the FAKE cluster
(tests/fake_kubernetes.py, tests/fake_pods.py): its pods are validated and admitted, each one's
container is a process tree in namespaces of its own running as the pod's uid, and every exec goes
through a real websocket, as kubernetes' own client opens it, with the driver's RBAC enforced
(the rules deploy/k8s/rbac.yaml binds to the account the Helm chart gives the driver).

What a call does in a pod is what it does on a laptop (the same launcher, limits and outcomes);
what only a pod has is checked here: the exec carries a bootstrap and no program, every process
of a call is gone when it returns though a pod has no PID namespace per call, the pod's init
cannot be killed or traced by a program, a pod is never reused, and the failures that are the
cluster's (a pod never scheduled, an image never pulled, a missing runtime class, a pod deleted
mid-episode, an exec the RBAC refuses) are `SandboxUnavailable`, with every pod deleted.
"""

import os
import pickle
import shutil
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from dagster_rl.sandbox.calls import Program, SandboxUnavailable
from dagster_rl.sandbox.launcher import BOOT
from dagster_rl.sandbox.limits import SandboxLimits
from dagster_rl.sandbox.pod_api import OWNER_PROCESS, owner_process
from dagster_rl.sandbox.pod_manifest import APP_LABELS, INIT, OWNER_LABEL, OWNER_POD, Owner, PodSandboxSettings, sandbox_pod
from dagster_rl.sandbox.pod_pool import STATE_LABEL
from dagster_rl.sandbox.pods import PodSandboxes
from tests import REPO
from tests.fake_kubernetes import FakeKubernetes
from tests.machine import missing
from tests.test_k8s_trainer import driver_account

NS = "dagster-rl"
MARK = "pod_escape_probe_5c1d"
LIMITS = SandboxLimits(cpu_s=2, wall_s=6, memory_mb=256, processes=16, output_bytes=1024)
SLACK_S = 3.0
SETTINGS = PodSandboxSettings(
    namespace=NS, image="registry.example.com/dagster-rl:0.1.0", pool_size=0, startup_timeout_s=10, poll_interval_s=0.05,
    exec_grace_s=3,
)  # fmt: skip


@pytest.fixture
def cluster():
    if os.geteuid() != 0:
        missing("the fake kubelet plays a container runtime (namespaces, another uid): it needs root")
    for tool in ("bwrap", "setpriv"):
        if shutil.which(tool) is None:
            missing(f"the fake kubelet needs {tool}")
    fake = FakeKubernetes(rbac=driver_account())
    yield fake
    fake.close()


def placement(fake: FakeKubernetes, **settings) -> PodSandboxes:
    return PodSandboxes(SETTINGS.model_copy(update=settings), max_concurrency=4, max_retries=1, clients=fake.clients())


def traces() -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if MARK in cmdline and p.pid != os.getpid():
            found.append(f"{p.pid}: {cmdline[:120]}")
    return found


def sandbox_users_processes() -> list[str]:
    """Live processes of the sandbox pods' uid on this machine (a pod's init included: the fake must
    kill it too)."""
    return [f"{p.pid} {p.name()}" for p in psutil.process_iter() if _uid(p) == SETTINGS.run_as_user and _live(p)]


def _live(p: psutil.Process) -> bool:
    try:
        return p.status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:
        return False


def _uid(p: psutil.Process) -> int | None:
    try:
        return p.uids().real
    except psutil.Error:
        return None


def nothing_left(fake: FakeKubernetes) -> None:
    assert fake.objects()["pods"] == []
    deadline = time.monotonic() + 3.0  # a deleted pod's processes take a moment to die
    while (fake.running_processes() or traces() or sandbox_users_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.running_processes() == []
    assert traces() == [] and sandbox_users_processes() == []
    assert fake.denied == [], "the placement made calls deploy/k8s/rbac.yaml does not allow"


def test_an_episode_runs_in_a_pod_of_its_own_through_exec_and_its_pod_is_deleted(cluster):
    with placement(cluster) as sandboxes:
        sandboxes.check()
        with sandboxes.open("s0-p0-n0") as ws:
            ws.write("data/numbers.txt", b"1 2 3\n")
            first = ws.run(
                Program(python="open('sum.txt', 'w').write(str(sum(map(int, open('data/numbers.txt').read().split()))))"), LIMITS
            )
            second = ws.run(Program(python="import os, sys\nprint(open('sum.txt').read(), sys.stdin.read(), os.getuid(), os.getcwd())", stdin=b"fed"), LIMITS)  # fmt: skip
            (pod,) = [p for p in cluster.pods.pods.values()]
            assert pod.name == ws.pod
        assert (first.outcome, second.outcome) == ("exit", "exit") and second.stdout == "6 fed 65534 /work\n"
    # the pod as admitted: no token, the policy's labels, the tier's limits, a non-root user
    spec, meta = pod.manifest["spec"], pod.manifest["metadata"]
    assert spec["automountServiceAccountToken"] is False and spec["serviceAccountName"] == "dagster-rl-sandbox"
    assert APP_LABELS.items() <= meta["labels"].items() and meta["labels"][OWNER_LABEL]
    assert spec["containers"][0]["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"cpu": "500m", "memory": "1Gi"},
    }
    assert spec["containers"][0]["command"][-1] == INIT
    # every exec carried the bootstrap; the programs and the files went on stdin, never in the URL
    assert cluster.pods.execs and all(c == ["python3", "-I", "-S", "-c", BOOT] for c in cluster.pods.execs)
    nothing_left(cluster)


def run_hostile(fake: FakeKubernetes, source: str, limits: SandboxLimits = LIMITS):
    with placement(fake) as sandboxes, sandboxes.open("hostile") as ws:
        call = ws.run(Program(python=f"# {MARK}\n{source}"), limits)
        after = ws.run(Program(python="import os\nprint((sorted(os.listdir('/tmp')), sorted(p for p in os.listdir('/proc') if p.isdigit())))"), limits)  # fmt: skip
    time.sleep(0.2)
    nothing_left(fake)
    return call, after


def test_a_detached_background_process_is_gone_when_the_call_returns(cluster):
    t0 = time.monotonic()
    call, after = run_hostile(
        cluster,
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(30)\n    os._exit(0)\n"
        "open('/tmp/left', 'w').write('x')\nprint('detached')",
    )
    assert call.outcome == "exit" and call.stdout == "detached\n" and time.monotonic() - t0 < SLACK_S
    tmp, pids = eval(after.stdout)
    assert tmp == [] and len(pids) == 3  # /tmp emptied; the init, the launcher and the program itself


def test_a_fork_bomb_ends_at_its_limit_and_leaves_no_process(cluster):
    t0 = time.monotonic()
    call, _ = run_hostile(cluster, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert call.outcome == "timeout" and time.monotonic() - t0 < LIMITS.wall_s + SLACK_S


@pytest.mark.parametrize(
    ("source", "outcome", "signal"),
    [
        ("print('looping')\nwhile True:\n    pass", "timeout", 24),
        ("import time\ntime.sleep(60)", "timeout", 9),
        ("x = bytearray(12 * 2**30)", "memory", None),
        ("import sys\nwhile True:\n    sys.stdout.write('y' * 4096)", "output_limit", 9),
        ("open('big', 'wb').write(b'x' * (32 << 20))", "file_size", None),  # Python ignores SIGXFSZ: EFBIG
        ("import os\nos.kill(os.getpid(), 9)", "killed", 9),
    ],
    ids=["cpu", "wall", "memory", "output", "file_size", "killed"],
)
def test_a_limit_ends_a_call_with_the_outcome_a_laptop_gives(cluster, source, outcome, signal):
    call, _ = run_hostile(cluster, source)
    assert call.outcome == outcome and call.signal == signal
    if outcome == "output_limit":
        assert call.stdout == "y" * LIMITS.output_bytes and call.stdout_cut > 0
    assert call.seconds < LIMITS.wall_s + SLACK_S


def test_the_pods_init_cannot_be_killed_traced_or_read_by_a_program(cluster):
    call, after = run_hostile(
        cluster,
        "import os, signal\nfor sig in (signal.SIGTERM, signal.SIGKILL):\n    os.kill(1, sig)\n"
        "for path in ('/proc/1/mem', '/proc/1/environ'):\n    try:\n        open(path, 'rb').read(1)\n        print('read', path)\n"
        "    except OSError as e:\n        print('refused', e.errno)",
    )
    assert call.outcome == "exit" and call.stdout == "refused 13\nrefused 13\n"
    assert after.outcome == "exit"  # the pod still runs: the init is alive


def test_a_program_that_kills_its_launcher_is_killed_and_its_daemon_is_cleaned_up(cluster):
    call, after = run_hostile(
        cluster,
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\n    os._exit(0)\n"
        "os.kill(os.getppid(), 9)\ntime.sleep(30)",
    )
    assert call.outcome == "killed" and after.outcome == "exit" and len(eval(after.stdout)[1]) == 3


def test_the_driver_stops_a_call_whose_launcher_cannot(cluster):
    """A program that stops its launcher (SIGSTOP) leaves the wall limit to the driver: at wall_s +
    exec_grace_s it runs the cleanup itself, which kills the stopped launcher and the program."""
    call, after = run_hostile(cluster, "import os, signal, time\nos.kill(os.getppid(), signal.SIGSTOP)\ntime.sleep(60)")
    assert call.outcome == "timeout" and after.outcome == "exit"
    assert LIMITS.wall_s + SETTINGS.exec_grace_s <= call.seconds < LIMITS.wall_s + SETTINGS.exec_grace_s + SLACK_S


def warm_pods(fake: FakeKubernetes) -> set[str]:
    return {
        p.name
        for p in fake.pods.pods.values()
        if p.manifest["metadata"]["labels"].get(STATE_LABEL) == "warm" and p.phase == "Running"
    }


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition()


def test_a_pod_is_never_reused_and_the_pool_starts_pods_ahead(cluster):
    with placement(cluster, pool_size=2) as sandboxes:
        sandboxes.check()
        wait_for(lambda: len(warm_pods(cluster)) == 2)
        warm = warm_pods(cluster)
        seen = []
        for i in range(3):
            with sandboxes.open(f"e{i}") as ws:
                seen.append(ws.pod)
                call = ws.run(Program(python="import os\nprint(sorted(os.listdir('.')))\nopen('mine', 'w').write('x')"), LIMITS)
                assert call.stdout == "[]\n"  # nothing of an earlier episode
            wait_for(lambda: len(warm_pods(cluster)) == 2)  # the driver refills the pool
        assert len(set(seen)) == 3 and seen[0] in warm  # the first was warm
    nothing_left(cluster)


def test_a_copy_in_another_process_takes_a_warm_pod_and_never_one_another_episode_holds(cluster, tmp_path):
    """A trial's environment runs in a process of its own, which receives the placement pickled: it
    takes a warm pod of the driver's pool (a conditional update: never one another episode holds),
    runs its program there, and deletes the pod; the driver refills the pool."""
    with placement(cluster, pool_size=1) as sandboxes:
        sandboxes.check()
        wait_for(lambda: len(warm_pods(cluster)) == 1)
        (warm,) = warm_pods(cluster)
        with sandboxes.open("driver's") as mine:  # the driver takes the warm pod itself
            assert mine.pod == warm
            wait_for(lambda: len(warm_pods(cluster)) == 1)
            (next_warm,) = warm_pods(cluster)
            child = subprocess.run(
                [sys.executable, "-c", CHILD], input=pickle.dumps(sandboxes), capture_output=True, timeout=120,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )  # fmt: skip
            assert child.returncode == 0, child.stderr.decode()[-3000:]
            pod, stdout = child.stdout.decode().split(" ", 1)
            assert pod == next_warm != mine.pod and stdout == "42\n"
            assert (NS, pod) not in cluster.pods.pods  # the child deleted its pod
            assert mine.run(Program(python="print(1)"), LIMITS).stdout == "1\n"
    nothing_left(cluster)


CHILD = """import pickle, sys
from dagster_rl.sandbox.calls import Program
from dagster_rl.sandbox.limits import SandboxLimits
sandboxes = pickle.loads(sys.stdin.buffer.read())
assert not sandboxes.creator
with sandboxes.open("child") as ws:
    call = ws.run(Program(python="print(6 * 7)"), SandboxLimits())
    print(ws.pod, call.stdout, end="")
"""


def test_the_tier_holds_at_most_max_concurrency_pods_for_episodes(cluster):
    """A second episode waits for the first one's pod to go; past `slot_timeout_s` it is infrastructure."""
    sandboxes = PodSandboxes(
        SETTINGS.model_copy(update={"slot_timeout_s": 2.0}), max_concurrency=1, max_retries=0, clients=cluster.clients()
    )
    first = sandboxes.open("a")
    threading.Timer(0.5, first.close).start()
    t0 = time.monotonic()
    second = sandboxes.open("b")
    assert 0.5 <= time.monotonic() - t0 < 2.0 and len(cluster.objects()["pods"]) == 1
    with pytest.raises(SandboxUnavailable, match="all 1 sandbox pods stayed in use for 2 s"):
        sandboxes.open("c")
    second.close()
    sandboxes.close()
    nothing_left(cluster)


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        (lambda fake: setattr(fake.pods, "unschedulable", True), r"did not start within 1 s: not scheduled: Unschedulable 0/1 nodes are available: 1 Insufficient cpu"),
        (lambda fake: fake.pods.image_errors.update({SETTINGS.image: "ImagePullBackOff"}), r"did not start within 1 s: container ImagePullBackOff"),
        (lambda fake: fake.pods.image_errors.update({SETTINGS.image: "InvalidImageName"}), r"cannot start: container InvalidImageName"),
        (lambda fake: fake.pods.runtime_classes.clear(), r'HTTP 403 Forbidden: .*RuntimeClass \\"gvisor\\" not found'),
    ],
    ids=["unschedulable", "image-pull", "invalid-image", "no-runtime-class"],
)  # fmt: skip
def test_a_pod_that_cannot_run_is_sandbox_unavailable_and_deleted(cluster, setup, expected):
    setup(cluster)
    sandboxes = placement(cluster, startup_timeout_s=1, runtime_class_name="gvisor")
    with pytest.raises(SandboxUnavailable, match=expected):
        sandboxes.open("e")
    nothing_left(cluster)


def test_a_pod_deleted_during_an_episode_fails_its_calls_as_infrastructure(cluster):
    with placement(cluster) as sandboxes, sandboxes.open("e") as ws:
        assert ws.run(Program(python="print(1)"), LIMITS).outcome == "exit"
        cluster.core.delete_namespaced_pod(ws.pod, NS)
        with pytest.raises(SandboxUnavailable, match=rf"sandbox pod {ws.pod} \(episode e\): it is gone"):
            ws.run(Program(python="print(2)"), LIMITS)
        with pytest.raises(SandboxUnavailable, match="is lost"):
            ws.write("x", b"x")
    nothing_left(cluster)


def test_closing_an_episode_during_a_call_deletes_its_pod_and_fails_the_call(cluster):
    """The episode ended from elsewhere (its trial's timeout, say): the pod goes at once, and the
    call that ran in it is infrastructure's failure, not an outcome."""
    sandboxes = placement(cluster)
    ws = sandboxes.open("e")
    threading.Timer(0.5, ws.close).start()
    t0 = time.monotonic()
    with pytest.raises(SandboxUnavailable, match=rf"sandbox pod {ws.pod} \(episode e\)"):
        ws.run(Program(python=f"# {MARK}\nimport time\ntime.sleep(30)"), LIMITS)
    assert time.monotonic() - t0 < SLACK_S
    nothing_left(cluster)


def test_an_exec_the_rbac_refuses_is_sandbox_unavailable_naming_the_role(cluster):
    account, rules = driver_account()
    cluster.rbac = (account, [r for r in rules if "pods/exec" not in r["resources"]])
    with pytest.raises(SandboxUnavailable, match=r"403 Forbidden.*pods/exec create .*kubectl apply -f deploy/k8s/rbac.yaml"):
        placement(cluster).check()
    assert ("", "pods/exec", "create") in cluster.denied
    cluster.denied.clear()
    nothing_left(cluster)


def test_pods_of_a_driver_that_is_gone_are_removed_and_a_live_drivers_kept(cluster):
    """What the next driver removes: pods whose owner pod is gone, and pods made by a process of this
    host (this pod, on a cluster) that is gone; never a live driver's, whose pod or process still runs."""
    driver = cluster.core.create_namespaced_pod(NS, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "driver", "namespace": NS},
        "spec": {"containers": [{"name": "driver", "image": "python", "command": ["sleep", "600"]}]},
    })  # fmt: skip
    host = socket.gethostname()
    leftovers = {  # name: (owner, the process that made it)
        "drl-sandbox-owner-pod-gone": (Owner(id="0b0e5a5e", pod="driver-that-is-gone", uid="0b0e5a5e"), "elsewhere/7:7"),
        "drl-sandbox-owner-pod-alive": (Owner(id=driver.metadata.uid, pod="driver", uid=driver.metadata.uid), "elsewhere/7:7"),
        "drl-sandbox-process-gone": (Owner(id="local-1"), f"{host}/1:1"),  # pid 1 did not start at tick 1
        "drl-sandbox-process-alive": (Owner(id="local-2"), owner_process()),
    }
    for name, (owner, process) in leftovers.items():
        body = sandbox_pod(SETTINGS, name, NS, owner)
        body["metadata"].setdefault("annotations", {})[OWNER_PROCESS] = process
        cluster.core.create_namespaced_pod(NS, body)
    made = cluster.pods.pods[(NS, "drl-sandbox-owner-pod-alive")].manifest["metadata"]
    assert made["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Pod", "name": "driver", "uid": driver.metadata.uid, "blockOwnerDeletion": False}
    ]
    assert made["annotations"][OWNER_POD] == "driver"
    with placement(cluster) as sandboxes, sandboxes.open("e") as ws:
        assert cluster.pods.pods[(NS, ws.pod)].manifest["metadata"]["annotations"][OWNER_PROCESS] == owner_process()
    assert sorted(cluster.objects()["pods"]) == ["driver", "drl-sandbox-owner-pod-alive", "drl-sandbox-process-alive"]
    for name in ("driver", "drl-sandbox-owner-pod-alive", "drl-sandbox-process-alive"):
        cluster.core.delete_namespaced_pod(name, NS)
    nothing_left(cluster)


def test_limits_that_do_not_fit_the_pod_are_refused_before_any_pod(cluster):
    with pytest.raises(ValueError, match=r"memory_mb 2048 does not fit a sandbox pod: its memory_limit 1Gi leaves 816 MiB"):
        PodSandboxes(SETTINGS, 4, 2, clients=cluster.clients(), limits=SandboxLimits(memory_mb=2048))
    assert cluster.calls == []
